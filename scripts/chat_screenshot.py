"""Take docs/chat.svg: a `localspec chat` session driven headless, saved with Textual's
``save_screenshot`` once the last answer has finished (its statistics shown).

    python scripts/chat_screenshot.py [--out docs/chat.svg] [--size 120x36] [--scripted]

By default a real session with the default model: greedy decoding, the n-gram drafter, the
prompts below; the speeds in the picture are those measured on the machine that runs the
script (take it on a quiet machine). ``--scripted`` uses the snapshot tests' scripted engine
(``tests/tui_fakes.py``: fixed answers, statistics and timings, no model) for a picture of the
layout that is the same on every run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from localspec import SamplingParams
from localspec.tui import ChatApp

CODE = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"
PROMPTS = ["What is the capital of France?", "Copy this code:\n" + CODE]
SCRIPTED_PROMPTS = ["Count to four, please.", "What do the colours mean?"]  # what tui_fakes.ANSWERS answer


async def wait_until(pilot, cond, what: str, timeout_s: float) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"chat_screenshot: timed out waiting for {what}")
        await pilot.pause(0.05)


async def session(app: ChatApp, prompts: list[str], out: str, size: tuple[int, int], timeout_s: float) -> None:
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.session.engine is not None and app.state == "idle", "the engine", timeout_s)
        for text in prompts:
            n = len(app.session.turns)
            app.query_one("#prompt").value = text
            await pilot.press("enter")
            await wait_until(pilot, lambda n=n: len(app.session.turns) == n + 1 and app.state == "idle"
                             and not app.session.generating, "the answer", timeout_s)  # fmt: skip
        for w in app.screen.query("Input, TextArea"):  # a blinking cursor is drawn or not by chance
            w.cursor_blink = False
        await pilot.pause()
        app.save_screenshot(out)
        for t in app.session.turns:
            s = t.stats
            print(f"{s.n_generated_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, {s.num_accepted_tokens}/"
                  f"{s.num_draft_tokens} drafted tokens accepted, finish {t.finish_reason}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/chat.svg")
    p.add_argument("--size", default="120x36", help="terminal size COLSxROWS (120 columns or more show the statistics)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--scripted", action="store_true", help="the snapshot tests' scripted engine instead of the model")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the model or an answer")
    a = p.parse_args()
    cols, rows = (int(x) for x in a.size.split("x"))
    if a.scripted:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tui_fakes import FakeClock, FakeEngine

        engine, clock, prompts = FakeEngine(), {"clock": FakeClock()}, SCRIPTED_PROMPTS
    else:
        from localspec import Engine

        engine, clock, prompts = Engine(drafter="ngram"), {}, PROMPTS
    try:
        app = ChatApp(engine=engine, sampling=SamplingParams.greedy(), max_tokens=a.max_tokens, **clock)
        asyncio.run(session(app, prompts, a.out, (cols, rows), a.timeout))
    finally:
        engine.close()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
