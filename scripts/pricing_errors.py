"""How well the cost model prices the steps an engine runs: observed over predicted decode
time per step, by context bucket and batch size, over Spec-Bench prompts of several
categories interleaved (short and long prompts mixed, as a server or a benchmark sees them).

    python scripts/pricing_errors.py --dataset question.jsonl [--drafter ngram] [--categories translation,rag,mt_bench,summarization] [--per-category 4]

Each step's prediction is ``CostModel.t_decode_us(b)`` just before the step's time is fed
back (so at the step's own context). Prints the median ratio and the median observed time
per (context range, size class). Greedy, 128 tokens a prompt, one engine.
"""

from __future__ import annotations

import argparse

import numpy as np

from localspec import Engine, SamplingParams
from localspec.bench.dataset import interleave, load_questions, resolve_dataset, select_prompts
from localspec.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--dataset", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="translation,rag,mt_bench,summarization")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    a = ap.parse_args()
    qs = load_questions(resolve_dataset(a.dataset))
    prompts = interleave(select_prompts(qs, a.categories.split(","), a.per_category))
    e = Engine(str(default_model_path()), drafter=a.drafter, n_ctx=4096)
    pol = e.policy
    inner = pol.observe_step
    log: list[tuple[int, int, float, float]] = []

    def observe_step(b: int, t_decode_us: float, t_host_us: float) -> None:
        log.append((pol.cost.context, b, pol.cost.t_decode_us(b), t_decode_us))
        inner(b, t_decode_us, t_host_us)

    pol.observe_step = observe_step
    try:
        for bp in prompts:
            e.reset()
            e.generate(bp.model_input, max_tokens=a.max_tokens, sampling=SamplingParams.greedy())
    finally:
        e.close()
    x = np.array(log)
    for lo, hi in [(0, 512), (512, 1024), (1024, 2048), (2048, 1 << 30)]:
        for b0, b1 in [(1, 1), (2, 2), (3, 4), (5, 8), (9, 64)]:
            m = (x[:, 0] >= lo) & (x[:, 0] < hi) & (x[:, 1] >= b0) & (x[:, 1] <= b1)
            if m.any():
                print(f"context {lo}-{hi if hi < 1 << 30 else ''}, b {b0}-{b1}: {int(m.sum()):4d} steps, "
                      f"observed / predicted {np.median(x[m, 3] / x[m, 2]):.2f}, observed {np.median(x[m, 3]) / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
