"""Decode time per batch size after contexts of several lengths: what a verified row costs
as the prompt grows (``CostModel``'s context buckets, docs/architecture.md).

    python scripts/measure_context_costs.py [--contexts 64,256,512,1024,2048,3072] [--rounds 5]

For each context length it decodes that many random tokens, then ``--rounds`` rounds over the
sizes (each batch removed again), and prints t(1), the median ratio t(b) / t(1) per size and
the extra time per row beyond the first, ``(t(b) - t(1)) / (b - 1)`` in ms. Random tokens
on the engine's own context (the exact kernels, the readout), as ``costmodel.calibrate``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from localspec import Engine
from localspec.backend import Batch
from localspec.models import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="64,256,512,1024,2048,3072")
    ap.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-m", "--model", default=None)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    e = Engine(str(a.model or default_model_path()), drafter="none", n_ctx=max(contexts) + max(sizes) + 64)
    ctx = e.ctx
    rng = np.random.default_rng(1)
    batch = Batch(512, 1)
    try:
        for n in contexts:
            ctx.clear()
            pos = 0
            while pos < n:
                k = min(512, n - pos)
                batch.set_sequence(rng.integers(100, 32000, k), pos, output="none")
                ctx.decode(batch)
                pos += k
            times: dict[int, list[float]] = {b: [] for b in sizes}
            for _ in range(a.rounds):
                for b in sizes:
                    batch.set_sequence(rng.integers(100, 32000, b), n, output="all")
                    t0 = time.perf_counter()
                    ctx.decode(batch)
                    ctx.synchronize()
                    times[b].append((time.perf_counter() - t0) * 1e3)
                    ctx.seq_rm(0, n, -1)
            med = {b: float(np.median(v)) for b, v in times.items()}
            t1 = med[sizes[0]]
            ratios = " ".join(f"r{b}={med[b] / t1:.2f}" for b in sizes[1:])
            rows = " ".join(f"{(med[b] - t1) / (b - 1):.2f}" for b in sizes[1:])
            print(f"context {n:5d}: t1 {t1:5.1f} ms  {ratios}  ms per extra row: {rows}", flush=True)
    finally:
        e.close()


if __name__ == "__main__":
    main()
