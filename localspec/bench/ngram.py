"""Cost of the n-gram drafter per step as the history grows (1k, 8k, 32k tokens, ...).

The history is synthetic but text-like: a Zipf-distributed token stream in which earlier
spans are copied back in, as in documents that quote themselves, so lookups find matches of
every order. Each measured step appends one token and proposes a tree, as the engine does.
"""

from __future__ import annotations

import time

import numpy as np

from ..drafters.ngram import NgramDrafter
from ..drafters.ngram_index import NgramIndex


def synthetic_history(n: int, *, vocab: int = 32000, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        if len(out) > 64 and rng.random() < 0.3:
            start = int(rng.integers(0, len(out) - 32))
            out.extend(out[start : start + int(rng.integers(4, 32))])
        else:
            out.extend((rng.zipf(1.3, 16) % vocab).tolist())
    return out[:n]


def bench_ngram(
    sizes=(1024, 8192, 32768), *, steps: int = 300, max_depth: int = 16, max_nodes: int = 64, make_drafter=None, index: str = "default"
) -> list[dict]:
    """Per history size: µs per step (append + propose) and µs per index build token.

    Args:
        index: ``"native"`` (the C index and trie), ``"reference"`` (the Python
            ``NgramIndex``) or ``"default"`` (what ``NgramDrafter()`` picks).
    """
    if make_drafter is not None:
        make = make_drafter
    elif index == "reference":
        make = lambda: NgramDrafter(index=NgramIndex(8))  # noqa: E731
    elif index == "native":
        from ..native.ngram import NativeNgramIndex

        make = lambda: NgramDrafter(index=NativeNgramIndex(8))  # noqa: E731
    else:
        make = NgramDrafter
    rows = []
    for n in sizes:
        hist = synthetic_history(n + steps + 1)
        d = make()
        t0 = time.perf_counter()
        d.begin(hist[:n])
        t_build = time.perf_counter() - t0
        arr = _step_us(d, hist[n:], steps, max_depth, max_nodes)
        rows.append(
            {
                "index": type(d.index).__name__,
                "history_tokens": n,
                "step_us_median": float(np.median(arr)),
                "step_us_p90": float(np.percentile(arr, 90)),
                "build_us_per_token": t_build * 1e6 / n,
            }
        )
    return rows


def _step_us(d, upcoming, steps: int, max_depth: int, max_nodes: int) -> np.ndarray:
    """[steps] µs of each drafter step: ``accept`` the next token of ``upcoming``, ``propose``."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        d.accept([upcoming[i]])
        d.propose(max_depth, max_nodes)
        times.append(time.perf_counter() - t0)
    return np.array(times) * 1e6


def bench_memory(sizes=(0, 100_000, 1_000_000), *, history: int = 4096, steps: int = 300, max_depth: int = 16,
                 max_nodes: int = 64, budget_mib: float = 128.0) -> list[dict]:  # fmt: skip
    """Per number of tokens stored in a drafting memory (``DraftMemory``): µs per step of an
    n-gram drafter with that memory (append + propose, the request's history ``history``
    tokens), and µs per token written. The memory holds the same kind of synthetic text in
    documents of 2,000 tokens; the request's history is a different stream of that text."""
    from ..drafters.memory import DraftMemory

    rows = []
    for n in sizes:
        mem = DraftMemory(budget_mib)
        corpus = synthetic_history(max(n, 1), seed=1)
        t0 = time.perf_counter()
        for s in range(0, n, 2000):
            mem.write(corpus[s : s + 2000])
        t_write = time.perf_counter() - t0
        hist = synthetic_history(history + steps + 1, seed=2)
        d = NgramDrafter(memory=mem)
        d.begin(hist[:history])
        arr = _step_us(d, hist[history:], steps, max_depth, max_nodes)
        rows.append({"memory_tokens": mem.info().tokens, "history_tokens": history, "step_us_median": float(np.median(arr)),
                     "step_us_p90": float(np.percentile(arr, 90)), "write_us_per_token": t_write * 1e6 / max(n, 1)})  # fmt: skip
    return rows
