"""Micro-benchmark: what capturing target features (``FeatureTap``, for EAGLE-3) costs per decode.

Two contexts on the same model, one with the tap on the given layers, decode the same
batches (after the same prefix) in alternation; the table reports the median decode time of
each, the difference, and the time spent inside the Python callback.
"""

from __future__ import annotations

import time

import numpy as np

from ..backend import Batch, Context, Model
from ..backend.features import FeatureTap


def bench_features(model: Model, layers=(2, 9, 15), *, sizes=(1, 8), reps: int = 30, n_prefix: int = 256) -> list[dict]:
    """Median decode time (µs) with and without the tap, per batch size.

    Returns:
        one dict per size: ``batch``, ``t_plain_us``, ``t_tap_us``, ``t_overhead_us``,
        ``t_callback_us`` (median time inside the callback per decode).
    """
    tap = FeatureTap(layers, model.n_layer, model.n_embd)
    ctxs = {"plain": Context(model, n_ctx=1024), "tap": Context(model, n_ctx=1024, cb_eval=tap.callback)}
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 30000, n_prefix)
    rows = []
    try:
        batch = Batch(max(n_prefix, *sizes))
        for ctx in ctxs.values():
            batch.set_sequence(prefix, 0, output="none")
            ctx.decode(batch)
        tap.take()
        for b in sizes:
            times: dict[str, list[float]] = {"plain": [], "tap": []}
            cb: list[float] = []
            for _ in range(reps):
                toks = rng.integers(100, 30000, b)
                for name, ctx in ctxs.items():
                    batch.set_sequence(toks, n_prefix, output="all")
                    t_cb0 = tap.t_callback_us
                    t0 = time.perf_counter()
                    ctx.decode(batch)
                    ctx.synchronize()
                    times[name].append((time.perf_counter() - t0) * 1e6)
                    if name == "tap":
                        cb.append(tap.t_callback_us - t_cb0)
                        tap.take()
                    ctx.seq_rm(0, n_prefix, -1)
            plain, tapped = float(np.median(times["plain"])), float(np.median(times["tap"]))
            rows.append(
                {
                    "batch": b,
                    "t_plain_us": plain,
                    "t_tap_us": tapped,
                    "t_overhead_us": tapped - plain,
                    "t_callback_us": float(np.median(cb)),
                }
            )
    finally:
        for ctx in ctxs.values():
            ctx.close()
    return rows
