"""Per-row kernels: the logits pipeline of ``LogitsProcessor`` and row reductions.

Every function takes numpy arrays and returns numpy arrays / Python ints; the row
arguments must be C-contiguous float32 (``llama_get_logits`` views are), other arrays are
converted when needed. Errors of the pipeline raise the reference's exceptions.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import numpy as np

from ..errors import GrammarError, InvalidRequestError
from . import _lib, lib, workspace
from . import threads as _threads


def _f32(row: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(row, dtype=np.float32)


class SamplingState:
    """The ``ls_sampling`` struct of one ``LogitsProcessor`` (parameters + logit bias).

    Args:
        params: ``SamplingParams`` (its ``seed`` is not used: calls pass the seed).
        bias_ids: [k] int64 token ids; bias_vals: [k] float32 values (``-inf`` bans).
    """

    def __init__(self, params, bias_ids: np.ndarray, bias_vals: np.ndarray) -> None:
        self.bias_ids = np.ascontiguousarray(bias_ids, dtype=np.int64)
        self.bias_vals = np.ascontiguousarray(bias_vals, dtype=np.float32)
        s = _lib.Sampling()
        s.temperature = float(params.temperature)
        s.top_p = float(params.top_p)
        s.min_p = float(params.min_p)
        s.top_k = int(params.top_k)
        s.penalty_last_n = int(params.penalty_last_n)
        s.has_penalties = 1 if params.has_penalties else 0
        s.repeat_penalty = float(params.repeat_penalty)
        s.frequency_penalty = float(params.frequency_penalty)
        s.presence_penalty = float(params.presence_penalty)
        s.bias_ids = self.bias_ids.ctypes.data if self.bias_ids.size else None
        s.bias_vals = self.bias_vals.ctypes.data if self.bias_vals.size else None
        s.n_bias = int(self.bias_ids.size)
        s.seed = int(params.seed or 0)
        self.struct = s
        self.ref = ctypes.byref(s)

    def with_seed(self, seed: int):
        self.struct.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        return self.ref


def raise_for(code: int, what: str = "") -> None:
    """Raise the reference's exception for an ``LS_ERR_*`` code."""
    if code == _lib.ERR_BANNED:
        raise InvalidRequestError("every token is banned by logit_bias")
    if code == _lib.ERR_NONE_ALLOWED:
        raise GrammarError("no token is allowed here (grammar / logit_bias)")
    if code == _lib.ERR_NOMEM:
        raise MemoryError("native kernel: out of memory")
    raise ValueError(f"native kernel: error {code} {what}".strip())


def _penalty_arrays(counts: Mapping[int, int] | None):
    if not counts:
        return None, None, 0
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    cnt = np.fromiter(counts.values(), dtype=np.int32, count=len(counts))
    return ids, cnt, int(ids.size)


def candidates(state: SamplingState, row: np.ndarray, counts: Mapping[int, int] | None = None):
    """``LogitsProcessor.candidates`` without a grammar: ([m] int64 ids, [m] float32 logits / T)."""
    row = _f32(row)
    n = row.shape[0]
    pid, pcnt, npen = _penalty_arrays(counts)
    ids = np.empty(n, dtype=np.int64)
    logits = np.empty(n, dtype=np.float32)
    m = lib.ls_candidates(
        state.ref,
        row.ctypes.data,
        n,
        pid.ctypes.data if npen else None,
        pcnt.ctypes.data if npen else None,
        npen,
        workspace(n),
        ids.ctypes.data,
        logits.ctypes.data,
    )
    if m < 0:
        raise_for(m)
    return ids[:m].copy(), logits[:m].copy()


def choose(state: SamplingState, row: np.ndarray, pos: int, seed: int, counts: Mapping[int, int] | None = None) -> int:
    """``LogitsProcessor.choose`` without a grammar: the token at absolute position ``pos``."""
    row = _f32(row)
    n = row.shape[0]
    pid, pcnt, npen = _penalty_arrays(counts)
    t = lib.ls_choose(
        state.with_seed(seed),
        row.ctypes.data,
        n,
        pid.ctypes.data if npen else None,
        pcnt.ctypes.data if npen else None,
        npen,
        int(pos),
        workspace(n),
    )
    if t < 0:
        raise_for(t)
    return int(t)


def argmax(row: np.ndarray) -> int:
    """First index of the maximum of ``row`` ([n] float32), like ``np.argmax``.

    Test hook: ``ls_argmax`` is the greedy pick inside ``ls_choose`` / ``ls_verify``; the
    product does not call this wrapper (tests/test_native.py checks ties and SIMD tails)."""
    row = _f32(row)
    return int(lib.ls_argmax(row.ctypes.data, row.shape[0]))


def top_k(row: np.ndarray, k: int) -> np.ndarray:
    """[<= k] int64 ids of the ``k`` largest finite values of ``row`` ([n] float32), sorted by
    (value desc, id asc); fewer when fewer values are finite (``ls_top_k``)."""
    row = _f32(row)
    n = row.shape[0]
    out = np.empty(min(max(int(k), 0), n), dtype=np.int64)
    m = lib.ls_top_k(row.ctypes.data, n, int(k), workspace(n), out.ctypes.data)
    if m < 0:
        raise_for(m)
    return out[:m]


def logsumexp(row: np.ndarray) -> float:
    """log(sum(exp(row))) in float64 over the finite entries of ``row`` ([n] float32)."""
    row = _f32(row)
    return float(lib.ls_logsumexp(row.ctypes.data, row.shape[0]))


def _block(logits: np.ndarray) -> tuple[np.ndarray, int]:
    if logits.dtype != np.float32 or logits.ndim != 2 or logits.strides[1] != 4:
        logits = np.ascontiguousarray(logits, dtype=np.float32)
    return logits, logits.strides[0] // 4


def _per_row(fn, logits: np.ndarray, rows, dtype, n_threads: int) -> np.ndarray:
    logits, stride = _block(logits)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    out = np.empty(rows.size, dtype=dtype)
    fn(logits.ctypes.data, stride, logits.shape[1], rows.ctypes.data, rows.size, out.ctypes.data, n_threads)
    return out


def rows_logsumexp(logits: np.ndarray, rows, n_threads: int = 1) -> np.ndarray:
    """[k] float64 logsumexp of ``logits[rows]`` (``logits``: [n_rows, n_vocab] float32)."""
    return _per_row(lib.ls_rows_logsumexp, logits, rows, np.float64, n_threads)


def uniforms(key: int, counters) -> np.ndarray:
    """``sampling.uniforms`` in C: [n] float64.

    Test hook: the C generator that ``ls_verify`` draws its acceptance and residual uniforms
    from; the product does not call this wrapper (tests/test_native.py checks it bit for bit
    against ``sampling.uniforms``)."""
    c = np.ascontiguousarray(counters, dtype=np.int64)
    out = np.empty(c.size, dtype=np.float64)
    lib.ls_uniforms(int(key), c.ctypes.data, c.size, out.ctypes.data)
    return out


def gumbel_noise(seed: int, pos: int, token_ids) -> np.ndarray:
    """``sampling.gumbel_noise`` in C: [n] float64.

    Test hook: the noise of ``ls_choose``'s seeded Gumbel-max pick; the product does not call
    this wrapper (tests/test_native.py checks it against ``sampling.gumbel_noise``)."""
    ids = np.ascontiguousarray(token_ids, dtype=np.int64)
    out = np.empty(ids.size, dtype=np.float64)
    key = lib.ls_stream_key(int(seed), int(pos), 0)
    lib.ls_gumbel_noise(key, ids.ctypes.data, ids.size, out.ctypes.data)
    return out


def sample_from(probs: np.ndarray, u: float) -> int:
    """``verify.sample_from`` in C: an index of ``probs`` ([n] float64) for the uniform ``u``.

    Test hook: ``ls_sample_from`` is the residual draw of ``ls_verify``'s rejection sampling
    (``ls__sample_sparse``) over a dense row; the product does not call this wrapper
    (tests/test_native.py checks it against ``verify.sample_from``)."""
    p = np.ascontiguousarray(probs, dtype=np.float64)
    return int(lib.ls_sample_from(p.ctypes.data, p.size, float(u)))


def gemm_t(wt: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ wt`` ([r, m] float32) for ``wt`` [n, m] C-contiguous float32 and ``x`` [r, n]
    (``ls_gemm_t``: the matrix read once per 8 rows; each entry sums in row order, so a
    row's bits do not depend on the other rows or the thread count).

    Raises:
        ValueError: shapes that do not match.
    """
    if wt.dtype != np.float32 or not wt.flags.c_contiguous or wt.ndim != 2:
        raise ValueError("gemm_t needs a C-contiguous float32 [n, m] matrix")
    n, m = wt.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != n:
        raise ValueError(f"x has shape {x.shape}, the matrix {wt.shape}")
    y = np.empty((x.shape[0], m), dtype=np.float32)
    rc = lib.ls_gemm_t(wt.ctypes.data, n, m, x.ctypes.data, x.shape[0], y.ctypes.data, _threads())
    if rc < 0:
        raise_for(rc)
    return y
