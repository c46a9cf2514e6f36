"""Greedy acceptance of layer-truncated drafts of the default model (docs/drafters.md).

    python scripts/derived_acceptance.py draft-6.gguf draft-12.gguf draft-16.gguf

Each draft proposes fixed chains of 4 (no policy) on the same prompt; prints per-depth
acceptance, mean acceptance length and whether the output equals plain greedy decoding.
"""

from __future__ import annotations

import sys

from localspec import Engine, SamplingParams
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.policy import TreeShape

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main(paths: list[str], n: int = 96) -> None:
    greedy = SamplingParams.greedy()
    with Engine(drafter="none", n_ctx=2048) as e:
        ref = e.generate(PROMPT, max_tokens=n, sampling=greedy)
        for path in paths:
            e.set_drafter(DraftModelDrafter(path, shape=TreeShape(4, 1, 5, 0.0)))
            e.adaptive = False
            e.reset()
            r = e.generate(PROMPT, max_tokens=n, sampling=greedy)
            s = r.stats
            per_depth = ", ".join(f"{a:.2f}" for a in s.acceptance_per_depth)
            print(f"{path}: per-depth acceptance {per_depth}; mean acceptance length "
                  f"{s.mean_acceptance_length:.2f}; identical to plain: {r.token_ids == ref.token_ids}")


if __name__ == "__main__":
    main(sys.argv[1:])
