"""Decode time per batch size at a real context, sizes interleaved round by round (so a burst
of load spoils one sample of many sizes, which the median drops).

    python scripts/measure_batch_costs.py [--rounds 12] [--sizes 1,2,3,4,5,6,7,8,9,10,12,16]

Prints the median milliseconds and the ratio to a single-token decode per size. Used for the
cost-model table in docs/architecture.md (odd batches dearer than the next even one). Unlike
``costmodel.calibrate`` (random tokens on a bare context, what the policy starts from), it
decodes through the engine's own path (``SequenceCache.decode_tree`` after a real prompt):
a check that the calibration's shape is what generation pays.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from localspec import Engine, SamplingParams
from localspec.backend import Model
from localspec.bench.dataset import resolve_dataset
from localspec.models import default_model_path
from localspec.tree import TokenTree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--sizes", default="1,2,3,4,5,6,7,8,9,10,12,16")
    ap.add_argument("-m", "--model", default=None)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    engine = Engine(Model(a.model or default_model_path()), drafter="none", n_ctx=4096)
    prompt = json.loads(resolve_dataset("code").read_text().splitlines()[3])["turns"][0]
    engine.generate(prompt, max_tokens=8, sampling=SamplingParams.greedy())  # a real context
    cache = engine.cache
    rng = np.random.default_rng(0)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(a.rounds):
        for b in rng.permutation(sizes):
            tree = TokenTree.chain(1, [int(x) for x in rng.integers(100, 5000, int(b) - 1)])
            t0 = time.perf_counter()
            lay, _ = cache.decode_tree(tree)
            times[int(b)].append(time.perf_counter() - t0)
            cache.commit(tree, lay, [])  # keeps the root: the context grows by one per decode
    t1 = float(np.median(times[1])) if 1 in times else None
    print("| b | median ms | t(b) / t(1) |\n|---|---|---|")
    for b in sizes:
        m = float(np.median(times[b]))
        print(f"| {b} | {1e3 * m:.1f} | {m / t1:.2f} |" if t1 else f"| {b} | {1e3 * m:.1f} | |")
    engine.close()


if __name__ == "__main__":
    main()
