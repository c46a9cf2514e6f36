"""Take docs/chat.svg: a real `localspec chat` session with the default model, driven headless.

    python scripts/chat_screenshot.py [--out docs/chat.svg] [--size 120x40]

Greedy decoding with the n-gram drafter; the timings in the picture are those measured on
the machine that runs the script.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from localspec import Engine, SamplingParams
from localspec.tui import ChatApp

CODE = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
PROMPTS = ["What is the capital of France?", "Copy this code:\n" + CODE, "Copy it again."]


async def session(out: str, size: tuple[int, int], max_tokens: int) -> None:
    engine = Engine(drafter="ngram")
    try:
        app = ChatApp(engine=engine, sampling=SamplingParams.greedy(), max_tokens=max_tokens)
        async with app.run_test(size=size) as pilot:
            for text in PROMPTS:
                app.query_one("#prompt").value = text
                await pilot.press("enter")
                t0 = time.monotonic()
                while app.state != "idle" and time.monotonic() - t0 < 300:
                    await pilot.pause(0.05)
            await pilot.pause(0.3)
            app.save_screenshot(out)
            for t in app.session.turns:
                s = t.stats
                print(f"{s.n_generated_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, {s.token_sources}")
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/chat.svg")
    p.add_argument("--size", default="120x40", help="terminal size COLSxROWS")
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args()
    cols, rows = (int(x) for x in a.size.split("x"))
    asyncio.run(session(a.out, (cols, rows), a.max_tokens))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
