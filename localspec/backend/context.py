"""``Context``: an owned llama.cpp inference context (KV cache + compute graph).

Owns one ``llama_context *``. Exposes ``decode``, the logits of the last decode as a numpy
view (no copy), the KV memory operations, threads and the abort flag. The defaults are the
ones speculative decoding needs: a unified KV buffer across sequences (token trees are
multi-sequence batches over a shared prefix) and a full-size sliding-window cache (so a
rollback never needs cells that a window cache already dropped).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ContextOverflowError, DecodeError, InvalidRequestError, KVCacheError, ModelLoadError
from ._llama import exact_kernels, held_errors, lib, raise_if_interrupted, recent_errors
from .batch import Batch
from .model import Model


log = logging.getLogger("localspec.readout")

GGML_TYPE_BF16 = 30


def available_cpus() -> int | None:
    """The CPUs this process may run on (its affinity; macOS / Windows: the machine's), or None
    where the system does not say."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS / Windows
        return os.cpu_count()


def default_threads() -> int:
    """Threads for llama.cpp: the CPUs this process may run on, at most 16."""
    return max(1, min(available_cpus() or 4, 16))


def kv_bytes_per_token(model: Model, type_k: int | None = None, type_v: int | None = None) -> float | None:
    """Bytes one token takes in a context's KV cache, from the model's GGUF metadata: layers x
    KV heads x (key size x K type's bytes + value size x V type's bytes), F16 where no type is
    given (llama.cpp's default). None where the metadata does not say it plainly: per-layer
    head counts, MLA's compressed cache (``kv_lora_rank``), layers sharing another's cache."""
    arch = model.architecture

    def number(key: str, default: int | None) -> int | None:
        v = model.meta(f"{arch}.{key}")
        if v is None:
            return default
        try:
            return int(v)
        except ValueError:  # an array: one value per layer
            return None

    if any(model.meta(f"{arch}.attention.{k}") is not None for k in ("kv_lora_rank", "shared_kv_layers")):
        return None
    n_head = number("attention.head_count", None)
    if not n_head:
        return None
    n_head_kv = number("attention.head_count_kv", n_head)
    k = number("attention.key_length", model.n_embd // n_head)
    v = number("attention.value_length", model.n_embd // n_head)
    if n_head_kv is None or k is None or v is None:
        return None

    def size(t: int | None) -> float:
        """Bytes per element of cache type ``t`` (gguf's block table); a type gguf does not
        know counts as 4-bit, so that the estimate stays at or below what llama.cpp allocates."""
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(GGMLQuantizationType.F16 if t is None else int(t))]
        except (ValueError, KeyError):
            return 0.5
        return nbytes / block

    return model.n_layer * n_head_kv * (k * size(type_k) + v * size(type_v))


def available_memory() -> int | None:
    """Bytes of memory available for new allocations (``MemAvailable`` in /proc/meminfo);
    None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_kv_memory(model: Model, n_ctx: int, type_k: int | None = None, type_v: int | None = None) -> None:
    """Refuse a context whose KV cache cannot fit in the memory available, before llama.cpp
    allocates it (there, a cache larger than memory gets the process killed without a word).
    Checked where the cache is in this machine's memory (not on a GPU or RPC workers) and both
    ``kv_bytes_per_token`` and ``available_memory`` are known.

    Raises:
        ModelLoadError: the estimate exceeds the memory available; says what to lower.
    """
    if model.on_local_gpu or model.rpc_workers:
        return
    per_token, avail = kv_bytes_per_token(model, type_k, type_v), available_memory()
    if not per_token or avail is None:
        return
    n = int(n_ctx) if n_ctx > 0 else model.n_ctx_train
    need = per_token * n
    if need > avail:
        raise ModelLoadError(
            f"a KV cache of {n} tokens would need {need / 2**30:.1f} GiB ({per_token / 1024:.1f} KiB a token for "
            f"{model.path.name}), more than the {avail / 2**30:.1f} GiB of memory available: use a smaller context "
            "(n_ctx / --n-ctx; serve: a smaller --ctx-per-request or --parallel)"
        )


class Context:
    """A llama.cpp context over a ``Model``.

    Args:
        model: the loaded model (must outlive the context).
        n_ctx: context size in tokens; llama.cpp rounds the KV cache up to a multiple of 256
            (``n_ctx_allocated``) but ``n_ctx`` stays the size asked for, and nothing uses more.
        n_batch: most tokens one ``decode`` call may take (prefill chunk size).
        n_ubatch: physical micro-batch (defaults to ``n_batch``).
        n_seq_max: sequence ids available; token trees need one per leaf plus seq 0.
        n_threads / n_threads_batch: CPU threads for single-token and batched decodes.
        swa_full: full-size sliding-window cache. Keep it on: with a window-sized cache a
            rollback past the window silently loses cells (see docs/architecture.md).
        kv_unified: one KV buffer shared by all sequences (required for token trees).
        embeddings: also extract embeddings.
        cb_eval: optional ``ggml_backend_sched_eval_callback`` (e.g. EAGLE-3 features).
        ctx_other: another context to share tensors with (EAGLE-3 draft heads).
        mtp: a context of llama.cpp's type MTP (``LLAMA_CONTEXT_TYPE_MTP``): its graph runs the
            model's MTP / NextN block instead of the trunk (model loaded with ``load_mtp``).
        readout: compute the logits of decodes with at most ``readout.max_rows`` output rows (16 or
            64 by kernel: ``backend.readout.DEFAULT_MAX_ROWS``)
            with localspec's lm_head readout (``backend.readout``: the same bits, the lm_head
            read once for all rows) when the model is on the CPU and the readout passes its
            check on this context; else llama.cpp's lm_head (``readout_off_reason`` says why).

    Raises:
        ModelLoadError: the KV cache would not fit in the memory available
            (``check_kv_memory``), or llama.cpp could not create the context.
    """

    def __init__(
        self,
        model: Model,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        swa_full: bool = True,
        kv_unified: bool = True,
        embeddings: bool = False,
        flash_attn: bool | None = None,
        cb_eval=None,
        cb_eval_user_data=None,
        ctx_other: "Context | None" = None,
        type_k: int | None = None,
        type_v: int | None = None,
        mtp: bool = False,
        readout: bool = False,
    ) -> None:
        self._ctx = None
        self.model = model
        self.readout = None  # backend.readout.Readout while it computes this context's logits
        self.readout_off_reason: str | None = "not asked" if not readout else None
        self._readout_logits = None  # the last decode's logits when the readout computed them
        if n_ctx > 0 and n_seq_max > min(int(n_ctx), int(n_batch)):
            # llama.cpp asserts (aborting the process) when the sequences outnumber the batch
            raise InvalidRequestError(
                f"a context of {n_ctx} tokens (batch {n_batch}) cannot hold {n_seq_max} sequences: "
                "use a larger context (n_ctx / --n-ctx) or smaller token trees (--max-tree-nodes)"
            )
        params = lib.llama_context_default_params()
        params.n_ctx = int(n_ctx)
        params.n_batch = int(n_batch)
        params.n_ubatch = int(n_ubatch or n_batch)
        params.n_seq_max = int(n_seq_max)
        self.n_threads = int(n_threads or default_threads())
        self.n_threads_batch = int(n_threads_batch or self.n_threads)
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads_batch
        params.swa_full = bool(swa_full)
        params.kv_unified = bool(kv_unified)
        params.embeddings = bool(embeddings)
        if flash_attn is not None:
            params.flash_attn_type = 1 if flash_attn else 0
        if type_k is None and exact_kernels() and not model.on_local_gpu:
            # K in BF16, V in F16: with K and V of different types llama.cpp's CPU flash
            # attention takes the same kernel for one query row as for many (not the split-KV
            # path it otherwise uses for single-token decodes over >= 512 cells), so a
            # verification batch is bit-identical to plain decoding. BF16 is the type Gemma
            # and most current models are trained in. See docs/architecture.md.
            # Layers on RPC workers (CPU backends of the same ggml) get the same K type, so
            # they compute the bits a local decode computes (docs/rpc.md).
            type_k = GGML_TYPE_BF16
        self.type_k = type_k
        if type_k is not None:
            params.type_k = int(type_k)
        if type_v is not None:
            params.type_v = int(type_v)
        if not mtp:  # an MTP context caches only the MTP blocks' layers
            check_kv_memory(model, n_ctx, type_k, type_v)
        rd = None
        if readout:
            from .readout import Readout, unavailable

            why = "an MTP or embeddings context" if mtp or embeddings else unavailable(model, kv_unified=kv_unified, n_seq_max=n_seq_max)
            if why is not None:
                self.readout_off_reason = why
            else:
                rd = Readout(model.n_embd, model.n_vocab, chain=(cb_eval, cb_eval_user_data) if cb_eval is not None else None)
                cb_eval, cb_eval_user_data = rd.callback, rd.user_data
        self._cb_eval = cb_eval  # keep the ctypes callback alive as long as the context
        self._readout_obj = rd
        if cb_eval is not None:
            params.cb_eval = cb_eval
            params.cb_eval_user_data = cb_eval_user_data
        if ctx_other is not None:
            params.ctx_other = ctx_other.handle
        if mtp:
            params.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP
            params.n_rs_seq = 0
        # The abort callback is a Python function that ggml calls between graph nodes
        # (hundreds of times per decode, ~0.5 ms in all): it is installed only around long
        # decodes (``abortable()``, used by prefill), not for every generation step.
        self._abort = threading.Event()
        self._abort_cb = lib.ggml_abort_callback(lambda _data: self._abort.is_set())
        recent_errors(clear=True)
        with held_errors():  # a failure's lines are in its one-line error, not printed before it
            ctx = lib.llama_init_from_model(model.handle, params)
            # the guards of the model's workers as of now: after a reload the model has new ones,
            # and this context's decodes (on the old model) must keep failing
            self._rpc_guards = list(model._rpc_guards)
            if ctx and model._rpc_guards and model.lost_worker() is not None:
                lib.llama_free(ctx)
                model.check_workers()  # raises WorkerLostError naming the worker
            if not ctx:
                why = "; ".join(recent_errors()) or "no reason logged"
                raise ModelLoadError(f"llama.cpp could not create a context (n_ctx={n_ctx}): {why}")
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        # llama.cpp rounds the KV cache up (to a multiple of 256); the context holds to the size
        # asked for, so that `--n-ctx 20` means 20 tokens (positions, prompt checks, trees)
        self.n_ctx_allocated: int = lib.llama_n_ctx(ctx)
        self.n_ctx: int = min(int(n_ctx), self.n_ctx_allocated) if n_ctx > 0 else self.n_ctx_allocated
        self.n_batch: int = lib.llama_n_batch(ctx)
        self.n_seq_max: int = lib.llama_n_seq_max(ctx)
        self.n_vocab: int = model.n_vocab
        self.swa_full = bool(swa_full)
        self.n_outputs = 0  # rows of logits produced by the last decode
        self.n_calls = 0  # llama_decode / llama_process calls made on this context
        self.n_tokens_last = 0  # tokens of the last successful ``decode``
        # called as ``after_decode(ctx)`` after every successful ``decode`` (NextnTap)
        self.after_decode = None
        if rd is not None:
            if rd.check(self):
                self.readout = rd
            else:
                self.readout_off_reason = rd.off_reason
        if readout:  # `localspec -v` shows which lm_head computes the logits, and why
            if self.readout is not None:
                log.info("lm_head readout on (kernel %d, decodes of up to %d rows)", self.readout.kernel, self.readout.max_rows)
            else:
                log.info("lm_head readout off: %s", self.readout_off_reason)
        raise_if_interrupted()  # Ctrl-C while the context was made (swallowed in a llama.cpp callback)

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def handle(self):
        if self._ctx is None:
            raise DecodeError("context is closed")
        return self._ctx

    @property
    def mem(self):
        """The raw ``llama_memory_t`` of the KV cache.

        Raises:
            DecodeError: the context is closed (the pointer would dangle: a segfault).
        """
        if self._ctx is None:
            raise DecodeError("context is closed")
        return self._mem

    @property
    def closed(self) -> bool:
        """Whether ``close()`` freed the context (every call on it then raises ``DecodeError``)."""
        return self._ctx is None

    def close(self) -> None:
        if self._ctx is not None:
            lib.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass

    # -- compute ------------------------------------------------------------------------------

    def decode(self, batch: Batch) -> None:
        """Run ``llama_decode`` on ``batch``.

        Raises:
            ContextOverflowError: no KV slot (the context is full).
            DecodeError: aborted (see ``request_abort``), invalid batch or fatal error. After
                an abort or fatal error some micro-batches may remain in the cache: callers
                roll back to their own committed length (the engine does).
            WorkerLostError: (a DecodeError) an RPC worker holding layers of the model was
                lost; the model must be loaded again (``Model.reload_if_lost``).
        """
        n_out = int(batch.output[: batch.n_tokens].sum())
        self.n_calls += 1
        self._readout_logits = None
        rd = self.readout
        use = rd is not None and rd.begin(n_out)
        try:
            rc = lib.llama_decode(self.handle, batch.struct)
            self._check_workers()
        except BaseException:
            if use:
                rd.cancel()
            raise
        if use:
            if rc != 0:
                rd.cancel()
            else:
                try:
                    nt = self.n_threads_batch if batch.n_tokens > 1 else self.n_threads
                    self._readout_logits = rd.finish(n_out, nt)
                except RuntimeError as e:
                    self.readout, self.readout_off_reason = None, rd.off_reason
                    self.n_outputs = 0
                    raise DecodeError(str(e)) from e
        if rc != 0:
            self.n_outputs = 0
            if rc == 1:
                raise ContextOverflowError(
                    f"no KV slot for {batch.n_tokens} tokens (n_ctx={self.n_ctx}); "
                    "use a larger --n-ctx or a shorter prompt"
                )
            if rc == 2:
                self._abort.clear()
                raise DecodeError("decode aborted")
            why = "; ".join(recent_errors()) or f"llama_decode returned {rc}"
            raise DecodeError(f"decode failed: {why}")
        self.n_outputs = n_out
        self.n_tokens_last = batch.n_tokens
        if self.after_decode is not None:
            self.after_decode(self)
        raise_if_interrupted()  # Ctrl-C during the decode (swallowed in its abort callback)

    def process(self, batch, *, encode: bool = False) -> None:
        """Run an ``ExtBatch`` through ``llama_process`` (the encoder graph when ``encode``).

        Raises as ``decode``. After a decode, ``logits()`` has one row per output entry; an
        encode produces no logits (read its output embeddings instead).
        """
        kind = lib.LLAMA_PROCESS_TYPE_ENCODE if encode else lib.LLAMA_PROCESS_TYPE_DECODE
        self.n_calls += 1
        self._readout_logits = None  # the readout serves llama_decode only (its graph runs whole here)
        rc = lib.llama_process(self.handle, kind, batch.handle)
        self._check_workers()
        if rc != 0:
            self.n_outputs = 0
            if rc == 1:
                raise ContextOverflowError(f"no KV slot for {batch.n_tokens} entries (n_ctx={self.n_ctx})")
            if rc == 2:
                self._abort.clear()
                raise DecodeError("process aborted")
            why = "; ".join(recent_errors()) or f"llama_process returned {rc}"
            raise DecodeError(f"{'encode' if encode else 'decode'} failed: {why}")
        self.n_outputs = 0 if encode else batch.n_outputs

    def _check_workers(self) -> None:
        """An RPC worker of the model lost during the decode: its outputs are not the model's
        (the guard answered in the worker's place), so raise ``WorkerLostError`` instead."""
        if self._rpc_guards:
            from .rpc import check_guards

            try:
                check_guards(self._rpc_guards)
            except BaseException:
                self.n_outputs = 0
                raise

    def logits(self) -> np.ndarray:
        """Logits of the last decode: ``[n_outputs, n_vocab] float32``, a view (no copy).

        Rows follow the batch order of the tokens that asked for output (the readout runs
        only where llama.cpp computes them in that order: ``readout.unavailable``). The view
        is only valid until the next ``decode``.
        """
        if self.n_outputs == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        if self._readout_logits is not None:
            return self._readout_logits
        ptr = lib.llama_get_logits(self.handle)
        key = (ctypes.cast(ptr, ctypes.c_void_p).value, self.n_outputs)
        view = getattr(self, "_logits_view", None)
        if view is None or view[0] != key:  # llama.cpp reuses its output buffer: so does the view
            view = self._logits_view = (key, np.ctypeslib.as_array(ptr, shape=(self.n_outputs, self.n_vocab)))
        return view[1]

    def embeddings_ith(self, i: int, n_embd: int) -> np.ndarray:
        """Embedding row of output ``i`` of the last decode: ``[n_embd] float32`` view."""
        ptr = lib.llama_get_embeddings_ith(self.handle, i)
        if not ptr:
            raise DecodeError(f"no embeddings for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(n_embd,))

    @contextlib.contextmanager
    def abortable(self):
        """Within this block ``request_abort()`` stops a running ``decode`` early."""
        lib.llama_set_abort_callback(self.handle, self._abort_cb, None)
        try:
            yield
        finally:
            lib.llama_set_abort_callback(self.handle, lib.ggml_abort_callback(0), None)

    def request_abort(self) -> None:
        """Make a running abortable ``decode`` (see ``abortable``) stop early and raise
        ``DecodeError``; other decodes finish and the caller checks its own flag."""
        self._abort.set()

    def clear_abort(self) -> None:
        self._abort.clear()

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        self.n_threads = int(n_threads)
        self.n_threads_batch = int(n_threads_batch or n_threads)
        lib.llama_set_n_threads(self.handle, self.n_threads, self.n_threads_batch)

    # -- KV memory ----------------------------------------------------------------------------
    # Return values of these llama.cpp calls prove nothing (seq_rm returns true even when a
    # window cache has dropped cells): callers check pos_min / pos_max afterwards.

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove cells of ``seq_id`` (``-1`` = all sequences) with ``p0 <= pos < p1``."""
        return bool(lib.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Add ``dst`` to every cell of ``src`` with ``p0 <= pos < p1`` (no data copy)."""
        lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """Drop every cell not in ``seq_id`` and every other sequence id from the rest."""
        lib.llama_memory_seq_keep(self.mem, seq_id)

    def pos_min(self, seq_id: int) -> int:
        """Smallest position held for ``seq_id`` (-1 when it holds none)."""
        return int(lib.llama_memory_seq_pos_min(self.mem, seq_id))

    def pos_max(self, seq_id: int) -> int:
        """Largest position held for ``seq_id`` (-1 when it holds none)."""
        return int(lib.llama_memory_seq_pos_max(self.mem, seq_id))

    def expect_positions(self, seq_id: int, n: int, what: str, *, lo: int = 0) -> None:
        """The one KV range check: raise ``KVCacheError`` unless ``seq_id`` holds exactly the
        positions ``[lo, lo + n)`` (nothing when ``n == 0``); ``what`` names the sequence in
        the message. llama.cpp's own return values are not trusted (``seq_rm`` returns true
        even when a window-sized SWA cache has already dropped the cells a rollback needs)."""
        got = (self.pos_min(seq_id), self.pos_max(seq_id))
        want = (lo, lo + n - 1) if n else (-1, -1)
        if got != want:
            from ..errors import KVCacheError

            raise KVCacheError(
                f"{what}: KV positions [{got[0]}, {got[1]}] held, expected [{want[0]}, {want[1]}]; "
                "a rollback lost cells (is the context created with swa_full=True?)"
            )

    def clear(self) -> None:
        """Empty the whole KV cache."""
        lib.llama_memory_clear(self.mem, True)

    def seq_state(self, seq_id: int) -> bytes:
        """The KV cells of ``seq_id`` (positions, K and V rows of every layer) as
        ``llama_state_seq_get_data`` writes them: ``b""`` when it holds none.

        With ``seq_state_set`` this moves a sequence's cells without recomputing them (the K
        and V bytes are copied, so a restored sequence attends exactly as before).

        Raises:
            KVCacheError: llama.cpp wrote fewer bytes than it asked for.
        """
        if self.pos_max(seq_id) < 0:
            return b""
        n = int(lib.llama_state_seq_get_size(self.handle, seq_id))
        buf = (ctypes.c_uint8 * n)()
        got = int(lib.llama_state_seq_get_data(self.handle, buf, n, seq_id))
        if got != n:
            raise KVCacheError(f"saving sequence {seq_id} wrote {got} of {n} bytes")
        return bytes(buf)

    def seq_state_set(self, data: bytes, seq_id: int) -> None:
        """Put cells saved by ``seq_state`` into ``seq_id`` (its old cells are dropped first).
        llama.cpp places them in the first free cells from its search head, in the saved (cell)
        order: after a ``clear()`` and other restores, that is after every used cell.

        Raises:
            KVCacheError: llama.cpp could not place them (no free cells, or a state of another
                model / cache type).
        """
        if not data:
            self.seq_rm(seq_id, -1, -1)
            return
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(lib.llama_state_seq_set_data(self.handle, buf, len(data), seq_id)) == 0:
            why = "; ".join(recent_errors()) or "no reason logged"
            raise KVCacheError(f"restoring sequence {seq_id} failed: {why}")

    def save_cells(self, seq_id: int, p0: int, p1: int, *, scratch: int) -> list[bytes]:
        """The cells of ``seq_id`` at positions ``p0 <= pos < p1``, saved in pieces (see
        ``restore_cells``); ``scratch`` is a sequence id that holds nothing (left empty).

        llama.cpp saves a sequence's sliding-window cache only within the window below the
        sequence's last position (``is_masked_swa``), which would lose older cells that a
        prefix shared later still needs. So each piece covers positions of one window-aligned
        block of ``model.n_swa`` positions (the whole range when the model has no window),
        copied into ``scratch`` first: every cell of the piece is inside its own window.
        """
        w = int(self.model.n_swa) or max(1, p1 - p0)
        out = []
        a = p0
        while a < p1:
            b = min(p1, (a // w + 1) * w)
            self.seq_cp(seq_id, scratch, a, b)
            try:
                out.append(self.seq_state(scratch))
            finally:
                self.seq_rm(scratch, -1, -1)
            a = b
        return out

    def restore_cells(self, pieces: list[bytes], seq_id: int, *, scratch: int) -> None:
        """Add cells saved by ``save_cells`` to ``seq_id``, in order, through ``scratch``
        (left empty). Each piece goes to the first free cells from llama.cpp's search head:
        when no cell was freed since the last ``clear()``, after every used cell, so the
        sequence's cells stay in position order.

        Raises:
            KVCacheError: a piece could not be placed.
        """
        for piece in pieces:
            self.seq_state_set(piece, scratch)
            self.seq_cp(scratch, seq_id, -1, -1)
            self.seq_rm(scratch, -1, -1)

    def synchronize(self) -> None:
        lib.llama_synchronize(self.handle)


__all__ = ["Context", "default_threads"]
