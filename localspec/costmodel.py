"""What a target decode costs on this machine, per batch size.

On a CPU a single-token decode is bandwidth-bound and a batch of 4+ is compute-bound, and
the curve is not even monotone (llama.cpp's repacked GEMM kernels work in tiles of rows):
measured here for Gemma 3 270M Q4_K_M, b=6 costs more than b=8. So the policy does not
assume a shape: ``calibrate`` decodes batches of each candidate size on the real context and
records the time; the table is cached per (model file, threads, GPU layers, llama.cpp
build) in the user cache directory, and refined online from the decodes the engine runs.

The cached table is meant to be the machine's quiet truth, so load is kept out of it three
ways: a calibration that ran under contention is used for that run only
(``load_during_calibration``); a table that the online decodes beat for long was measured
under load after all, and is replaced in the run and dropped from the cache
(``CostModel.observe``); and what the online state learned under a load is forgotten when
the load falls (``CostModel.load_fell_since``), so that speculation resumes once a machine
is quiet again.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .backend import Batch, Context
from .backend._llama import lib, system_info
from .backend.context import available_cpus
from .paths import cache_dir, read_json_cache, update_json_cache

# Batch sizes the policy may choose (nodes per verified tree, root included).
CANDIDATE_SIZES = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 64)
# 3: GPU tables time each size in a run of its own (calibration_schedule)
_CACHE_VERSION = 3


@dataclass
class CostModel:
    """Decode time of a batch of b tokens, ``t_decode_us(b)``, from a calibration table that
    may have been measured on a busy machine, corrected online.

    The model is ``t(b) = t1 * r(b)``: the current single-token time ``t1`` (an online average
    of the plain steps, else the table's) times the batch's cost ratio ``r(b)``. Ratios rather
    than times are learned because load moves every size together: a stale observation of
    ``t(8)`` made while the machine was quiet must not look cheap once ``t1`` has doubled.

    * ``r(b)`` starts from the table's ratio ``table(b) / table(1)`` with ``prior_n``
      pseudo-observations and moves to the ratios observed online (each observed time over
      the ``t1`` of that moment, clipped to [1/2, 2] times the current estimate so that one
      burst of load moves it by at most a step).
    * Sizes not observed yet have their table ratio corrected by the geometric mean of
      (observed ratio / table ratio) over the sizes observed, the sizes near them weighing
      most (``table_correction``), as is the prior of the observed ones: a table
      calibrated while a burst slowed the single-token decodes makes every batch look cheap,
      and the first verified trees show it; a table wrong over a range of sizes (its large
      batches, say) is corrected there by the sizes observed in that range, not outvoted
      by the many small steps. (A lone entry too dear, among neighbours the table prices
      right, stays too dear until the policy verifies that size.)
    * Sanity: entries a burst of load spoiled grossly are replaced by a robust fit of the
      table (``sanitize_table``; ``outliers`` lists them), except entries whose calibration
      samples repeated (``repeated``); a batch never costs less than one token (``r(b) >= 1``).
    * ``r(b)`` is **not** made monotone: a larger batch can be genuinely cheaper than a
      smaller one, and the policy should use it. Measured 2026-12-01 on the 2-core CPU
      (Gemma 3 270M Q4_K_M, exact kernels): odd batches cost 25-40% more than the next even
      one (calibration table: t(3) = 3.25 t1, t(4) = 2.29 t1, t(5) = 3.49 t1, t(6) = 2.74 t1;
      the engine's own decodes, ``scripts/measure_batch_costs.py``: 3.38, 2.54, 3.90, 3.09). A running maximum
      priced every even size like the odd size below it, so a 4-node tree looked 42% dearer
      than it is. Choosers compare rates at every size, so a dominated size (one that costs
      more than a larger one) is simply never the best; ``min_ratio`` gives the cheapest
      size of a range for bounds.
    * Load: ``load()`` is the machine's current slowdown against the table (a moving average
      of observed time over table time, every size). A ratio learned while the load was
      more than ``load_change`` times heavier than now is forgotten (back to the table's
      prior): a tree priced dear in a burst would otherwise never be verified again, so
      never re-measured, and the policy would stay plain after the load went away. The
      first observation of a size is clipped to [1/2, 2] times its prior, like the later ones.
    * Expiry: a table that the machine beats for ``expire_after`` observations in a row
      (``load() < expire_below``) was measured under load: it is replaced by the
      online-corrected table (``t1_us() * ratio(b)``) and, when it came from the cache or was
      written to it, its cache entry is dropped (the machine is then quieter than when the
      table was measured), so the next run measures again. A machine slower than its table
      is loaded now (or decodes a longer context): the table stays, as the quiet reference
      that the online state returns to.
    * Context: a verified row attends to every cell before it, so a row beyond the first
      costs more after a long context than after the table's ``context_ref`` tokens
      (measured 2026-12-07 on a 2-core Intel Xeon, Gemma 3 270M: a row of a batch of 8
      4.1 ms after 256 tokens, 4.9 after 512, 5.2 after 1,024, 5.3 after 2,048, while t(1)
      moved within the noise; its sliding-window layers stop the growth past 512). So the
      online ratios are learned per context bucket (``context_bucket``: one per doubling of
      ``context_ref``; the step says which, ``set_context``), each bucket's curve as above,
      but for the prior of a bucket other than the table's: bucket 0's ratio with its excess
      over one token scaled by ``context_scale``, what the sizes observed in that bucket
      say of the excess, the sizes near the one priced weighing most (the nearest bucket
      below before any). Ratios learned on long
      prompts then do not price the rows of short ones, nor the reverse: without it, in a
      run mixing short and long Spec-Bench prompts, batches of 2-8 rows were priced 10-15%
      too high below 512 tokens of context (observed over predicted time 0.85-0.90), and
      0.86-1.06 above; with it 0.97-0.99 and 0.96-1.05.

    Attributes:
        table_us: b -> measured microseconds (calibration).
        online_us: b -> exponential moving average of the decodes the engine ran (µs).
        online_n: b -> number of decodes observed.
        alpha: weight of a new observation in the moving averages.
        prior_n: pseudo-observations behind the table's ratios.
        outliers: (set at creation) sizes whose table entry ``sanitize_table`` replaced.
        repeated: sizes whose calibration samples repeated across rounds spread over the
            whole calibration (``repeated_sizes``), which ``sanitize_table`` never replaces.
        contended: why the table is not the machine's quiet truth (``calibrate`` measured it
            under contention: used for this run only), or None.
        cache_ref: (cache file, key) of the table's entry in the cache, or None.
        load_change: how much the load must fall for what was learned under it to be forgotten.
        expire_below / expire_after: the table expires after ``expire_after`` observations in
            a row with ``load() < expire_below``.
        rebased: how many times the table expired and was replaced by the online one.
        context_ref: the context (tokens) the table was measured after (``calibrate``'s prefix).
        context: the context (tokens) of the decodes priced and observed now (``set_context``).
        size_width: width (in ln b) of the kernel over batch sizes with which an observed
            size corrects its neighbours' priors (``table_correction``, ``context_scale``):
            half a doubling away weighs 0.61, a doubling 0.14, two doublings nothing.

    Raises:
        ValueError: an empty table, or ``size_width`` not above 0.
    """

    table_us: dict[int, float]
    online_us: dict[int, float] = field(default_factory=dict)
    online_n: dict[int, int] = field(default_factory=dict)
    alpha: float = 0.2
    prior_n: float = 3.0
    draft_level_us: dict[int, float] = field(default_factory=dict)
    draft_level_n: dict[int, int] = field(default_factory=dict)
    contended: str | None = None
    cache_ref: tuple[Path, str] | None = field(default=None, repr=False)
    load_change: float = 1.5
    expire_below: float = 0.67
    expire_after: int = 64
    rebased: int = 0
    repeated: frozenset[int] = frozenset()
    context_ref: int = 256
    context: int = 0
    size_width: float = 0.35

    def __post_init__(self) -> None:
        if not self.table_us:
            raise ValueError("empty cost table")
        if not self.size_width > 0:
            raise ValueError(f"size_width must be > 0, got {self.size_width}")
        self.repeated = frozenset(self.repeated)
        self._clean, self.outliers = sanitize_table(self.table_us, repeated=self.repeated)
        # (context bucket, b) -> online ratio t(b) / t1 (b > 1), its observations, and load()
        # when it was last observed
        self._ratio: dict[tuple[int, int], float] = {}
        self._ratio_n: dict[tuple[int, int], int] = {}
        self._ratio_load: dict[tuple[int, int], float] = {}
        self._curves: dict[int, dict[int, float]] = {}  # context bucket -> b -> sane ratio, cached
        self._memo: dict[tuple, object] = {}  # corrections and scales behind the curves, cached with them
        self._table_ratios: dict[int, float] = {}  # b -> table ratio, cached until the table changes
        self._load, self._load_n = 1.0, 0  # observed time / table time, moving average
        self._beaten = 0  # observations in a row with load() < expire_below

    # -- the model drafter's cost (an EAGLE-3 head, a draft model) --------------------------
    # Measured online from the drafter's own calls: level 0 (with the catch-up of the steps
    # since it last ran) and each deeper level, one model call each. Reset when the drafter
    # changes (``reset_draft``).

    def observe_draft_levels(self, level_us, first: int = 0) -> None:
        """Feed back the time of each level of one drafted step (µs), from level ``first`` on."""
        for level, t in enumerate(level_us, start=first):
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

    # -- the model ----------------------------------------------------------------------------

    def _table_at(self, b: int) -> float:
        """Table time of ``b`` (µs), after ``sanitize_table``; unmeasured sizes take the next
        measured size up."""
        t = self._clean
        if b in t:
            return t[b]
        bigger = [s for s in t if s >= b]
        if bigger:
            return t[min(bigger)]
        top = max(t)
        return t[top] * b / top

    def _table_ratio(self, b: int) -> float:
        r = self._table_ratios.get(b)
        if r is None:
            r = self._table_ratios[b] = self._table_at(b) / self._table_at(1)
        return r

    def _invalidate(self, bucket: int = 0) -> None:
        """Drop the cached curves of context bucket ``bucket`` and above, and what they were
        built from (after an observation or a forgotten ratio in ``bucket``; 0 for all). A
        bucket's curve depends on the table, bucket 0's ratios and its own and lower buckets'
        ratios (``context_scale``'s prior), never on a higher bucket's: an observation after
        1,000 tokens of context leaves bucket 0's curve as it was."""
        if bucket <= 0:
            self._curves.clear()
            self._memo.clear()
            return
        for k in [k for k in self._curves if k >= bucket]:
            del self._curves[k]
        for key in [key for key in self._memo if key[0] in ("scale", "scale_obs") and key[1] >= bucket]:
            del self._memo[key]

    def t1_us(self) -> float:
        """Current single-token decode time (µs): online once observed twice, else the table's."""
        if self.online_n.get(1, 0) >= 2:
            return self.online_us[1]
        return self._table_at(1)

    def _near(self, sizes: Sequence[int], obs_b: np.ndarray, obs_log: np.ndarray, obs_w: np.ndarray,
              prior_log: float, prior_w: float) -> np.ndarray:  # fmt: skip
        """Per size of ``sizes``: exp of the mean of ``obs_log`` (one value per observed size
        ``obs_b``) weighted by ``obs_w`` times a Gaussian kernel in ln b of width
        ``size_width``, with ``prior_log`` worth ``prior_w`` more (a kernel regression,
        Nadaraya-Watson, towards a prior). [len(sizes)] float64."""
        x = np.log(np.asarray(sizes, dtype=np.float64))[:, None]
        if obs_b.size == 0:
            return np.full(x.shape[0], math.exp(prior_log))
        w = obs_w[None, :] * np.exp(-0.5 * ((x - np.log(obs_b)[None, :]) / self.size_width) ** 2)
        return np.exp((prior_w * prior_log + w @ obs_log) / (prior_w + w.sum(axis=1)))

    def table_correction(self, b: int | None = None) -> float:
        """Observed ratio over table ratio in the table's context bucket (0).

        Without ``b``: the geometric mean over the sizes observed there (each weighing its
        observations, at most 20), shrunk towards 1 by one pseudo-observation. With ``b``:
        the same mean with the sizes near ``b`` (in ln b) weighing most (``_near``; the mean
        over all sizes worth two observations): a table wrong over a range of sizes (its
        large batches measured in a burst, say) is corrected there by the sizes observed in
        that range, where one mean over every size is dominated by the many small steps.

        Raises:
            ValueError: ``b`` below 1."""
        if b is not None and b < 1:
            raise ValueError(f"a batch holds at least 1 token, got {b}")
        return float(self._corrections([b])[0]) if b is not None else math.exp(self._table_obs()[3])

    def _table_obs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Bucket 0's observed sizes, ln(observed / table ratio), weights (observations, at
        most 20) and the weighted mean of the logs shrunk towards 0 by one
        pseudo-observation; cached with the curves."""
        out = self._memo.get(("table_obs",))
        if out is None:
            a = np.array([(b, math.log(r / self._table_ratio(b)), min(self._ratio_n[(k, b)], 20))
                          for (k, b), r in self._ratio.items() if k == 0], dtype=np.float64).reshape(-1, 3)  # fmt: skip
            obs_b, logs, w = a[:, 0], a[:, 1], a[:, 2]
            out = self._memo[("table_obs",)] = (obs_b, logs, w, float(w @ logs / (1.0 + w.sum())))
        return out  # type: ignore[return-value]

    def _corrections(self, sizes: Sequence[int]) -> np.ndarray:
        """``table_correction(b)`` for each size of ``sizes``. [len(sizes)] float64."""
        obs_b, logs, w, mean = self._table_obs()
        return self._near(sizes, obs_b, logs, w, mean, 2.0)

    def set_context(self, n_tokens: int) -> None:
        """The context (tokens in the KV cache before the batch; for several requests their
        mean) of the decodes priced and observed from now on."""
        self.context = max(0, int(n_tokens))

    def context_bucket(self, n_tokens: int | None = None) -> int:
        """Bucket of a context of ``n_tokens`` (default ``context``): 0 below twice
        ``context_ref``, then one per doubling (``context_ref`` 256: 0 below 512, 1 for
        512-1,023, 2 for 1,024-2,047, ...)."""
        n = self.context if n_tokens is None else n_tokens
        ref = max(1, self.context_ref)
        return 0 if n < 2 * ref else int(math.floor(math.log2(n / ref)))

    def context_scale(self, bucket: int | None = None, b: int | None = None) -> float:
        """``s``: what the excess of a ratio over one token is multiplied by in ``bucket``
        (default the current context's), against bucket 0's curve; 1 in bucket 0.

        Without ``b``, the bucket's scale: the geometric mean of (observed excess / bucket 0's
        excess) over the sizes observed there, each weighing its observations (at most 20)
        times bucket 0's excess at that size (sizes whose excess is under 0.05 say nothing of
        it), shrunk towards the scale of the nearest bucket below by one pseudo-observation
        of weight 1 (the growth is monotone); 1 before any. The weight follows the excess
        because the context does not scale every size alike and a small excess is a noisy
        ratio: on the Xeon (2026-12-07) the excess of 2 rows grew 1.9x from 256 to 2,048
        tokens of context and that of 8-16 rows 1.3x, and an `auto` engine, whose head steps
        verify 2 rows, priced 8 rows at 3.1-3.7 times t(1) after 1,400 tokens, where they
        measured 2.4-2.5 times after 1,024-2,048 (``scripts/measure_context_costs.py``).

        With ``b``: the same ratios, each size weighing its observations (not its excess)
        times how near it is to ``b`` in ln b (``_near``; the bucket's scale worth two
        observations).

        Raises:
            ValueError: ``b`` below 1."""
        k = self.context_bucket() if bucket is None else bucket
        if k <= 0:
            return 1.0
        if b is not None:
            if b < 1:
                raise ValueError(f"a batch holds at least 1 token, got {b}")
            return float(self._context_scales(k, [b])[0])
        s = self._memo.get(("scale", k))
        if s is None:
            _, logs, obs_w, base = self._scale_obs(k)
            below = max([j for j, _ in self._ratio if 0 < j < k], default=0)
            prior = self.context_scale(below) if below else 1.0
            w = obs_w * base
            s = self._memo[("scale", k)] = float(np.exp((math.log(prior) + w @ logs) / (1.0 + w.sum())))
        return s  # type: ignore[return-value]

    def _scale_obs(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Bucket ``k``'s sizes that say something of its scale: sizes, ln(observed excess /
        bucket 0's excess), weights (observations, at most 20) and bucket 0's excess; cached
        with the curves."""
        a = self._memo.get(("scale_obs", k))
        if a is None:
            out = []
            for (j, b), r in self._ratio.items():
                if j != k or r <= 1.0:
                    continue
                base = self._ratio_at(0, b) - 1.0
                if base >= 0.05:
                    out.append((b, math.log((r - 1.0) / base), min(self._ratio_n[(j, b)], 20), base))
            a = self._memo[("scale_obs", k)] = np.array(out, dtype=np.float64).reshape(-1, 4)
        return a[:, 0], a[:, 1], a[:, 2], a[:, 3]  # type: ignore[index]

    def _context_scales(self, k: int, sizes: Sequence[int]) -> np.ndarray:
        """``context_scale(k, b)`` for each size of ``sizes``. [len(sizes)] float64."""
        obs_b, logs, obs_w, _ = self._scale_obs(k)
        return self._near(sizes, obs_b, logs, obs_w, math.log(self.context_scale(k)), 2.0)

    def _curve(self, k: int) -> dict[int, float]:
        """Context bucket ``k``'s curve (b -> sane ratio), built once after each observation."""
        curve = self._curves.get(k)
        if curve is None:
            curve = self._curves[k] = self._build_curve(k)
        return curve

    def _ratio_at(self, k: int, b: int) -> float:
        """``r(b)`` in context bucket ``k`` (the sanity-checked curve of that bucket). A size
        outside the curve takes the next size up, else grows linearly beyond the top."""
        if b <= 1:
            return 1.0
        curve = self._curve(k)
        r = curve.get(b)
        if r is None:
            bigger = [s for s in curve if s >= b]
            top = max(curve)
            r = curve[min(bigger)] if bigger else curve[top] * b / top
        return r

    def _context_factor(self, b: int) -> float:
        """``r(b, context) / r(b)``: how much dearer (cheaper) a batch of ``b`` is at the
        current context than at the table's."""
        return self.ratio(b) / self._ratio_at(0, b)

    def ratio(self, b: int) -> float:
        """``r(b) = t(b) / t1`` at the current context (``set_context``) after the sanity
        checks (>= 1; not monotone in b, see the class docstring)."""
        return self._ratio_at(self.context_bucket(), b)

    def _build_curve(self, k: int) -> dict[int, float]:
        """Context bucket ``k``'s curve: per size the prior (bucket 0: the table's ratio
        times ``table_correction(b)``; another: bucket 0's excess times
        ``context_scale(k, b)``) weighed with ``prior_n`` pseudo-observations against the
        size's online ratio there."""
        sizes = sorted(set(self.table_us) | {b for j, b in self._ratio if j == k} | {1})
        if k == 0:
            g = self._corrections(sizes)
            priors = [self._table_ratio(b) * g_b for b, g_b in zip(sizes, g)]
        else:
            s = self._context_scales(k, sizes)
            priors = [1.0 + (self._ratio_at(0, b) - 1.0) * s_b for b, s_b in zip(sizes, s)]
        out: dict[int, float] = {}
        for b, r in zip(sizes, priors):
            if b == 1:
                out[b] = 1.0
                continue
            if (k, b) in self._ratio:
                n = min(self._ratio_n[(k, b)], 20)
                r = (self.prior_n * r + n * self._ratio[(k, b)]) / (self.prior_n + n)
            out[b] = max(1.0, float(r))
        return out

    def min_ratio(self, lo: int, hi: int) -> float:
        """The smallest ``r(b)`` over ``lo <= b <= hi`` at the current context (the sizes of
        its curve in that range, and ``lo`` itself), for bounds: no batch of ``lo..hi`` tokens
        costs less than ``t1 * min_ratio(lo, hi)``."""
        return min([self.ratio(lo)] + [r for b, r in self._curve(self.context_bucket()).items() if lo <= b <= hi])

    def t_decode_us(self, b: int) -> float:
        """Expected decode time of a batch of ``b`` tokens (µs): ``t1_us() * ratio(b)``."""
        return self.t1_us() * self.ratio(b)

    def load(self) -> float:
        """The machine's slowdown against the table: a moving average of observed decode time
        over table time (every size observed; 1 before any observation). Under 1 when the
        table is slower than the machine."""
        return self._load

    def load_fell_since(self, then: float) -> bool:
        """Whether the load has fallen by more than ``load_change`` since it was ``then`` (a
        ``load()`` value): what was learned at ``then`` is stale."""
        return self._load * self.load_change < then

    def drift(self) -> float:
        """Ratio of recent single-token decodes to the table (context growth, machine load)."""
        return self.t1_us() / self._table_at(1)

    def observe(self, b: int, t_us: float) -> None:
        """Feed back one measured decode of ``b`` tokens (µs). The averages are running means
        for the first ``1 / alpha`` observations, then exponential moving averages; each
        observation is clipped to [1/2, 2] times the current average (one burst of load moves
        an average by a bounded step), a size's first ratio to [1/2, 2] times its prior. Then
        ratios learned under a load ``load_change`` times heavier than now are forgotten, and
        the table expires when the machine has beaten it for long (class docstring)."""
        if not (t_us > 0 and np.isfinite(t_us)):
            return
        n = self.online_n.get(b, 0)
        a = max(self.alpha, 1.0 / (n + 1))
        lam = t_us / (self._table_at(b) * self._context_factor(b))
        # the load this decode ran in, as the decodes before it saw it (its own time is what
        # is priced, so a tree that ran in a burst does not count as the burst's load)
        load_then = self._load if self._load_n else lam
        if self._load_n == 0:
            self._load = lam
        else:
            a_load = max(self.alpha, 1.0 / (self._load_n + 1))
            self._load += a_load * (min(max(lam, 0.5 * self._load), 2.0 * self._load) - self._load)
        self._load_n += 1
        if b > 1:
            r_obs = t_us / self.t1_us()
            key = (self.context_bucket(), b)
            cur = self._ratio.get(key)
            m = self._ratio_n.get(key, 0)
            if cur is None:
                prior = self.ratio(b)  # this bucket's curve before it
                self._ratio[key] = max(1.0, min(max(r_obs, 0.5 * prior), 2.0 * prior))
            else:
                r_obs = min(max(r_obs, 0.5 * cur), 2.0 * cur)
                self._ratio[key] = max(1.0, cur + max(self.alpha, 1.0 / (m + 1)) * (r_obs - cur))
            self._ratio_n[key] = m + 1
            self._ratio_load[key] = load_then
            self._invalidate(key[0])
        if n == 0:
            self.online_us[b] = t_us
        else:
            cur = self.online_us[b]
            self.online_us[b] = cur + a * (min(max(t_us, 0.5 * cur), 2.0 * cur) - cur)
        self.online_n[b] = n + 1
        for key in [key for key, then in self._ratio_load.items() if self.load_fell_since(then)]:
            self._forget(key)
        self._beaten = self._beaten + 1 if self._load < self.expire_below else 0
        if self._beaten >= self.expire_after:
            self._expire()

    def _forget(self, key: tuple[int, int]) -> None:
        """Drop what was learned online about size ``b`` > 1 in context bucket ``k`` (``key =
        (k, b)``: its ratio returns to the prior)."""
        for d in (self._ratio, self._ratio_n, self._ratio_load):
            d.pop(key, None)
        for d in (self.online_us, self.online_n):
            d.pop(key[1], None)
        self._invalidate(key[0])

    def _expire(self) -> None:
        """The machine has beaten the table for long: the table becomes the online-corrected
        one, and its cache entry (if any) is dropped so that the next run measures again."""
        old = dict(self.table_us)
        self.table_us = {b: self.t1_us() * self._ratio_at(0, b) for b in self.table_us}  # at the table's context
        # t(1) is now the online average of many plain steps: measured, not a burst's
        self.repeated = self.repeated | ({1} if self.online_n.get(1, 0) >= 3 else set())
        self._clean, self.outliers = sanitize_table(self.table_us, repeated=self.repeated)
        for key in [key for key in self._ratio if key[0] == 0]:
            self._forget(key)  # folded into the new table (the other buckets' ratios stand)
        self._invalidate()  # the curves of the old table
        self._table_ratios.clear()
        self._load, self._load_n, self._beaten = 1.0, 0, 0
        self.rebased += 1
        if self.cache_ref is not None:
            path, key = self.cache_ref
            _update_cache(path, key, None, only_if=old)
            self.cache_ref = None

    def reset_online(self) -> None:
        self.online_us.clear()
        self.online_n.clear()
        self._ratio.clear()
        self._ratio_n.clear()
        self._ratio_load.clear()
        self._invalidate()
        self._load, self._load_n, self._beaten = 1.0, 0, 0

    def contention_note(self) -> str | None:
        """The one line a front-end shows when the table was measured under contention
        (``contended``), else None: what it means, that it is not cached, what to do."""
        if self.contended is None:
            return None
        return (f"the decode cost table was measured while other work loaded this machine ({self.contended}): "
                "drafting is planned on these slower timings for this run only (the table is not cached); "
                "run localspec on a quiet machine to measure and keep the machine's own table")  # fmt: skip

    def to_json(self) -> dict:
        return {"version": _CACHE_VERSION, "table_us": {str(k): v for k, v in self.table_us.items()},
                "repeated": sorted(self.repeated)}  # fmt: skip


def sanitize_table(
    table_us: dict[int, float], *, tolerance: float = 2.0, repeated: frozenset[int] | set[int] = frozenset()
) -> tuple[dict[int, float], list[int]]:
    """Replace the timings of a calibration that a burst of load spoiled.

    Fits ``log t(b) = log a + k log b`` robustly (Theil-Sen: the median of the pairwise
    slopes, then the median intercept; Sen 1968) and replaces every entry more than
    ``tolerance`` times off the fit, either way, by the fit. The power law is rough (a CPU's
    curve bends where decoding turns compute-bound), so only gross errors are replaced: a
    quiet machine's table is within 1.25x of its fit.

    Entries in ``repeated`` are kept whatever the fit says: their samples repeated across
    calibration rounds that ran over the whole calibration (``repeated_sizes``), which a
    burst does not do. This is the case the table alone cannot tell from a burst: on a
    2-core Intel Xeon (AVX-512, 2026-12-06) a quiet t(1) of 22.4 ms was about t(2) (21.0 ms,
    three samples of each agreeing within 1.1x), 2.6x above the power law's 8.7 ms, while a
    burst that inflates t(1) 2.2x gives a table of the same shape.

    Tables of fewer than 4 sizes are returned as they are.

    Args:
        table_us: b -> µs.
        tolerance: how far off the fit (either way, as a factor) an entry may be.
        repeated: sizes never replaced.
    Returns:
        (the cleaned table, the sizes replaced, ascending).
    """
    sizes = sorted(table_us)
    if len(sizes) < 4 or min(table_us.values()) <= 0:
        return dict(table_us), []
    y = np.log(np.array([table_us[b] for b in sizes], dtype=np.float64))
    x = np.log(np.array(sizes, dtype=np.float64))
    i, j = np.triu_indices(len(sizes), 1)
    slope = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    icpt = float(np.median(y - slope * x))
    fit = icpt + slope * x
    lim = np.log(tolerance)
    out, bad = dict(table_us), []
    for b, yi, fi in zip(sizes, y, fit):
        if abs(yi - fi) > lim and b not in repeated:
            out[b] = float(np.exp(fi))
            bad.append(b)
    return out, bad


def repeated_sizes(times_us: dict[int, list[float]], *, max_spread: float = 1.3, min_samples: int = 3) -> frozenset[int]:
    """The sizes whose calibration samples repeat: at least ``min_samples`` samples and a
    median within ``max_spread`` times the fastest, so that at least half of them agree.

    Meaningful only for samples taken in rounds over all sizes (``calibration_schedule``'s
    ``"rounds"``): there a size's samples lie a whole round apart, so a burst of load that
    spoils its median must hit that size in most rounds and spare the sizes timed just
    before and after it, while load that lasts slows every size (and the CPU share of
    ``load_during_calibration`` sees it). Samples taken in a run of one size can all fall in
    one burst and say nothing.

    Args:
        times_us: b -> the timed decodes of size b (µs).
    """
    out = set()
    for b, ts in times_us.items():
        ts = sorted(ts)
        if len(ts) >= min_samples and ts[0] > 0 and ts[len(ts) // 2] <= max_spread * ts[0]:
            out.add(b)
    return frozenset(out)


def _cache_key(ctx: Context) -> str:
    m = ctx.model
    st = m.path.stat()
    parts = [
        str(m.path.resolve()),
        str(st.st_size),
        str(int(st.st_mtime)),
        f"threads={ctx.n_threads}/{ctx.n_threads_batch}",
        f"ngl={m.n_gpu_layers}",
        # the device set (RPC workers, their link's round trip): each gets its own table
        *([f"devices={m.device_key}"] if getattr(m, "device_key", "local") != "local" else []),
        f"repack={getattr(m, 'repack', True)}",
        f"kernels={os.environ.get('GGML_CPU_TILED_MM', '1')}",
        # the lm_head readout changes small batches' cost (backend.readout)
        *([f"readout<={ctx.readout.max_rows}:k{ctx.readout.kernel}"] if getattr(ctx, "readout", None) is not None else []),
        f"llama-cpp-python={lib.__version__}",
        hashlib.sha1(system_info().encode()).hexdigest()[:12],
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()


def load_during_calibration(
    times_us: dict[int, list[float]], cpu_share: float | None, *, min_share: float = 0.9, max_spread: float = 1.3
) -> str | None:
    """Why a calibration's timings include another process's load, or None when they look quiet.

    Two checks, either one enough:

    * CPU share (when the model runs on the CPU alone): the CPU time the process got during
      the timed decodes over what its threads could have had, ``sum(cpu) / sum(wall *
      min(threads, usable CPUs))``. llama.cpp's threads spin while a graph runs, so an
      uncontended decode gets ~1 (1.00 measured on one pinned core while the other agents of
      this 2-core VM left it alone); other processes on the same cores take their share of
      the time slices (0.66-0.82 at a load average of 5.5 on 2 cores, 0.26-0.59 with one
      more busy loop on the same core). Direct and immediate, unlike ``os.getloadavg()`` (a
      one-minute average, which counts this process's own threads and processes on cores it
      does not use). Below ``min_share`` is contention. It misses load that slows the
      decodes without taking CPU time (another process saturating memory bandwidth, an SMT
      sibling), and it does not apply to GPU or RPC layers (the threads wait there).
    * Repeatability of the single-token time: one sample of t(1) per round; a median more
      than ``max_spread`` times the fastest is load that lasted (half the rounds or more). One
      slow sample is not: the rounds spread a short burst over one sample of many sizes,
      which their medians drop, and a VM's single decodes stall now and then on a quiet
      machine (a 2-core Intel Xeon VM, 2026-12-06: 1 in 5-10 single-token decodes at
      1.3-1.7x the others, so that slowest over fastest flagged 2 of 3 quiet calibrations).
      Steady contention can repeat t(1) closely (106-123 ms at a CPU share of 0.33), so this
      check backs up the first rather than replacing it; the online expiry (``CostModel``)
      catches what both miss.

    Args:
        times_us: b -> the timed decodes of size b (µs), in rounds.
        cpu_share: the CPU share above, or None where it does not apply (GPU or RPC layers).
    """
    if cpu_share is not None and cpu_share < min_share:
        return f"the process got {cpu_share:.0%} of its CPUs' time during the timed decodes"
    t1 = sorted(times_us.get(1, []))
    if len(t1) >= 2 and not repeated_sizes({1: t1}, max_spread=max_spread, min_samples=2):
        return f"single-token decodes took {t1[0] / 1e3:.1f}-{t1[-1] / 1e3:.1f} ms"
    return None


def _update_cache(path: Path, key: str, entry: dict | None, *, only_if: dict[int, float] | None = None) -> None:
    """Write ``entry`` under ``key`` in the cache file (None: remove the key), atomically.
    With ``only_if`` (b -> µs), remove only while the key still holds those timings (another
    process may have measured it again since). Errors of the file system are ignored (the cache is only
    a cache)."""
    if entry is None and only_if is not None:
        held = read_json_cache(path).get(key, {}).get("table_us", {})
        if any(held.get(str(b)) != t for b, t in only_if.items()):
            return
    update_json_cache(path, key, entry)


def calibration_order(cpu_only: bool) -> str:
    """The calibration's default order (``calibration_schedule``): ``LOCALSPEC_CALIBRATION_ORDER``
    when set, else ``"rounds"`` on the CPU alone and ``"runs"`` with GPU or RPC layers."""
    return os.environ.get("LOCALSPEC_CALIBRATION_ORDER") or ("rounds" if cpu_only else "runs")


def calibration_schedule(sizes: Sequence[int], reps: int, *, cpu_only: bool, order: str | None = None) -> list[tuple[int, bool]]:
    """The order of a calibration's decodes: ``(batch size, timed)`` pairs.

    * ``"rounds"`` (the default on the CPU alone): ``reps`` rounds over all sizes, every
      decode timed. A burst of load from another process then spoils one sample of many
      sizes, which the median drops, instead of every sample of a few neighbouring sizes.
    * ``"runs"`` (the default with GPU or RPC layers): per size, two untimed decodes and then
      its ``reps`` timed ones in a row. llama.cpp reuses its graph, and its CUDA backend
      captures a CUDA graph on the second of two decodes of the same shape and replays it
      from the third (``ggml_backend_cuda_graph_compute``), so a run times each size as a run
      of equal steps (plain decoding, undrafted steps) pays it; rounds time every size as a
      step after a step of another size pays it.

    Args:
        order: ``"rounds"`` or ``"runs"``; default: ``LOCALSPEC_CALIBRATION_ORDER`` when set,
            else by ``cpu_only`` as above.
    Raises:
        ValueError: another ``order``.
    """
    order = order or calibration_order(cpu_only)
    if order == "rounds":
        return [(b, True) for _ in range(reps) for b in sizes]
    if order == "runs":
        return [(b, k >= 2) for b in sizes for k in range(reps + 2)]
    raise ValueError(f"calibration order must be 'rounds' or 'runs', got {order!r}")


def calibrate(
    ctx: Context,
    *,
    sizes=CANDIDATE_SIZES,
    max_size: int = 64,
    n_prefix: int = 256,
    reps: int = 3,
    use_cache: bool = True,
    progress=None,
    clock=time.perf_counter,
    cpu_clock=time.process_time,
) -> CostModel:
    """Measure ``t_decode_us(b)`` for each size on ``ctx`` (or load it from the cache).

    The measurement decodes ``n_prefix`` tokens, then ``reps`` batches of each size on top of
    them (median kept), and empties the KV cache afterwards: call it before the context
    holds anything you need. A table with gross outliers (``sanitize_table``: a burst of load
    from another process; sizes whose samples repeated across rounds are not outliers,
    ``repeated_sizes``) is used cleaned but not cached, and such a cached table is measured
    again. A table measured under contention (``load_during_calibration``) is used for this
    run only (``CostModel.contended`` says why) and not cached.

    Args:
        progress: optional callback ``(done, total)``.
        clock / cpu_clock: wall-clock and process CPU-time clocks in seconds (tests inject
            scripted ones); each is read just before and just after every timed decode.
    """
    sizes = [b for b in sizes if b <= max_size]
    n_prefix = max(0, min(n_prefix, ctx.n_ctx - max(sizes) - 1))
    path = cache_dir() / "costs.json"
    key = _cache_key(ctx)
    if use_cache:
        try:
            entry = read_json_cache(path).get(key)
            if isinstance(entry, dict) and entry.get("version") == _CACHE_VERSION:
                table = {int(k): float(v) for k, v in entry["table_us"].items()}
                if all(b in table for b in sizes):
                    kept = frozenset(int(b) for b in entry.get("repeated", ()))
                    cached = CostModel({b: table[b] for b in sizes}, cache_ref=(path, key), repeated=kept,
                                       context_ref=n_prefix)  # fmt: skip
                    if not cached.outliers:  # else measured under a burst of load: measure again
                        return cached
        except (ValueError, KeyError, TypeError, AttributeError):  # an entry of another shape: measure again
            pass
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
    m = ctx.model
    cpu_only = getattr(m, "device_key", "local") == "local" and not getattr(m, "on_local_gpu", False)
    n_cpus = available_cpus() or 1
    cpu_got, cpu_could = 0.0, 0.0
    times: dict[int, list[float]] = {b: [] for b in sizes}
    order = calibration_order(cpu_only)
    schedule = calibration_schedule(sizes, reps, cpu_only=cpu_only, order=order)
    n_timed = sum(timed for _, timed in schedule)
    done = 0
    for b, timed in schedule:
        batch.set_sequence(rng.integers(100, vocab_hi, b), n_prefix, output="all")
        if not timed:
            ctx.decode(batch)
            ctx.synchronize()
            ctx.seq_rm(0, n_prefix, -1)
            continue
        t0 = clock()
        c0 = cpu_clock()
        ctx.decode(batch)
        ctx.synchronize()
        c1 = cpu_clock()
        t1 = clock()
        ctx.seq_rm(0, n_prefix, -1)
        times[b].append((t1 - t0) * 1e6)
        cpu_got += c1 - c0
        cpu_could += (t1 - t0) * min(ctx.n_threads if b == 1 else ctx.n_threads_batch, n_cpus)
        done += 1
        if progress is not None:
            progress(done, n_timed)
    table = {b: float(np.median(ts)) for b, ts in times.items()}
    ctx.clear()
    share = cpu_got / cpu_could if cpu_only and cpu_could > 0 else None
    repeated = repeated_sizes(times) if order == "rounds" else frozenset()
    model = CostModel(table, contended=load_during_calibration(times, share), repeated=repeated, context_ref=n_prefix)
    # a table with gross outliers, or measured under contention, was measured under load:
    # use it (cleaned) but do not keep it
    if use_cache and not model.outliers and model.contended is None:
        _update_cache(path, key, model.to_json())
        model.cache_ref = (path, key)
    return model
