"""The EAGLE-3 head on the host: its decoder layer in the project's C kernels
(``native/ls_head.c``) instead of a llama.cpp ``eagle3`` graph.

Same computation as the graph (``src/models/eagle3.cpp`` of the vendored llama.cpp;
``models/training/eagle3_torch.py`` term for term), for every entry of a level of every
drafting request at once::

    x       = [ rmsnorm(E[t]) * attn_norm ; rmsnorm(g) * hidden_norm ]        [n, 2 e]
    k, v    = x Wkv^T (one product: the two matrices stacked), RoPE NORM at each entry's
              position on k; k rounded to bfloat16 and v to float16 (the head context's KV
              types: ``backend.context``)
    only entries with an output row go on (a catch-up's earlier entries only add k, v):
    q       = x Wq^T, RoPE NORM, rounded to bfloat16 (llama.cpp's flash attention converts it
              to K's type)
    a       = attention of each entry over its own keys (the request's committed entries,
              its tree ancestors' entries, itself)                            [n_out, H hd]
    r       = a Wo^T + g  (or + rmsnorm(g) * hidden_norm with norm_before_residual)
    h       = r + (silu(n Wgate^T) * n Wup^T) Wdown^T,  n = rmsnorm(r) * ffn_norm
    rows    = (rmsnorm(h) * output_norm) Wout^T       draft-vocabulary rows [n_out, len(d2t)]

A level is one C call (``ls_head_level``): the products, norms, RoPE, roundings and attention
of every entry, with no Python between them (the per-call glue of a level made of a dozen
small ctypes calls cost ~0.15 ms, a third of a level on the development CPU). A level of a
few entries reads each weight once, so its time is about the matrices' bytes over the memory
bandwidth: matrices stay in Q8_0 as the file stores them (``native.head.Q8Matrix``:
``ls_gemm_q8``); F16 and BF16 ones stay 16-bit (``native.head.HalfMatrix``: ``ls_gemm_h16``),
and F32 ones (the shipped heads' float32 ``fc``, kept float32 in the file because llama.cpp
would round Gemma's ~1e5 activations to float16) are rounded to float16 at load, half the
bytes, when every value fits (else they stay float32: ``ls_gemm_t``); other types are
dequantised at load the same way. The activations stay float32 in 16-bit products. ``E`` is
the head's ``token_embd`` or, without one, the target's (unscaled), dequantised by row: the
draft vocabulary's rows at load, other tokens on first use. No BLAS call (its thread pool
would compete with llama.cpp's).

``HeadUnsupported`` names what a head needs that this runtime does not do (no own ``output``
matrix: the target's lm_head; YaRN RoPE); ``Eagle3Drafter`` then runs the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ModelLoadError
from .level_drafter import DraftHub

if TYPE_CHECKING:
    from ..models.gguf_index import GGUFIndex


class HeadUnsupported(ModelLoadError):
    """The head needs something the host runtime does not implement (the message says what)."""


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``ggml_rms_norm(x) * w`` over the last axis, float32 (numpy; the runtime calls
    ``native.head.rms_norm``, the tests compare the two)."""
    ms = np.einsum("ij,ij->i", x, x, optimize=False) / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(np.float32)[:, None] * w


class _Dense:
    """A float32 matrix applied through ``ls_gemm_t`` (kept transposed, [k, m]): only for values
    beyond float16's range (``_from_float32``)."""

    def __init__(self, w: np.ndarray) -> None:
        self.wt = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)
        self.shape = (self.wt.shape[1], self.wt.shape[0])

    @classmethod
    def stack(cls, mats: "list[_Dense]") -> "_Dense":
        return cls(np.concatenate([m.dense() for m in mats]))

    def dense(self) -> np.ndarray:
        return self.wt.T

    def c_mat(self):
        from ..native._lib import LS_MAT_F32T, MatT

        k, m = self.wt.shape
        return MatT(LS_MAT_F32T, 1.0, m, k, self.wt.ctypes.data, None)

    def apply(self, x: np.ndarray, n_threads: int = 1) -> np.ndarray:
        from ..native.head import mat_apply

        return mat_apply(self, x, n_threads)


def _from_float32(w: np.ndarray):
    """A float32 [m, k] matrix in float16 (``HalfMatrix``) when every value is finite and within
    float16's range, else as float32 (``_Dense``)."""
    from ..native.head import HalfMatrix

    w = np.asarray(w, dtype=np.float32)
    if w.size and np.isfinite(w).all() and float(np.abs(w).max()) < 65504.0:
        return HalfMatrix.from_float32(w)
    return _Dense(w)


class HeadWeights:
    """A head's tensors for the host runtime, loaded once per head and target (shared by a
    drafter and its ``spawn``).

    Args:
        path: the head GGUF (architecture ``eagle3``), or a ``GGUFIndex`` already open on it
            (the drafter's: its header, with the target's vocabulary, is walked once).
        embd_path: the GGUF whose ``token_embd.weight`` the head reads (the head's own path
            when it has one, else the target's).
        d2t: [n_draft] int64 target ids of the draft vocabulary (None: the whole vocabulary).
    Raises:
        HeadUnsupported: no own ``output.weight`` (the graph borrows the target's lm_head), a
            RoPE scaling other than none / linear, or heads of unequal key and value sizes.
    """

    def __init__(self, path: str | GGUFIndex, embd_path: str, d2t: np.ndarray | None) -> None:
        from ..models.gguf_index import GGUFIndex

        ix = path if isinstance(path, GGUFIndex) else GGUFIndex(path)
        path = ix.path
        self.ix = ix
        v = ix.values
        arch = "eagle3"
        if "output.weight" not in ix.tensors:
            raise HeadUnsupported(f"{path} has no output matrix of its own (it borrows the target's lm_head)")
        scaling = str(v.get(f"{arch}.rope.scaling.type", "none")).lower()
        if scaling not in ("none", "linear"):
            raise HeadUnsupported(f"{path} uses {scaling} RoPE scaling")
        self.n_embd = int(v[f"{arch}.embedding_length"])
        self.n_head = int(v[f"{arch}.attention.head_count"])
        self.n_head_kv = int(v.get(f"{arch}.attention.head_count_kv", self.n_head))
        self.head_dim = int(v.get(f"{arch}.attention.key_length", self.n_embd // self.n_head))
        if int(v.get(f"{arch}.attention.value_length", self.head_dim)) != self.head_dim:
            raise HeadUnsupported(f"{path} has keys and values of different sizes")
        self.eps = float(v[f"{arch}.attention.layer_norm_rms_epsilon"])
        self.n_rot = int(v.get(f"{arch}.rope.dimension_count", self.head_dim))
        base = float(v.get(f"{arch}.rope.freq_base", 10000.0))
        factor = float(v.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
        self.norm_before_residual = bool(v.get(f"{arch}.norm_before_residual", False))
        self.norm_before_fc = str(v.get(f"{arch}.norm_before_fc", "false")).lower() not in ("false", "0")
        inv = base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot) / factor  # theta per pair
        if "blk.0.rope_freqs.weight" in ix.tensors:  # llama3 rope: theta / freq_factors
            inv = inv / ix.rows("blk.0.rope_freqs.weight").astype(np.float64)
        self.rope_inv = np.ascontiguousarray(inv, dtype=np.float64)
        vec = lambda name: np.ascontiguousarray(ix.rows(name), dtype=np.float32)  # noqa: E731
        self.attn_norm = vec("blk.0.attn_norm.weight")
        self.hidden_norm = vec("blk.0.attn_norm_2.weight")
        self.ffn_norm = vec("blk.0.ffn_norm.weight")
        self.output_norm = vec("output_norm.weight")
        self.enc_norm = vec("enc.output_norm.weight") if self.norm_before_fc else None
        self.fc = self._matrix("fc.weight")
        self.wq = self._matrix("blk.0.attn_q.weight")
        self.kv = self._stacked(["blk.0.attn_k.weight", "blk.0.attn_v.weight"])
        self.wo = self._matrix("blk.0.attn_output.weight")
        self.gate_up = self._stacked(["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"])
        self.down = self._matrix("blk.0.ffn_down.weight")
        self.output = self._matrix("output.weight")
        self.n_q = self.n_head * self.head_dim
        self.n_kv = self.n_head_kv * self.head_dim
        self.n_ff = self.gate_up.shape[0] // 2
        self.n_draft = self.output.shape[0]
        self._pack()
        self._embd_ix = ix if "token_embd.weight" in ix.tensors else GGUFIndex(embd_path)
        self._embd: dict[int, np.ndarray] = {}
        self._c = None
        if d2t is not None:  # the draft vocabulary's rows: every drafted token is one of them
            rows = self._embd_ix.rows("token_embd.weight", np.asarray(d2t, dtype=np.int64))
            self._embd = {int(t): r for t, r in zip(d2t, np.ascontiguousarray(rows, dtype=np.float32))}

    def _matrix(self, name: str):
        """A [m, k] weight matrix: ``Q8Matrix`` when stored as Q8_0, ``HalfMatrix`` when stored
        as F16 or BF16; other types through ``_from_float32``."""
        from gguf import GGMLQuantizationType as Q

        from ..native.head import HalfMatrix, Q8Matrix

        t = self.ix.tensors[name]
        k, m = int(t.shape[0]), int(np.prod(t.shape[1:]))
        qt = Q(t.qtype)
        if qt == Q.Q8_0:
            raw = np.frombuffer(self.ix._mm, dtype=np.uint8, count=m * k // 32 * 34, offset=t.offset)
            return Q8Matrix.from_gguf_bytes(raw.reshape(m, k // 32 * 34), k)
        if qt in (Q.F16, Q.BF16):
            raw = np.frombuffer(self.ix._mm, dtype=np.uint16, count=m * k, offset=t.offset)
            return HalfMatrix(raw.reshape(m, k), bf16=qt == Q.BF16)
        return _from_float32(self.ix.rows(name).reshape(m, k))

    def _stacked(self, names: list[str]):
        mats = [self._matrix(n) for n in names]
        same = len({(type(m), getattr(m, "bf16", None)) for m in mats}) == 1  # HalfMatrix.stack rescales
        return mats[0].stack(mats) if same else _from_float32(np.concatenate([m.dense() for m in mats]))

    def _pack(self) -> None:
        """Move every matrix's arrays into one 2 MiB-aligned buffer that the kernel may back with
        transparent huge pages (``MADV_HUGEPAGE``): a level reads each weight once, often right
        after a target decode has evicted them, and ~9 MB on 4 KiB pages is ~2,300 page walks.
        Measured on the development CPU: the readout's first product after a target decode
        0.92x the time, the third 0.89x. Where ``madvise`` is missing this is a plain copy."""
        import mmap

        mats = [self.fc, self.wq, self.kv, self.wo, self.gate_up, self.down, self.output]
        arrays = [(m, name) for m in mats for name in ("q", "d", "q4", "d4", "w", "wt") if isinstance(getattr(m, name, None), np.ndarray)]
        huge = 2 << 20
        sizes = [(getattr(m, name).nbytes + 63) // 64 * 64 for m, name in arrays]
        total = (sum(sizes) + huge - 1) // huge * huge
        if hasattr(mmap, "MAP_PRIVATE"):  # private: a shared anonymous map is shmem, without THP
            self._arena = mmap.mmap(-1, total + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            self._arena = mmap.mmap(-1, total + huge)
        buf = np.frombuffer(self._arena, dtype=np.uint8)
        start = (-buf.ctypes.data) % huge
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._arena.madvise(mmap.MADV_HUGEPAGE, start, total)
            except OSError:
                pass
        off = start
        for (m, name), size in zip(arrays, sizes):
            a = getattr(m, name)
            view = buf[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            setattr(m, name, view)
            off += size

    def c_head(self):
        """The ``ls_head_t`` of this head (``ls_head_level``), built once; its addresses point
        into this object's arrays."""
        if self._c is None:
            from ..native._lib import HeadT

            self._c = HeadT(
                self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_rot, self.n_ff,
                int(self.norm_before_residual), 0, self.eps, 0.0, self.rope_inv.ctypes.data,
                self.attn_norm.ctypes.data, self.hidden_norm.ctypes.data, self.ffn_norm.ctypes.data,
                self.output_norm.ctypes.data, self.wq.c_mat(), self.kv.c_mat(), self.wo.c_mat(),
                self.gate_up.c_mat(), self.down.c_mat(), self.output.c_mat(),
            )  # fmt: skip
        return self._c

    def embeddings(self, tokens: Sequence[int]) -> np.ndarray:
        """[n, n_embd] float32 token embedding rows (cached by token)."""
        missing = sorted({int(t) for t in tokens if int(t) not in self._embd})
        if missing:
            rows = self._embd_ix.rows("token_embd.weight", np.asarray(missing, dtype=np.int64))
            for t, r in zip(missing, np.ascontiguousarray(rows, dtype=np.float32).reshape(len(missing), -1)):
                self._embd[t] = r
        return np.stack([self._embd[int(t)] for t in tokens])

    def encode(self, feats: np.ndarray, n_threads: int = 1) -> np.ndarray:
        """The encoder: target features [n, 3 * n_embd_target] -> g [n, n_embd] float32."""
        from ..native.head import rms_norm as c_rms_norm

        x = np.ascontiguousarray(feats, dtype=np.float32)
        if self.enc_norm is not None:
            x = c_rms_norm(x, self.enc_norm, self.eps)
        return self.fc.apply(x, n_threads)

    def rope(self, x: np.ndarray, pos: np.ndarray, n_heads: int) -> np.ndarray:
        """RoPE NORM (adjacent pairs) of the first ``n_rot`` dims of every head: x [n, n_heads * head_dim]
        (numpy; the runtime calls ``native.head.rope_norm``, the tests compare the two)."""
        n = x.shape[0]
        ang = pos.astype(np.float64)[:, None] * self.rope_inv[None, :]  # [n, n_rot / 2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        y = x.reshape(n, n_heads, self.head_dim).copy()
        x0 = y[:, :, 0 : self.n_rot : 2].copy()
        x1 = y[:, :, 1 : self.n_rot : 2].copy()
        y[:, :, 0 : self.n_rot : 2] = x0 * cos - x1 * sin
        y[:, :, 1 : self.n_rot : 2] = x0 * sin + x1 * cos
        return y.reshape(n, n_heads * self.head_dim)


class HostPart:
    """One request's entries of a host level (``HostHub.decode_levels``).

    Attributes:
        tokens: [n] token of each entry; pos: [n] int64 its position; g: [n, n_embd] float32
            its input row (``fc`` output or the parent's pre-norm state).
        ctx_k / ctx_v: [c, n_kv] float32 keys and values the entries may read besides their own.
        outputs: indices of the entries that produce rows (in order).
        keys: per output entry, (rows of ctx_k, indices of this part's entries) it attends to.
        finish: ``finish(rows [n_out, n_draft], h [n_out, n_embd], k [n, n_kv], v [n, n_kv])``
            -> the request's draft rows.
    """

    def __init__(self, tokens, pos, g, ctx_k, ctx_v, outputs, keys, finish) -> None:
        self.tokens = list(tokens)
        self.pos = np.asarray(pos, dtype=np.int64)
        self.g = np.asarray(g, dtype=np.float32).reshape(len(self.tokens), -1)
        self.ctx_k = ctx_k
        self.ctx_v = ctx_v
        self.outputs = list(outputs)
        self.keys = keys
        self.finish = finish
        self.n_out = len(self.outputs)
        self.undo = None


def run_level(w: HeadWeights, parts: Sequence[HostPart], n_threads: int = 1) -> list[np.ndarray]:
    """Every part's entries through the decoder layer at once (one ``ls_head_level`` call);
    each part's ``finish`` result.

    Raises:
        ValueError: a part's keys outside its context and entries (``ls_head_level``'s check).
    """
    from ..native import lib
    from ..native.rows import raise_for

    tokens = [t for p in parts for t in p.tokens]
    if len(parts) == 1:
        p = parts[0]
        pos, g, ctx_k, ctx_v = p.pos, p.g, p.ctx_k, p.ctx_v
    else:
        pos = np.concatenate([p.pos for p in parts])
        g = np.concatenate([p.g for p in parts])
        ctx_k = np.concatenate([p.ctx_k for p in parts])
        ctx_v = np.concatenate([p.ctx_v for p in parts])
    e = w.embeddings(tokens)
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    g = np.ascontiguousarray(g, dtype=np.float32)
    ctx_k = np.ascontiguousarray(ctx_k, dtype=np.float32)
    ctx_v = np.ascontiguousarray(ctx_v, dtype=np.float32)
    n, n_ctx = len(tokens), ctx_k.shape[0]
    if g.shape != (n, w.n_embd) or ctx_k.shape[1:] != (w.n_kv,) or ctx_v.shape != ctx_k.shape or pos.shape != (n,):
        raise ValueError(f"a head level needs g [{n}, {w.n_embd}], keys and values [c, {w.n_kv}] and {n} positions, "
                         f"got {g.shape}, {ctx_k.shape}, {ctx_v.shape}, {pos.shape}")  # fmt: skip
    # each output entry's keys: rows of the context pool (every part's context, in order), then
    # entries of this call (index n_ctx + entry)
    out_rows, key_off, key_idx = [], [0], []
    c0 = e0 = 0
    for p in parts:
        for i, (ctx_rows, new_rows) in zip(p.outputs, p.keys):
            out_rows.append(e0 + i)
            key_idx.extend(c0 + r for r in ctx_rows)
            key_idx.extend(n_ctx + e0 + j for j in new_rows)
            key_off.append(len(key_idx))
        c0 += p.ctx_k.shape[0]
        e0 += len(p.tokens)
    n_out = len(out_rows)
    out_rows = np.asarray(out_rows, dtype=np.int64)
    key_off = np.asarray(key_off, dtype=np.int64)
    key_idx = np.asarray(key_idx, dtype=np.int64)
    k = np.empty((n, w.n_kv), dtype=np.float32)
    v = np.empty((n, w.n_kv), dtype=np.float32)
    h = np.empty((n_out, w.n_embd), dtype=np.float32)
    rows = np.empty((n_out, w.n_draft), dtype=np.float32)
    rc = lib.ls_head_level(w.c_head(), n, e.ctypes.data, g.ctypes.data, pos.ctypes.data,
                           ctx_k.ctypes.data if n_ctx else None, ctx_v.ctypes.data if n_ctx else None, n_ctx, n_out,
                           out_rows.ctypes.data, key_off.ctypes.data, key_idx.ctypes.data, k.ctypes.data,
                           v.ctypes.data, h.ctypes.data, rows.ctypes.data, int(n_threads))  # fmt: skip
    if rc < 0:
        raise_for(rc)
    out, o0, e0 = [], 0, 0
    for p in parts:
        m = len(p.tokens)
        out.append(p.finish(rows[o0 : o0 + p.n_out], h[o0 : o0 + p.n_out], k[e0 : e0 + m], v[e0 : e0 + m]))
        o0 += p.n_out
        e0 += m
    return out


class HostHub(DraftHub):
    """``DraftHub`` for heads on the host runtime: the requests of a drafter and its ``spawn``
    share the weights, and each level of all of them is one ``run_level`` (one product per
    matrix for every request's entries). No llama.cpp context: each request keeps its own
    keys and values (``Eagle3Drafter``)."""

    def __init__(self, weights: HeadWeights, *, n_requests: int, seqs_each: int, key, n_threads: int = 1) -> None:
        self.weights = weights
        self._n_threads = max(1, int(n_threads))
        self.n_requests = int(n_requests)
        self.n_ctx_each = 0
        self.seqs_each = int(seqs_each)
        self.key = key
        self.ctx = None
        self.batch = None
        self._free = list(range(self.n_requests - 1, -1, -1))
        self.last_level_us: list[float] = []

    @property
    def n_threads(self) -> int:
        """Threads of the products: the drafter's ``n_threads`` (default the target's), as
        llama.cpp's runtime gives the head's context (``--threads-draft``): on the 2-core
        development CPU two threads made each level 0.6-0.7x the time of one
        (docs/results.md)."""
        return self._n_threads

    def leave(self, seq0: int) -> None:
        self._free.append(seq0 // self.seqs_each)

    def decode_levels(self, parts) -> list[np.ndarray]:
        return run_level(self.weights, [p for _, p in parts], self.n_threads)
