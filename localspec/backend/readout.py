"""The lm_head readout: a decode's logits computed from its final-norm rows by ggml's own CPU
dot products, with the lm_head matrix read once for all rows.

**Why.** On a CPU the lm_head of a model with a large vocabulary dominates a decode: Gemma 3
270M's is 262,144 x 640 (Q8_0, 178 MB), measured 2026-12-05 on the 2-core AMD EPYC: a
single-token decode costs 11.8 ms, of which the trunk is 4.9 ms; llama.cpp's CPU mul_mat then
costs ~7 ms for one row and ~27 ms for 8 (its tiled paths for small batches re-read the matrix).
A verification batch needs a row per tree node, so the lm_head made a tree of 2 cost 2.0x a
single-token decode. Multiplying every block of the matrix with all rows while it is in cache
(``native/ls_readout.c``) costs ~4 ms for 1-2 rows and 13 ms for 8 (kernel 1 below).

**How.** The context's eval callback (a ``NativeTap`` on ``result_norm``, chained in front of
any drafter tap) copies the final-norm rows of the decode's output rows and then answers
false: ggml's scheduler skips the rest of that graph split, i.e. the lm_head (and llama.cpp
copies an unused logits buffer). The logits are then ``vec_dot(w_v, from_float(h_r))`` with
ggml's CPU type traits for the weight's type (``ggml_get_type_traits_cpu``): the functions
llama.cpp's mul_mat calls on its vec_dot path, on the same bytes (llama.cpp's own copy of the
weight: ``src[0]`` of the graph's ``result_output``, seen by the callback), so the logits are
bit for bit the ones a single-token decode produces. For Q8_0 weights on x86 CPUs with AVX2 a
second kernel writes ggml's AVX2 Q8_0 dot product out for four rows per weight block (the same
operations in the same order, 1.4-1.6x faster for 4-8 rows), and with AVX-512 VNNI a third
forms the same lanes two rows per 512-bit register (1.3-1.7x faster than the second for 4-16
rows on the AMD EPYC, Zen 5); each is used only where the check below finds it
bit-identical to ggml's, and of those that pass the check keeps the fastest it times.

**Checked, not assumed.** The first context of a model that asks for the readout proves it
(``Readout.self_check``; later contexts of the model take its verdict, ``Readout.check``):
decodes of ``CHECK_ROWS``, 2 and 1 rows with llama.cpp's own lm_head (its tiled, tinyBLAS and
vec_dot paths), then the same with the first one stopped at ``result_norm``. The readout's
logits must equal llama.cpp's bit for bit, and the later decodes must compute the same after
a stopped one (the stop left the KV cache as it was). An architecture that transforms the
logits after the lm_head (final-logit soft-capping, logit scales), a weight in a repacked or
device buffer, or a CPU whose kernels differ between one row and many fails the check, and
that context keeps llama.cpp's lm_head (``Context.readout_off_reason`` says why). A passed
check is kept in ``readout.json`` in the cache directory, under a key of what it depends on
(``verdict_key``: the model file, the check's size, the libraries' files, the CPU), and the
next process takes it after a short proof (``Readout.confirm``: decodes of 2 rows and 1 row
whose logits the kept kernel must give bit for bit, else the whole check runs): the whole
check and the kernels' timing cost 0.9 s of a 2.0 s ``localspec generate`` of one token on
the 2-core Intel Xeon (1.15 s with the verdict kept).

Used only where the whole model is on this machine's CPU (no GPU layers, no RPC workers): on
a GPU the lm_head is cheap, and its weights are not in host memory. Not for recurrent or
hybrid models, nor contexts with per-sequence KV streams: llama.cpp splits their batches out
of order and reorders the logits afterwards, while the readout's rows come in computed order
(``unavailable``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np

from .. import native as _native
from ..paths import cache_dir, read_json_cache, update_json_cache
from ._llama import _libggml, lib, system_info
from .features import FINAL_NORM_TENSOR as FINAL_NORM
from .features import _native_tap
from .tensor import GgmlTensor

GGML_TYPE_Q8_0 = 8

# Decodes with more output rows than this use llama.cpp's lm_head, per kernel: measured
# 2026-12-05 on the 2-core AMD EPYC (Zen 5) at 256 tokens of context, whole decodes with the
# readout against llama.cpp's lm_head (ms, median of 15): kernel 1 (AVX2) 16 rows 60.7 / 66.9,
# 24 rows 91.0 / 97.2, 32 rows 130.1 / 127.7 (no gain past 24); kernel 2 (AVX-512 VNNI) 16 rows
# 51.1, 24 rows 67.7, 32 rows 106.1, 48 rows 160.2 / 202.5, 64 rows 193.6 / 253.1
# (docs/architecture.md). ggml's vec_dot per pair (kernel 0) is the slowest of the three.
DEFAULT_MAX_ROWS = {0: 16, 1: 16, 2: 64}
CHECK_ROWS = 16
"""Output rows of the check's first decode (``Readout.self_check``). A kernel computes each
row by the same operations whatever the number of rows (rows beyond 16 take another pass
over the weight block), so decodes of more rows than checked are the same functions on the
same bytes; ``tests/test_readout.py`` compares the kernels for up to 35 rows."""
log = logging.getLogger("localspec.readout")


def _max_rows_from_env() -> int | None:
    """``LOCALSPEC_READOUT_MAX_ROWS`` (a positive integer; every kernel), else None: the
    kernel's ``DEFAULT_MAX_ROWS`` (a bad value is named in a logged warning, not raised at
    import)."""
    raw = os.environ.get("LOCALSPEC_READOUT_MAX_ROWS")
    if raw is None:
        return None
    try:
        n = int(raw)
        if n >= 1:
            return n
    except ValueError:
        pass
    log.warning("LOCALSPEC_READOUT_MAX_ROWS=%r is not a positive integer; using each kernel's default", raw)
    return None


MAX_ROWS = _max_rows_from_env()


def wanted() -> bool:
    """Whether target contexts ask for the readout: ``LOCALSPEC_READOUT=own`` (default) or
    ``llama`` (llama.cpp's lm_head always, e.g. to compare); another value is named in a
    warning and taken as ``own``."""
    v = os.environ.get("LOCALSPEC_READOUT", "own").strip().lower()
    if v not in ("own", "llama"):
        log.warning("LOCALSPEC_READOUT=%r is not 'own' or 'llama'; using 'own'", v)
    return v != "llama"


def _check_rows(ctx) -> int:
    """Rows of the check's first decode on ``ctx``: ``CHECK_ROWS``, fewer when
    ``LOCALSPEC_READOUT_MAX_ROWS`` or the context's batch is smaller."""
    return max(1, min(CHECK_ROWS, MAX_ROWS or CHECK_ROWS, int(ctx.n_batch)))


def forced_kernel() -> int | None:
    """``LOCALSPEC_READOUT_KERNEL`` (0: ggml's vec_dot, 1: AVX2, 2: AVX-512 VNNI), the kernel
    to use where the check proved it, instead of the fastest that passed (e.g. to compare
    them); unset: None. Another value is named in a warning and ignored."""
    raw = os.environ.get("LOCALSPEC_READOUT_KERNEL")
    if raw is None or not raw.strip():
        return None
    if raw.strip() in ("0", "1", "2"):
        return int(raw)
    log.warning("LOCALSPEC_READOUT_KERNEL=%r is not 0, 1 or 2; ignored", raw)
    return None


VERDICT_VERSION = 1
"""Version of the verdicts kept in ``verdict_path()`` (a verdict of another version is not used)."""


def verdict_path() -> Path:
    """The file of verdicts kept across processes: ``readout.json`` in the cache directory."""
    return cache_dir() / "readout.json"


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _file_ids(paths) -> list[str]:
    """``name:size:mtime_ns`` of each file (a rebuilt library has another)."""
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append(f"{Path(p).name}:{st.st_size}:{st.st_mtime_ns}")
    return out


def verdict_key(ctx) -> str | None:
    """What a ``self_check`` verdict on ``ctx`` depends on, hashed: the model file (path, size,
    modification time), the check's size (``_check_rows``), the batch threads (the kernel
    timing), an asked-for kernel (``forced_kernel``: kernel 0 is checked only then), the
    ggml and llama.cpp libraries (the files beside ``libggml``), this package's C library,
    and the CPU (llama.cpp's feature line and the model name). None where one cannot be read
    (no verdict is kept then)."""
    m = ctx.model
    try:
        path = Path(m.path)
        lib_dir = Path(_libggml._name).parent
        parts = [str(path.resolve()), *_file_ids([path]), f"rows={_check_rows(ctx)}", f"threads={ctx.n_threads_batch}",
                 f"forced={forced_kernel()}", *_file_ids(sorted(lib_dir.glob("*.so*")) + sorted(lib_dir.glob("*.dylib"))),
                 *_file_ids([_native.lib._name]), system_info(), _cpu_name()]  # fmt: skip
    except (OSError, AttributeError, TypeError):
        return None
    return hashlib.sha1("|".join(parts).encode()).hexdigest()


class _TypeTraitsCpu(ctypes.Structure):
    """``struct ggml_type_traits_cpu`` (ggml-cpu.h)."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]  # fmt: skip


def _ggml():
    """llama-cpp-python's ``libggml`` handle with the functions used here bound (ggml-cpu's and
    ggml-base's symbols resolve through it: the libraries llama.cpp itself runs)."""
    g = _libggml
    if not getattr(g, "_ls_readout_bound", False):
        g.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
        g.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        g.ggml_row_size.restype = ctypes.c_size_t
        g.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        g.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        g.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        g.ggml_backend_buffer_get_base.restype = ctypes.c_void_p
        g.ggml_backend_buffer_get_base.argtypes = [ctypes.c_void_p]
        g.ggml_backend_buffer_get_size.restype = ctypes.c_size_t
        g.ggml_backend_buffer_get_size.argtypes = [ctypes.c_void_p]
        g._ls_readout_bound = True
    return g


def unavailable(model, *, kv_unified: bool = True, n_seq_max: int = 1) -> str | None:
    """Why the readout cannot run for ``model`` in a context with these options (one line), or
    None when it may.

    The readout's rows come in the order llama.cpp computes them, micro-batch by micro-batch;
    llama.cpp returns logits in batch order, reordering them afterwards when its batch split
    took tokens out of order (``split_equal`` / ``split_seq``: recurrent and hybrid memories,
    and per-sequence KV streams). Those cases keep llama.cpp's lm_head. With one KV stream the
    split is ``split_simple``, in batch order (llama-kv-cache.cpp, ``init_batch``)."""
    if not _native.enabled():
        return "the C kernels are not built or are switched off" + (f" ({_native.LOAD_ERROR})" if not _native.AVAILABLE else "")
    if getattr(model, "vocab_only", False):
        return "vocabulary-only model"
    if getattr(model, "on_local_gpu", False):
        return "layers are offloaded to a GPU"
    if getattr(model, "_load_args", {}).get("rpc"):
        return "layers are on RPC workers"
    handle = getattr(model, "handle", None)
    if handle is not None and (lib.llama_model_is_recurrent(handle) or lib.llama_model_is_hybrid(handle)):
        return "a recurrent or hybrid model (llama.cpp may reorder its output rows)"
    if not kv_unified and n_seq_max > 1:
        return "per-sequence KV streams (llama.cpp may reorder its output rows)"
    return None


class LmHeadWeights:
    """The lm_head weight as llama.cpp holds it (the ``src[0]`` of the graph's
    ``result_output`` matmul, whose ``src[1]`` is ``result_norm``) and ggml's CPU functions for
    its type.

    Attributes:
        data: address of ``[n_vocab]`` rows of ``row_bytes`` (host memory of the model).
        from_float / vec_dot: addresses of ggml's functions; ``q_row_bytes`` one quantized row.
    """

    def __init__(self, data: int, n_vocab: int, row_bytes: int, from_float: int, vec_dot: int, q_row_bytes: int,
                 type_id: int) -> None:  # fmt: skip
        self.data, self.n_vocab, self.row_bytes = int(data), int(n_vocab), int(row_bytes)
        self.from_float, self.vec_dot, self.q_row_bytes = int(from_float), int(vec_dot), int(q_row_bytes)
        self.type_id = int(type_id)

    @staticmethod
    def from_graph(weight_ptr: int | None, norm_ptr: int | None, n_embd: int, n_vocab: int) -> "LmHeadWeights | str":
        """The weight seen as ``src[0]`` of ``result_output`` (``src[1]``: ``norm_ptr``), or a
        one-line reason why it cannot be read here."""
        if not weight_ptr or not norm_ptr:
            return "the graph has no result_output node"
        norm = GgmlTensor.from_address(norm_ptr)
        if norm.name != FINAL_NORM.encode():
            return "result_output is not the lm_head of result_norm (a logit transform follows it)"
        t = GgmlTensor.from_address(weight_ptr)
        g = _ggml()
        if int(t.ne[0]) != n_embd or int(t.ne[1]) != n_vocab or int(t.ne[2]) != 1 or int(t.ne[3]) != 1:
            return f"the lm_head is {list(t.ne)}, not [{n_embd}, {n_vocab}]"
        if not t.data or not t.buffer or not g.ggml_backend_buffer_is_host(t.buffer):
            return "the lm_head is not in plain host memory (a device, repacked or AMX buffer)"
        row = int(g.ggml_row_size(int(t.type), n_embd))
        if int(t.nb[1]) != row:
            return "the lm_head rows are not contiguous"
        base, size = int(g.ggml_backend_buffer_get_base(t.buffer) or 0), int(g.ggml_backend_buffer_get_size(t.buffer))
        if not (base <= int(t.data) and int(t.data) + row * n_vocab <= base + size):
            return "the lm_head lies outside its buffer"
        tt = g.ggml_get_type_traits_cpu(int(t.type)).contents
        if not tt.vec_dot:
            return f"ggml has no CPU dot product for type {int(t.type)}"
        qt = g.ggml_get_type_traits_cpu(int(tt.vec_dot_type)).contents
        if not qt.from_float:
            return f"ggml has no CPU conversion to type {int(tt.vec_dot_type)}"
        return LmHeadWeights(t.data, n_vocab, row, qt.from_float, tt.vec_dot, g.ggml_row_size(int(tt.vec_dot_type), n_embd),
                             int(t.type))  # fmt: skip


class Readout:
    """A context's lm_head readout (see the module docstring): the eval callback to install,
    and the logits of the decodes it computes.

    Args:
        n_embd / n_vocab: the target's hidden size (the ``result_norm`` width) and vocabulary.
        chain: ``(callback, user_data)`` of the drafter tap to run behind this one, or None.
    """

    def __init__(self, n_embd: int, n_vocab: int, chain=None) -> None:
        self.n_embd, self.n_vocab = int(n_embd), int(n_vocab)
        self._tap = _native_tap([FINAL_NORM], self.n_embd, True)
        self._tap.set_stop(0)
        self._tap.watch("result_output", GgmlTensor.src.offset)
        self._chain = chain if chain is not None and chain[0] is not None else None
        if self._chain is not None:
            self._tap.set_next(*self._chain)
        self.callback, self.user_data = self._tap.callback, self._tap.user_data
        self.weights: LmHeadWeights | None = None
        self.active = False  # set by a passed self_check
        self.off_reason: str | None = "not checked yet"
        self.max_rows = MAX_ROWS or CHECK_ROWS  # set for the chosen kernel by ``check`` (``_force``)
        self.check_rows = CHECK_ROWS  # the check's first decode (``self_check``)
        self.kernel = 0  # ls_lm_head's kernel (self_check picks it)
        self.passed: list[int] = []  # the kernels the check proved bit-identical (those it tried)
        self._buf = np.empty((0, self.n_vocab), dtype=np.float32)
        self.n_used = 0  # decodes whose logits the readout computed
        self.t_us = 0.0  # time spent in the lm_head kernel (µs)

    # -- per decode ---------------------------------------------------------------------------

    def begin(self, n_out: int) -> bool:
        """Before a decode with ``n_out`` output rows: whether this decode uses the readout (its
        graph then stops at ``result_norm``)."""
        use = self.active and 0 < n_out <= self.max_rows
        self._tap.clear()
        self._tap.set_stopping(2 if use else 0)
        return use

    def cancel(self) -> None:
        """The decode failed: nothing to read."""
        self._tap.set_stopping(0)

    def finish(self, n_out: int, n_threads: int) -> np.ndarray:
        """After a decode that used the readout: its logits ``[n_out, n_vocab] float32`` (a
        view of a buffer that the next decode reuses).

        Raises:
            RuntimeError: the tap did not capture ``n_out`` rows (the lm_head was skipped, so
                this decode has no logits); the readout turns itself off.
        """
        self._tap.set_stopping(0)
        try:
            h = self._tap.rows(0)
        except TypeError:
            h = None
        if h is None or h.shape[0] != n_out:
            self.active = False
            self.off_reason = f"a decode captured {'no' if h is None else h.shape[0]} final-norm rows for {n_out} outputs"
            raise RuntimeError(f"lm_head readout: {self.off_reason}; it is now off for this context")
        return self._compute(h, n_threads)

    def _compute(self, h: np.ndarray, n_threads: int) -> np.ndarray:
        n = h.shape[0]
        if self._buf.shape[0] < n:
            # one reallocation up to the limit once a decode needs more than CHECK_ROWS rows
            grow = self.max_rows if n > CHECK_ROWS else min(self.max_rows, CHECK_ROWS)
            self._buf = np.empty((max(n, grow), self.n_vocab), dtype=np.float32)
        out = self._buf[:n]
        w = self.weights
        t0 = time.perf_counter()
        rc = _native.lib.ls_lm_head(w.data, w.n_vocab, w.row_bytes, self.n_embd, h.ctypes.data, n, w.from_float,
                                    w.q_row_bytes, w.vec_dot, out.ctypes.data, int(n_threads), self.kernel)  # fmt: skip
        self.t_us += (time.perf_counter() - t0) * 1e6
        if rc != 0:
            self.active = False
            self.off_reason = f"the lm_head kernel {self.kernel} failed (code {rc})"
            raise RuntimeError(f"lm_head readout: {self.off_reason}")
        self.n_used += 1
        return out

    # -- the check ----------------------------------------------------------------------------

    def check(self, ctx) -> bool:
        """``self_check`` once per model: a later context of the same model takes the verdict,
        the weight and the kernel of the first when that check decoded as many rows as its own
        would (a context of a larger batch after one of a small batch checks again)
        (what the check proves depends on the model, its weight and this process's ggml, not
        on the context). Without an in-process verdict, an earlier process's kept one
        (``verdict_path``, ``verdict_key``) is taken once ``confirm`` holds; else the whole
        check runs, and a passed one is kept for the next process. Returns ``active``."""
        model = ctx.model
        seen = getattr(model, "_readout_verdict", None)
        if seen is not None and seen["check_rows"] >= _check_rows(ctx):
            self.weights, self.kernel, self.check_rows = seen["weights"], seen["kernel"], seen["check_rows"]
            self.active, self.off_reason, self.passed = seen["active"], seen["off_reason"], seen["passed"]
            return self._force(ctx)
        # no verdict yet, or one of fewer rows than this context's check: an earlier process's,
        # confirmed, else the whole check (kept on disk for the next process when it passes)
        key = verdict_key(ctx)
        stored = read_json_cache(verdict_path()).get(key) if key else None
        ok = isinstance(stored, dict) and stored.get("version") == VERDICT_VERSION and self.confirm(ctx, stored)
        if not ok:
            ok = self.self_check(ctx)
            if key and (ok or stored is not None):  # keep a passed check; drop one that no longer holds
                entry = {"version": VERDICT_VERSION, "kernel": self.kernel, "passed": list(self.passed),
                         "check_rows": self.check_rows} if ok else None  # fmt: skip
                update_json_cache(verdict_path(), key, entry)
        try:
            model._readout_verdict = {"weights": self.weights, "kernel": self.kernel, "check_rows": self.check_rows,
                                      "active": ok, "off_reason": self.off_reason, "passed": list(self.passed)}  # fmt: skip
        except AttributeError:
            pass
        return self._force(ctx)

    def _force(self, ctx) -> bool:
        """Applies ``forced_kernel()`` when the check proved that kernel (else a warning and the
        check's choice), then the kernel's row limit (``LOCALSPEC_READOUT_MAX_ROWS``, else
        ``DEFAULT_MAX_ROWS``; at most the context's ``n_batch``). Returns ``active``."""
        k = forced_kernel()
        if self.active and k is not None and k != self.kernel:
            if k in self.passed:
                self.kernel = k
            else:
                log.warning("LOCALSPEC_READOUT_KERNEL=%d: the check did not prove that kernel here (it proved %s); "
                            "using kernel %d", k, ", ".join(map(str, self.passed)), self.kernel)  # fmt: skip
        limit = MAX_ROWS or DEFAULT_MAX_ROWS.get(self.kernel, CHECK_ROWS)
        self.max_rows = max(1, min(limit, int(ctx.n_batch)))
        return self.active

    def _fastest(self, kernels: list[int], rows: list[np.ndarray], n_threads: int) -> int:
        """The kernel of ``kernels`` (all checked bit-identical; in order of preference) that
        computes ``rows`` (the check's ``check_rows``- and 2-row decodes) soonest: after a
        round untimed, the best of 3 timings each, interleaved, so that a busy moment does
        not decide alone; a later kernel must be 5% faster to displace an earlier one.
        Kernel 2 (AVX-512 VNNI) computes 4-16 rows 1.3-1.6x faster than kernel 1 on the AMD
        EPYC (Zen 5), but may not on a CPU that lowers its clock for 512-bit instructions."""
        if len(kernels) == 1:
            return kernels[0]
        best = {k: float("inf") for k in kernels}
        for rnd in range(4):
            for k in kernels:
                self.kernel = k
                t0 = time.perf_counter()
                for h in rows:
                    self._compute(h, n_threads)
                if rnd:
                    best[k] = min(best[k], time.perf_counter() - t0)
        chosen = kernels[0]
        for k in kernels[1:]:
            if best[k] < 0.95 * best[chosen]:
                chosen = k
        return chosen

    def _decodes(self, ctx, sizes, stop_first: bool):
        """Decodes of ``sizes`` output rows each (random tokens from position 0, after the KV
        cache is cleared), every row an output, the first one stopped at ``result_norm`` when
        ``stop_first``: per decode (llama.cpp's logits ``[n, n_vocab]`` or None when stopped,
        the final-norm rows ``[n, n_embd]``). Reads the lm_head weight from the first decode's
        graph when not yet read. Returns a one-line reason instead when a decode fails or the
        weight cannot be read."""
        from .batch import Batch

        rng = np.random.default_rng(0)
        hi = max(2, min(self.n_vocab, 30000))
        b = Batch(max(sizes))
        lib.llama_memory_clear(ctx.mem, True)
        got, pos = [], 0
        for k, n in enumerate(sizes):
            toks = rng.integers(1, hi, n).astype(np.int32)
            b.set_sequence(toks, pos, output="all")
            pos += n
            self._tap.clear()
            stop = stop_first and k == 0
            self._tap.set_stopping(2 if stop else 1)
            rc = lib.llama_decode(ctx.handle, b.struct)
            self._tap.set_stopping(0)
            if rc != 0:
                return f"a check decode failed ({rc})"
            if self.weights is None:
                w = LmHeadWeights.from_graph(self._tap.watched(0), self._tap.watched(1), self.n_embd, self.n_vocab)
                if isinstance(w, str):
                    return w
                self.weights = w
            h = self._tap.rows(0)
            if h.shape[0] != n:
                return f"captured {h.shape[0]} final-norm rows for {n} outputs"
            ref = None if stop else np.ctypeslib.as_array(lib.llama_get_logits(ctx.handle), shape=(n, self.n_vocab)).copy()
            got.append((ref, h))
        return got

    def _after_check(self, ctx) -> None:
        """Leave ``ctx`` and the tap as a check found them: the KV cache empty, the drafter tap
        chained again, the counters at zero."""
        self._tap.set_stopping(0)
        self._tap.clear()
        lib.llama_memory_clear(ctx.mem, True)
        if self._chain is not None:
            self._tap.set_next(*self._chain)
        self.n_used = 0
        self.t_us = 0.0

    def confirm(self, ctx, verdict: dict) -> bool:
        """Take ``verdict`` (a passed ``self_check`` of the same ``verdict_key`` in an earlier
        process, kept in ``verdict_path()``) after a short proof on ``ctx``: decodes of 2 rows
        and 1 row with llama.cpp's lm_head, whose logits the verdict's kernel must give bit
        for bit (a changed library, CPU or weight that the key missed fails here). Returns
        whether it holds; where not, the readout is not active and ``self_check`` must run."""
        if self._chain is not None:
            self._tap.set_next(None, None)
        try:
            got = self._decodes(ctx, (2, 1), False)
            kern = int(verdict["kernel"])
            if isinstance(got, str) or (kern != 0 and not _native.lib.ls_lm_head_kernel_available(kern)):
                return False
            self.kernel = kern
            if not all(np.array_equal(ref, self._compute(h, ctx.n_threads_batch)) for ref, h in got):
                return False
            self.passed = [int(k) for k in verdict["passed"]]
            self.check_rows = int(verdict["check_rows"])
            self.active, self.off_reason = True, None
            return True
        except Exception:  # noqa: BLE001 - an unusable verdict: the full check decides
            return False
        finally:
            self._after_check(ctx)

    def self_check(self, ctx) -> bool:
        """Prove the readout on ``ctx`` (a fresh context; its KV cache is cleared afterwards):
        three decodes (``check_rows`` rows, 2 rows, 1 row: the sizes where llama.cpp's CPU
        matmul takes its tiled, tinyBLAS and vec_dot paths) with llama.cpp's lm_head, then
        the same three with the first stopped at ``result_norm``; every row of the readout
        must equal llama.cpp's logits bit for bit, and the later decodes must compute the same
        either way. The faster kernel (ggml's Q8_0 dot product written out for several rows,
        ``ls_lm_head`` kernel 1) is used when it passes, else ggml's own ``vec_dot`` (kernel 0)
        when that passes. Sets ``active`` / ``kernel`` / ``off_reason``; returns ``active``."""
        self.active = False
        if self._chain is not None:
            self._tap.set_next(None, None)  # the drafter tap sees none of the check's decodes
        self.check_rows = _check_rows(ctx)
        sizes = (self.check_rows, 2, 1)
        try:
            runs = []  # per run, per decode: (llama.cpp's logits or None when stopped, final-norm rows)
            for stop_first in (False, True):
                got = self._decodes(ctx, sizes, stop_first)
                if isinstance(got, str):
                    self.off_reason = got
                    return False
                runs.append(got)
            whole, stopped = runs
            if not all(np.array_equal(hw, hs) for (_, hw), (_, hs) in zip(whole, stopped)) or not all(
                np.array_equal(lw, ls) for (lw, _), (ls, _) in zip(whole[1:], stopped[1:])
            ):
                self.off_reason = "a decode stopped at result_norm changed what the next decode computes"
                return False
            fast = [k for k in (2, 1) if self.weights.type_id == GGML_TYPE_Q8_0 and _native.lib.ls_lm_head_kernel_available(k)]
            why, passed = [], []
            for kern in fast + [0]:
                if kern == 0 and passed and forced_kernel() != 0:
                    break  # ggml's own vec_dot per pair: only when no written-out kernel passed, or asked for
                self.kernel = kern
                diff = 0.0
                try:
                    for ref, h in whole:
                        own = self._compute(h, ctx.n_threads_batch)
                        if not np.array_equal(ref, own):
                            diff = max(diff, float(np.abs(ref - own).max()) if np.isfinite(own).all() else float("inf"))
                except RuntimeError as e:
                    why.append(f"kernel {kern}: {e}")
                    continue
                if diff == 0.0:
                    passed.append(kern)
                else:
                    why.append(f"kernel {kern}: max |diff| {diff:.3g}")
            self.passed = passed
            if passed:
                timed = [k for k in passed if k != 0] or passed  # kernel 0 is timed only when alone
                self.kernel = self._fastest(timed, [h for _, h in whole[:2]], ctx.n_threads_batch)
                self.active, self.off_reason = True, None
                return True
            self.off_reason = f"logits differ from llama.cpp's lm_head ({'; '.join(why)}): a logit transform or other kernels"
            return False
        except Exception as e:  # noqa: BLE001 - a failed check keeps llama.cpp's lm_head
            self.off_reason = f"the check failed ({type(e).__name__}: {e})"
            return False
        finally:
            self._after_check(ctx)
