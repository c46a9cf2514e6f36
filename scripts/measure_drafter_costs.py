"""Measure what one draft level costs next to a target decode (median µs, single-token and
batched), for a derived draft model and an EAGLE-3 head, on this machine.

    python scripts/measure_drafter_costs.py --draft draft-16.gguf --eagle head.gguf
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from localspec.backend import Batch, Context, Model
from localspec.backend.batch_ext import ExtBatch
from localspec.models import default_model_path


def median_decode_us(ctx: Context, sizes, reps: int, n_prefix: int = 256) -> dict[int, float]:
    rng = np.random.default_rng(0)
    batch = Batch(max(n_prefix, *sizes))
    batch.set_sequence(rng.integers(100, 30000, n_prefix), 0, output="none")
    ctx.decode(batch)
    out = {}
    for b in sizes:
        ts = []
        for _ in range(reps):
            batch.set_sequence(rng.integers(100, 30000, b), n_prefix, output="all")
            t0 = time.perf_counter()
            ctx.decode(batch)
            ctx.synchronize()
            ts.append((time.perf_counter() - t0) * 1e6)
            ctx.seq_rm(0, n_prefix, -1)
        out[b] = float(np.median(ts))
    ctx.clear()
    return out


def eagle_level_us(head: Model, target_ctx: Context, sizes, reps: int) -> dict[int, float]:
    ctx = Context(head, n_ctx=1024, n_seq_max=1, ctx_other=target_ctx)
    batch = ExtBatch(ctx.handle)
    rng = np.random.default_rng(0)
    out = {}
    try:
        for b in sizes:
            ts = []
            for _ in range(reps):
                batch.clear()
                for i in range(b):
                    batch.add(token=int(rng.integers(100, 30000)), pos=i, seq_id=0, output=True,
                              embd=rng.standard_normal(head.n_embd).astype(np.float32))
                t0 = time.perf_counter()
                ctx.process(batch)
                ctx.synchronize()
                ts.append((time.perf_counter() - t0) * 1e6)
                ctx.clear()
            out[b] = float(np.median(ts))
    finally:
        batch.close()
        ctx.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", action="append", default=[])
    ap.add_argument("--eagle", default=None)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    sizes = (1, 2, 4, 8)
    target = Model(default_model_path())
    tctx = Context(target, n_ctx=1024)
    res = {"target": median_decode_us(tctx, sizes, a.reps)}
    for path in a.draft:
        m = Model(path)
        c = Context(m, n_ctx=1024)
        res[path] = median_decode_us(c, sizes, a.reps)
        c.close()
        m.close()
    if a.eagle:
        h = Model(a.eagle)
        res[a.eagle] = eagle_level_us(h, tctx, sizes, a.reps)
        h.close()
    tctx.close()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
