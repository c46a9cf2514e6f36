"""ctypes wrappers of the EAGLE-3 head kernels (``native/ls_head.c``): Q8_0 matrix products
over every row of a level at once, and small per-entry attention."""

from __future__ import annotations

import numpy as np

from . import lib
from ._lib import LS_MAT_BF16, LS_MAT_F16, LS_MAT_Q8, MatT
from .rows import raise_for


def mat_apply(mat, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """``x W^T`` for any head matrix with ``shape`` (m, k) and ``c_mat()`` (``Q8Matrix``,
    ``HalfMatrix``, ``eagle3_host._Dense``) through ``ls_mat_apply``: [r, k] float32 -> [r, m]
    float32.

    Raises:
        ValueError: x not [r, k].
    """
    m, k = mat.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {x.shape}, the matrix {mat.shape}")
    y = np.empty((x.shape[0], m), dtype=np.float32)
    rc = lib.ls_mat_apply(mat.c_mat(), x.ctypes.data, x.shape[0], y.ctypes.data, int(n_threads))
    if rc < 0:
        raise_for(rc)
    return y


class Q8Matrix:
    """A weight matrix ``W`` [m, k] in Q8_0: ``q`` [m, k] int8 and ``d`` [m, k / 32] float32
    block scales (``W[i, 32 b + j] = d[i, b] * q[i, 32 b + j]``), as llama.cpp stores it;
    ``q4`` [m // 4, 4 k] int8 and ``d4`` [m // 4, 4 k / 32] float32 hold the first m // 4 * 4
    rows again, packed four by four (``ls_q8_pack4``), for the AVX-512 VNNI and AVX2 products.
    Read-only once made: the packed copy is not updated.

    Raises:
        ValueError: k not a multiple of 32, or shapes that do not match.
    """

    def __init__(self, q: np.ndarray, d: np.ndarray) -> None:
        self.q = np.ascontiguousarray(q, dtype=np.int8)
        self.d = np.ascontiguousarray(d, dtype=np.float32)
        m, k = self.q.shape
        if k % 32 or self.d.shape != (m, k // 32):
            raise ValueError(f"a Q8_0 matrix needs [m, k] int8 with k % 32 == 0 and [m, k / 32] scales, got {self.q.shape}, {self.d.shape}")
        self.shape = (m, k)
        self.q4 = np.empty((m // 4, 4 * k), dtype=np.int8)
        self.d4 = np.empty((m // 4, 4 * k // 32), dtype=np.float32)
        if m >= 4:
            rc = lib.ls_q8_pack4(self.q.ctypes.data, self.d.ctypes.data, m, k, self.q4.ctypes.data, self.d4.ctypes.data)
            if rc < 0:
                raise_for(rc)

    @classmethod
    def from_gguf_bytes(cls, raw: np.ndarray, k: int) -> "Q8Matrix":
        """From a GGUF's Q8_0 tensor data: [m, k / 32 * 34] uint8 (per block a float16 scale,
        then 32 int8)."""
        m = raw.shape[0]
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(m, k // 32, 34)
        d = blocks[:, :, :2].copy().view(np.float16).reshape(m, k // 32).astype(np.float32)
        q = blocks[:, :, 2:].copy().view(np.int8).reshape(m, k)
        return cls(q, d)

    @classmethod
    def stack(cls, mats: "list[Q8Matrix]") -> "Q8Matrix":
        """The matrices' rows one after the other (one product for several projections)."""
        return cls(np.concatenate([m.q for m in mats]), np.concatenate([m.d for m in mats]))

    def dense(self) -> np.ndarray:
        """W as float32 [m, k] (tests)."""
        m, k = self.shape
        return (self.q.reshape(m, k // 32, 32).astype(np.float32) * self.d[:, :, None]).reshape(m, k)

    def c_mat(self) -> MatT:
        """The ``ls_mat_t`` of this matrix (valid while the matrix lives)."""
        m, k = self.shape
        return MatT(LS_MAT_Q8, 1.0, m, k, self.q.ctypes.data, self.d.ctypes.data, self.q4.ctypes.data if m >= 4 else None,
                    self.d4.ctypes.data if m >= 4 else None)  # fmt: skip

    def apply(self, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
        """``x W^T``: [r, k] float32 -> [r, m] float32 (``ls_gemm_q8``: x quantised per block
        of 32 as ggml's CPU backend does, the matrix read once for all rows)."""
        return mat_apply(self, x, n_threads)


class HalfMatrix:
    """A weight matrix ``W`` [m, k] in 16-bit floats: ``w`` [m, k] uint16 bits of IEEE float16
    (``bf16=False``) or bfloat16 (``bf16=True``) of ``W * 2^e``, and ``out_scale`` = ``2^-e``
    (exact); products in float32 (``ls_gemm_h16`` through ``ls_mat_apply``), half the bytes of
    a float32 matrix.

    Raises:
        ValueError: ``w`` not 2-D, or ``out_scale`` not a positive power of two.
    """

    def __init__(self, w: np.ndarray, bf16: bool = False, out_scale: float = 1.0) -> None:
        self.w = np.ascontiguousarray(w).view(np.uint16)
        if self.w.ndim != 2:
            raise ValueError(f"a matrix needs [m, k] values, got {self.w.shape}")
        if not (out_scale > 0 and np.frexp(out_scale)[0] == 0.5):
            raise ValueError(f"out_scale must be a positive power of two, got {out_scale}")
        self.bf16 = bool(bf16)
        self.out_scale = float(out_scale)
        self.shape = self.w.shape

    @classmethod
    def from_float32(cls, w: np.ndarray) -> "HalfMatrix":
        """float32 values in float16 (nearest even), scaled by the power of two that puts the
        largest near 2^15: small weights (a trained ``fc`` divides by feature scales up to
        ~1e5) stay out of float16's subnormal range, where their relative precision would be
        lost. The caller checks that the values are finite."""
        w = np.asarray(w, dtype=np.float32)
        top = float(np.abs(w).max()) if w.size else 0.0
        e = int(np.floor(np.log2(32768.0 / top))) if top > 0 else 0
        return cls((w * np.float32(2.0**e)).astype(np.float16), out_scale=2.0**-e)

    @classmethod
    def stack(cls, mats: "list[HalfMatrix]") -> "HalfMatrix":
        """The matrices' rows one after the other; float16 ones of different scales are scaled
        again together (``from_float32``).

        Raises:
            ValueError: float16 and bfloat16 matrices together.
        """
        if len({m.bf16 for m in mats}) != 1:
            raise ValueError("cannot stack float16 and bfloat16 matrices")
        if len({m.out_scale for m in mats}) != 1:
            return cls.from_float32(np.concatenate([m.dense() for m in mats]))
        return cls(np.concatenate([m.w for m in mats]), mats[0].bf16, mats[0].out_scale)

    def dense(self) -> np.ndarray:
        """W as float32 [m, k]."""
        if self.bf16:
            v = (self.w.astype(np.uint32) << np.uint32(16)).view(np.float32)
        else:
            v = self.w.view(np.float16).astype(np.float32)
        return v * np.float32(self.out_scale)

    def c_mat(self) -> MatT:
        m, k = self.shape
        return MatT(LS_MAT_BF16 if self.bf16 else LS_MAT_F16, self.out_scale, m, k, self.w.ctypes.data, None)

    def apply(self, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
        """``x W^T``: [r, k] float32 -> [r, m] float32."""
        return mat_apply(self, x, n_threads)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ls_q8_quantize_rows``: [r, k] float32 -> (q [r, k] int8, d [r, k / 32] float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    r, k = x.shape
    q = np.empty((r, k), dtype=np.int8)
    d = np.empty((r, k // 32), dtype=np.float32)
    rc = lib.ls_q8_quantize_rows(x.ctypes.data, r, k, q.ctypes.data, d.ctypes.data)
    if rc < 0:
        raise_for(rc)
    return q, d


def attention(q: np.ndarray, n_head: int, n_head_kv: int, head_dim: int, kpool: np.ndarray, vpool: np.ndarray,
              key_off: np.ndarray, key_idx: np.ndarray, scale: float, n_threads: int = 1) -> np.ndarray:  # fmt: skip
    """``ls_head_attn``: softmax(scale q k^T) v of each entry over its own keys.

    Args:
        q: [n, n_head * head_dim] float32; kpool, vpool: [c, n_head_kv * head_dim] float32;
        key_off: [n + 1] int64 from 0; key_idx: int64 rows of kpool (entry e: key_idx[key_off[e]:key_off[e + 1]]).
        n_threads: threads (every count gives the same bits).
    Returns:
        [n, n_head * head_dim] float32.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    kpool = np.ascontiguousarray(kpool, dtype=np.float32)
    vpool = np.ascontiguousarray(vpool, dtype=np.float32)
    key_off = np.ascontiguousarray(key_off, dtype=np.int64)
    key_idx = np.ascontiguousarray(key_idx, dtype=np.int64)
    if key_idx.size and (key_idx.min() < 0 or key_idx.max() >= kpool.shape[0]):
        raise ValueError("key index outside the key pool")
    out = np.empty_like(q)
    rc = lib.ls_head_attn(q.ctypes.data, q.shape[0], n_head, n_head_kv, head_dim, kpool.ctypes.data,
                          vpool.ctypes.data, key_off.ctypes.data, key_idx.ctypes.data, float(scale), out.ctypes.data,
                          int(n_threads))  # fmt: skip
    if rc < 0:
        raise_for(rc)
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``ls_rms_norm_rows``: x [r, k] float32 normalised per row times w [k] (float32 out)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    rc = lib.ls_rms_norm_rows(x.ctypes.data, x.shape[0], x.shape[1], w.ctypes.data, float(eps), out.ctypes.data)
    if rc < 0:
        raise_for(rc)
    return out


def rope_norm(x: np.ndarray, pos: np.ndarray, n_heads: int, head_dim: int, n_rot: int, inv_freq: np.ndarray) -> np.ndarray:
    """``ls_rope_norm`` on a copy of x [r, n_heads * head_dim] float32 at positions pos [r]
    (inv_freq [n_rot / 2] float64: the angle per position of each pair)."""
    y = np.array(x, dtype=np.float32, order="C")
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    rc = lib.ls_rope_norm(y.ctypes.data, y.shape[0], n_heads, head_dim, n_rot, pos.ctypes.data, inv_freq.ctypes.data)
    if rc < 0:
        raise_for(rc)
    return y


def swiglu(gu: np.ndarray, n_ff: int) -> np.ndarray:
    """``ls_swiglu_rows``: silu(gate) * up of a stacked [r, 2 n_ff] gate / up product -> [r, n_ff]."""
    gu = np.ascontiguousarray(gu, dtype=np.float32)
    out = np.empty((gu.shape[0], n_ff), dtype=np.float32)
    rc = lib.ls_swiglu_rows(gu.ctypes.data, gu.shape[0], n_ff, out.ctypes.data)
    if rc < 0:
        raise_for(rc)
    return out
