"""How long a running request stalls while a long prompt joins the batch (issue 13).

    python scripts/prefill_stall.py [--chunks 64,128,256,100000] [--prompt-tokens 1000]

One request decodes (greedy, n-gram drafter); after its 16th token a second request with a
long prompt (synthetic text) is submitted. For each ``prefill_chunk`` it prints the first request's
longest gap between two emitted tokens while the second is prefilled, the second request's
time to first token, and the whole run's wall time. ``prefill_chunk`` >= the prompt is the old
behaviour: the whole prompt in one step that everybody waits for.
"""

from __future__ import annotations

import argparse
import time

from localspec import SamplingParams
from localspec.backend import Model
from localspec.models import default_model_path
from localspec.scheduler import BatchScheduler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="64,128,256,100000")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    a = ap.parse_args()
    m = Model(default_model_path())
    words = " ".join(f"Line {i}: the {c} lamp in room {i % 11} was switched {('on', 'off')[i % 2]} at {i % 24}:00."
                     for i, c in enumerate(["red", "amber", "green", "white", "blue"] * 60))  # fmt: skip
    long_prompt = m.tokenize(words)[: a.prompt_tokens]
    short = m.tokenize("The history of the lighthouse begins")
    print("| prefill_chunk | running request: longest gap (ms) | its median gap (ms) | long prompt: time to first token (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for chunk in [int(x) for x in a.chunks.split(",")]:
        sched = BatchScheduler(m, parallel=2, n_ctx=2048, prefill_chunk=chunk, prompt_cache=0)
        try:
            stamps: list[float] = []
            t0 = time.perf_counter()
            ja = sched.submit(short, max_tokens=160, sampling=SamplingParams.greedy(),
                              on_chunk=lambda c: stamps.append(time.perf_counter()))  # fmt: skip
            while len(stamps) < 16:
                sched.step()
            jb = sched.submit(long_prompt, max_tokens=8, sampling=SamplingParams.greedy())
            n0 = len(stamps)
            while not jb.done.is_set():
                sched.step()
            n1 = len(stamps)
            sched.run_until_idle()
            wall = time.perf_counter() - t0
            gaps = [b - x for x, b in zip(stamps[n0 - 1 : n1], stamps[n0:n1])]
            rb = jb.wait()
            ja.wait()
        finally:
            sched.close()
        gaps.sort()
        print(f"| {chunk} | {1e3 * max(gaps):.0f} | {1e3 * gaps[len(gaps) // 2]:.0f} | {rb.stats.t_prefill_us / 1e6:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
