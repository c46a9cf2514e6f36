"""What a target decode costs on this machine, per batch size.

On a CPU a single-token decode is bandwidth-bound and a batch of 4+ is compute-bound, and
the curve is not even monotone (llama.cpp's repacked GEMM kernels work in tiles of rows):
measured here for Gemma 3 270M Q4_K_M, b=6 costs more than b=8. So the policy does not
assume a shape: ``calibrate`` decodes batches of each candidate size on the real context and
records the time; the table is cached per (model file, threads, GPU layers, llama.cpp
build) in the user cache directory, and refined online from the decodes the engine runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
import numpy as np

from .backend import Batch, Context
from .backend._llama import lib, system_info
from .paths import cache_dir

# Batch sizes the policy may choose (nodes per verified tree, root included).
CANDIDATE_SIZES = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 64)
_CACHE_VERSION = 2


@dataclass
class CostModel:
    """Decode time of a batch of b tokens, ``t_decode_us(b)``.

    Attributes:
        table_us: b -> measured microseconds (calibration).
        online_us: b -> exponential moving average of the decodes the engine ran.
    """

    table_us: dict[int, float]
    online_us: dict[int, float] = field(default_factory=dict)
    online_n: dict[int, int] = field(default_factory=dict)
    alpha: float = 0.2
    draft_level_us: dict[int, float] = field(default_factory=dict)
    draft_level_n: dict[int, int] = field(default_factory=dict)

    # -- the model drafter's cost (an EAGLE-3 head, a draft model) --------------------------
    # Measured online from the drafter's own calls: level 0 (with the catch-up of the steps
    # since it last ran) and each deeper level, one model call each. Reset when the drafter
    # changes (``reset_draft``).

    def observe_draft_levels(self, level_us) -> None:
        """Feed back the time of each level of one drafted step (µs, level 0 first)."""
        for level, t in enumerate(level_us):
            n = self.draft_level_n.get(level, 0)
            old = self.draft_level_us.get(level, t)
            self.draft_level_us[level] = t if n == 0 else old + self.alpha * (t - old)
            self.draft_level_n[level] = n + 1

    def t_draft_level_us(self, level: int) -> float | None:
        """Expected time of draft level ``level`` (µs); an unmeasured level takes the deepest
        measured one below it (levels below the first have the same frontier width); None
        when nothing is measured yet."""
        if not self.draft_level_us:
            return None
        if level in self.draft_level_us:
            return self.draft_level_us[level]
        below = [k for k in self.draft_level_us if k <= level and k > 0] or list(self.draft_level_us)
        return self.draft_level_us[max(below)]

    def t_draft_us(self, depth: int) -> float | None:
        """Expected model time of a drafted tree of ``depth`` levels (µs), or None (unmeasured)."""
        if not self.draft_level_us:
            return None
        return float(sum(self.t_draft_level_us(k) for k in range(max(1, depth))))

    def reset_draft(self) -> None:
        self.draft_level_us.clear()
        self.draft_level_n.clear()

    @property
    def sizes(self) -> list[int]:
        return sorted(self.table_us)

    def t_decode_us(self, b: int) -> float:
        """Expected decode time of a batch of ``b`` tokens (µs); unmeasured sizes take the
        next measured size up (a batch never costs less than a smaller one's worst case)."""
        if self.online_n.get(b, 0) >= 3:
            return self.online_us[b]
        if b in self.table_us:
            base = self.table_us[b]
        else:
            bigger = [s for s in self.table_us if s >= b]
            base = self.table_us[min(bigger)] if bigger else self.table_us[max(self.table_us)] * b / max(self.table_us)
        return base * self.drift()

    def drift(self) -> float:
        """Ratio of recent single-token decodes to the table (context growth, machine load)."""
        n1 = self.online_n.get(1, 0)
        if n1 >= 3 and 1 in self.table_us:
            return self.online_us[1] / self.table_us[1]
        return 1.0

    def observe(self, b: int, t_us: float) -> None:
        n = self.online_n.get(b, 0)
        if n == 0:
            self.online_us[b] = t_us
        else:
            self.online_us[b] += self.alpha * (t_us - self.online_us[b])
        self.online_n[b] = n + 1

    def reset_online(self) -> None:
        self.online_us.clear()
        self.online_n.clear()

    def to_json(self) -> dict:
        return {"version": _CACHE_VERSION, "table_us": {str(k): v for k, v in self.table_us.items()}}


def _cache_key(ctx: Context) -> str:
    m = ctx.model
    st = m.path.stat()
    parts = [
        str(m.path.resolve()),
        str(st.st_size),
        str(int(st.st_mtime)),
        f"threads={ctx.n_threads}/{ctx.n_threads_batch}",
        f"ngl={m.n_gpu_layers}",
        f"repack={getattr(m, 'repack', True)}",
        f"kernels={os.environ.get('GGML_CPU_TILED_MM', '1')}",
        f"llama-cpp-python={lib.__version__}",
        hashlib.sha1(system_info().encode()).hexdigest()[:12],
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()


def calibrate(
    ctx: Context,
    *,
    sizes=CANDIDATE_SIZES,
    max_size: int = 64,
    n_prefix: int = 256,
    reps: int = 3,
    use_cache: bool = True,
    progress=None,
) -> CostModel:
    """Measure ``t_decode_us(b)`` for each size on ``ctx`` (or load it from the cache).

    The measurement decodes ``n_prefix`` tokens, then ``reps`` batches of each size on top of
    them (median kept), and empties the KV cache afterwards: call it before the context
    holds anything you need.

    Args:
        progress: optional callback ``(done, total)``.
    """
    sizes = [b for b in sizes if b <= max_size]
    path = cache_dir() / "costs.json"
    key = _cache_key(ctx)
    if use_cache:
        try:
            data = json.loads(path.read_text())
            entry = data.get(key)
            if entry and entry.get("version") == _CACHE_VERSION:
                table = {int(k): float(v) for k, v in entry["table_us"].items()}
                if all(b in table for b in sizes):
                    return CostModel({b: table[b] for b in sizes})
        except (OSError, ValueError, KeyError):
            pass
    n_prefix = min(n_prefix, ctx.n_ctx - max(sizes) - 1)
    batch = Batch(max(max(sizes), n_prefix, 1), 1)
    rng = np.random.default_rng(0)
    vocab_hi = min(ctx.n_vocab, 32000)
    ctx.clear()
    batch.set_sequence(rng.integers(100, vocab_hi, n_prefix), 0, output="none")
    ctx.decode(batch)
    # one warm-up decode of the largest size (first-touch of buffers)
    batch.set_sequence(rng.integers(100, vocab_hi, max(sizes)), n_prefix, output="all")
    ctx.decode(batch)
    ctx.seq_rm(0, n_prefix, -1)
    # Rounds over all sizes rather than all repetitions of one size in a row: a burst of load
    # from another process then spoils one sample of many sizes, which the median drops,
    # instead of every sample of a few neighbouring sizes.
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(reps):
        for i, b in enumerate(sizes):
            batch.set_sequence(rng.integers(100, vocab_hi, b), n_prefix, output="all")
            t0 = time.perf_counter()
            ctx.decode(batch)
            ctx.synchronize()
            times[b].append((time.perf_counter() - t0) * 1e6)
            ctx.seq_rm(0, n_prefix, -1)
            if progress is not None:
                progress(r * len(sizes) + i + 1, reps * len(sizes))
    table = {b: float(np.median(ts)) for b, ts in times.items()}
    ctx.clear()
    model = CostModel(table)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = {}
            data[key] = model.to_json()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except OSError:
            pass
    return model
