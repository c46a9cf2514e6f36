"""Micro-benchmark: what capturing target features (``FeatureTap``, for EAGLE-3) costs per decode.

Three contexts on the same model -- no tap, the tap with the Python callback (the reference)
and, when the C kernels are built, with the C callback (``native.tap``) -- decode the same
batches (after the same prefix) in alternation; the table reports the median decode time of
each, the differences, and the time spent inside the Python callback.
"""

from __future__ import annotations

import time

import numpy as np

from .. import native
from ..backend import Batch, Context, Model
from ..backend.features import FeatureTap


def bench_features(model: Model, layers=(2, 9, 15), *, sizes=(1, 8), reps: int = 30, n_prefix: int = 256) -> list[dict]:
    """Median decode time (µs) without and with the tap, per batch size.

    Returns:
        one dict per size: ``batch``, ``t_plain_us``, ``t_tap_us`` (Python callback),
        ``t_overhead_us`` (its difference to plain), ``t_callback_us`` (median time inside
        the Python callback per decode) and, with the C kernels, ``t_tap_native_us`` and
        ``t_overhead_native_us``.
    """
    taps = {"tap": FeatureTap(layers, model.n_layer, model.n_embd, native=False)}
    if native.AVAILABLE:
        taps["native"] = FeatureTap(layers, model.n_layer, model.n_embd, native=True)
    ctxs = {"plain": Context(model, n_ctx=1024)}
    for name, tap in taps.items():
        ctxs[name] = Context(model, n_ctx=1024, cb_eval=tap.callback, cb_eval_user_data=tap.user_data)
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 30000, n_prefix)
    rows = []
    try:
        batch = Batch(max(n_prefix, *sizes))
        for ctx in ctxs.values():
            batch.set_sequence(prefix, 0, output="none")
            ctx.decode(batch)
        for tap in taps.values():
            tap.take()
        for b in sizes:
            times: dict[str, list[float]] = {name: [] for name in ctxs}
            cb: list[float] = []
            for _ in range(reps):
                toks = rng.integers(100, 30000, b)
                for name, ctx in ctxs.items():
                    batch.set_sequence(toks, n_prefix, output="all")
                    t_cb0 = taps["tap"].t_callback_us
                    t0 = time.perf_counter()
                    ctx.decode(batch)
                    ctx.synchronize()
                    times[name].append((time.perf_counter() - t0) * 1e6)
                    if name == "tap":
                        cb.append(taps["tap"].t_callback_us - t_cb0)
                    if name in taps:
                        taps[name].take()
                    ctx.seq_rm(0, n_prefix, -1)
            med = {name: float(np.median(t)) for name, t in times.items()}
            row = {
                "batch": b,
                "t_plain_us": med["plain"],
                "t_tap_us": med["tap"],
                "t_overhead_us": med["tap"] - med["plain"],
                "t_callback_us": float(np.median(cb)),
            }
            if "native" in med:
                row["t_tap_native_us"] = med["native"]
                row["t_overhead_native_us"] = med["native"] - med["plain"]
            rows.append(row)
    finally:
        for ctx in ctxs.values():
            ctx.close()
    return rows
