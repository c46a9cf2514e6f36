"""``FeatureTap``: the inputs of chosen target layers, captured during decodes (``cb_eval``).

EAGLE-3 heads read the target's hidden states at three layers. llama.cpp's built-in
extraction (``llama_set_embeddings_layer_inp``) exists only for some architectures and
aborts the process on others (Gemma 3), and ``embeddings = true`` would make every prompt
token an output (an lm_head row each). So the tap reads the named per-layer graph tensors
through the scheduler's eval callback instead, for every architecture:

* layer id ``k`` (as in ``eagle3.target_layers``) means the **input** of layer ``k``, i.e.
  the output of layer ``k - 1``: the graph tensor ``l_out-{k-1}``, one row of ``n_embd``
  floats per batch token, in batch order (unified KV caches split batches in order);
* ``1 <= k < n_layer``: llama.cpp keeps only the output rows in the last layer, so its
  output (``k == n_layer``) is not available for every token and is refused.

The callback only reads (``ggml_backend_tensor_get``, which also works for GPU buffers), so
the decode computes exactly the same numbers as without it. The scheduler calls it once per
graph node (and again for each node it observes): from Python that costs ~0.6 ms per decode
of the default model (``t_callback_us`` measures it), so when the C kernels are built the taps
use a C callback (``native.tap.NativeTap``, ``native/ls_tap.c``) that captures the same rows;
the Python callback is the reference (``native=False``).

Usage::

    tap = FeatureTap([2, 9, 15], n_layer=18, n_embd=640)
    ctx = Context(model, ..., cb_eval=tap.callback, cb_eval_user_data=tap.user_data)
    ctx.decode(batch)
    rows = tap.take()   # [n_tokens, 3 * 640] float32, layer blocks in the order given
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import numpy as np

from .. import native as _native
from ._llama import ggml_tensor_get, lib
from .tensor import GGML_TYPE_F32, GgmlTensor

_NAME_OFFSET = GgmlTensor.name.offset


def _native_tap(names, width: int, use: bool | None):
    """A ``NativeTap`` of ``names`` when ``use`` (default: the C kernels are enabled), else None."""
    if use is None:
        use = _native.enabled()
    if not use:
        return None
    if not _native.AVAILABLE:
        raise RuntimeError(f"the native tap needs the C kernels: {_native.LOAD_ERROR}")
    from ..native.tap import NativeTap

    return NativeTap(names, width, tensor_type=GgmlTensor, tensor_get=ctypes.cast(ggml_tensor_get, ctypes.c_void_p).value,
                     callback_type=lib.ggml_backend_sched_eval_callback)  # fmt: skip


class _TapCallback:
    """The eval callback of a tap: the C one of a ``NativeTap`` of ``names`` (``_c``), or the
    tap's own Python ``_on_eval`` (``_c`` None); ``callback`` and ``user_data`` go to the
    context's ``cb_eval`` / ``cb_eval_user_data``."""

    def __init__(self, names, width: int, native: bool | None) -> None:
        self._c = _native_tap(names, width, native)
        self._paused = False
        if self._c is not None:
            self.callback, self.user_data = self._c.callback, self._c.user_data
        else:
            self.callback, self.user_data = lib.ggml_backend_sched_eval_callback(self._on_eval), None

    @property
    def native(self) -> bool:
        """Whether the rows are captured in C."""
        return self._c is not None

    @property
    def paused(self) -> bool:
        """While True the tap observes nothing: the decodes capture no rows and ggml runs
        their graphs whole (``Step`` pauses it on steps whose rows no drafter will read)."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = bool(value)
        if self._c is not None:
            self._c.set_paused(self._paused)


def layer_tensor_name(layer_id: int) -> str:
    """Name of the graph tensor holding the input of layer ``layer_id``."""
    return f"l_out-{layer_id - 1}"


class FeatureTap(_TapCallback):
    """Captures, for every token a decode processes, the inputs of ``layers``.

    Args:
        layers: target layer ids (each ``1 <= k < n_layer``), in the order their blocks
            appear in a feature row.
        n_layer: the target's layer count.
        n_embd: the target's hidden size.
        native: capture in C (``NativeTap``; default: when the C kernels are enabled) or with
            the Python callback (the reference; ``t_callback_us`` is measured only there).
    Pass both ``callback`` and ``user_data`` to the context (``cb_eval``, ``cb_eval_user_data``).
    Raises:
        ValueError: a layer id outside ``1 .. n_layer - 1``.
    """

    def __init__(self, layers: Sequence[int], n_layer: int, n_embd: int, *, native: bool | None = None) -> None:
        layers = [int(k) for k in layers]
        for k in layers:
            if not 1 <= k < n_layer:
                raise ValueError(
                    f"target layer id {k} is not supported: the tap reads the input of layers 1..{n_layer - 1} "
                    f"(llama.cpp keeps only output rows after the last layer)"
                )
        self.layers = tuple(layers)
        self.n_embd = int(n_embd)
        self._index = {layer_tensor_name(k).encode(): i for i, k in enumerate(layers)}
        self._parts: list[list[np.ndarray]] = [[] for _ in layers]
        self.t_callback_us = 0.0  # time spent in the Python callback, all decodes
        self.n_decodes = 0
        _TapCallback.__init__(self, [layer_tensor_name(k) for k in layers], self.n_embd, native)

    @property
    def width(self) -> int:
        """Floats per feature row: ``len(layers) * n_embd``."""
        return len(self.layers) * self.n_embd

    def _on_eval(self, t_ptr: int, ask: bool, _user_data) -> bool:
        t0 = time.perf_counter()
        try:
            name = ctypes.string_at(t_ptr + _NAME_OFFSET)
            i = self._index.get(name)
            if ask:
                return i is not None and not self._paused
            if i is not None:
                t = GgmlTensor.from_address(t_ptr)
                if t.type != GGML_TYPE_F32 or int(t.ne[0]) != self.n_embd:
                    raise TypeError(f"{name!r} is not an F32 tensor of width {self.n_embd}")
                out = np.empty((int(t.ne[1]), self.n_embd), dtype=np.float32)
                ggml_tensor_get(t_ptr, out.ctypes.data, 0, out.nbytes)
                self._parts[i].append(out)
            return True
        except Exception:  # never raise into C: a False here would cancel the decode
            return not ask
        finally:
            self.t_callback_us += (time.perf_counter() - t0) * 1e6

    def take(self) -> np.ndarray:
        """Rows captured since the last ``take``: ``[n_tokens, width] float32``.

        Raises:
            RuntimeError: the layers captured different numbers of rows (a decode that did
                not reach every layer, e.g. aborted).
        """
        if self._c is not None:
            counts = {self._c.n_rows(i) for i in range(len(self.layers))}
        else:
            counts = {sum(p.shape[0] for p in parts) for parts in self._parts}
        if len(counts) != 1:
            self.clear()
            raise RuntimeError(f"feature layers captured different row counts {sorted(counts)}")
        n = counts.pop()
        if n == 0:
            self.clear()
            return np.zeros((0, self.width), dtype=np.float32)
        if self._c is not None:
            try:
                out = np.concatenate([self._c.rows(i) for i in range(len(self.layers))], axis=1)
            finally:
                self._c.clear()
        else:
            out = np.concatenate([np.concatenate(parts, axis=0) for parts in self._parts], axis=1)
        self.clear()
        self.n_decodes += 1
        return out

    def clear(self) -> None:
        self._parts = [[] for _ in self.layers]
        if self._c is not None:
            self._c.clear()


NEXTN_FEATURES = "nextn"
"""The feature "layer" of MTP drafters: ``target_feature_layers = (NEXTN_FEATURES,)`` asks the
engine for the target's **nextn hidden state** of every token (``NextnTap``) instead of layer
inputs (``FeatureTap``)."""


class NextnTap:
    """Captures the target's nextn hidden state (llama.cpp's ``h_nextn``: the row the model's
    MTP / NextN block reads) for every token each decode processes.

    llama.cpp's own extraction does the work: the target context is set to output nextn
    embeddings for every batch token (``llama_set_embeddings_nextn(ctx, true, masked=false)``;
    the architecture's graph then keeps all rows through its last layer) and, after every
    successful ``Context.decode`` (``Context.after_decode``), the ``[n_tokens, n_embd_out]``
    float32 rows of ``llama_get_embeddings_nextn`` (batch order) are copied here. No eval
    callback: ``callback`` is None. Same ``take`` / ``clear`` / ``layers`` interface as
    ``FeatureTap``, so the engine routes the rows to the drafter the same way.

    Which tensor ``h_nextn`` is depends on the architecture (e.g. GLM-4.5's ``glm4moe``: the
    last layer's output after ``output_norm``; see ``src/models/*.cpp`` of llama.cpp).

    Args:
        n_embd: the target's hidden size (``llama_model_n_embd_out``).
    """

    layers = (NEXTN_FEATURES,)
    callback = None
    user_data = None

    def __init__(self, n_embd: int) -> None:
        self.n_embd = int(n_embd)
        self._parts: list[np.ndarray] = []
        self.n_decodes = 0
        self.t_callback_us = 0.0
        self.ctx = None

    @property
    def width(self) -> int:
        return self.n_embd

    def bind(self, ctx) -> None:
        """Switch ``ctx`` (the target ``Context``) to output nextn rows and copy them after
        every decode."""
        from ._llama import ext

        ext.llama_set_embeddings_nextn(ctx.handle, True, False)
        ctx.after_decode = self._on_decode
        self.ctx = ctx

    def _on_decode(self, ctx) -> None:
        from ._llama import ext

        t0 = time.perf_counter()
        n = int(ctx.n_tokens_last)
        if n:
            ptr = ext.llama_get_embeddings_nextn(ctx.handle)
            if not ptr:
                raise RuntimeError("the target returned no nextn hidden states (is it an MTP model?)")
            self._parts.append(np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)).copy())
        self.t_callback_us += (time.perf_counter() - t0) * 1e6

    def take(self) -> np.ndarray:
        """Rows captured since the last ``take``: ``[n_tokens, n_embd] float32``."""
        out = np.concatenate(self._parts, axis=0) if self._parts else np.zeros((0, self.n_embd), dtype=np.float32)
        self._parts = []
        self.n_decodes += 1
        return out

    def clear(self) -> None:
        self._parts = []


FINAL_NORM_TENSOR = "result_norm"
"""The graph tensor holding the target's final hidden states: the output of its final norm,
the rows the lm_head multiplies (named so by every llama.cpp architecture's graph)."""


class FinalNormTap(_TapCallback):
    """Captures the target's final hidden states (``result_norm``) of a decode's output rows.

    llama.cpp computes ``result_norm`` only for the rows that produce logits (it selects the
    output rows before the last layer's feed-forward), so a decode with ``n_out`` outputs
    gives ``[n_out, n_embd]`` rows in output order: the rows of the logits it returns. This is
    what Medusa heads read (``drafters.medusa``): the hidden state the verification decode
    already computed for the logits, with no extra target call. Not ``embeddings = true``
    with pooling ``none``: that makes llama.cpp output *every* token of a batch
    (``output_all`` in ``llama_context::decode``), an lm_head row per prompt token.

    The callback only reads; the decode computes the same numbers as without it.

    Args:
        n_embd: the target's hidden size.
        native: capture in C (``NativeTap``; default: when the C kernels are enabled) or with
            the Python callback (the reference). Pass both ``callback`` and ``user_data`` to
            the context.
    """

    def __init__(self, n_embd: int, *, native: bool | None = None) -> None:
        self.n_embd = int(n_embd)
        self._name = FINAL_NORM_TENSOR.encode()
        self._parts: list[np.ndarray] = []
        self.t_callback_us = 0.0
        _TapCallback.__init__(self, [FINAL_NORM_TENSOR], self.n_embd, native)

    def _on_eval(self, t_ptr: int, ask: bool, _user_data) -> bool:
        t0 = time.perf_counter()
        try:
            hit = ctypes.string_at(t_ptr + _NAME_OFFSET) == self._name
            if ask:
                return hit
            if hit:
                t = GgmlTensor.from_address(t_ptr)
                if t.type != GGML_TYPE_F32 or int(t.ne[0]) != self.n_embd:
                    raise TypeError(f"{self._name!r} is not an F32 tensor of width {self.n_embd}")
                out = np.empty((int(t.ne[1]), self.n_embd), dtype=np.float32)
                ggml_tensor_get(t_ptr, out.ctypes.data, 0, out.nbytes)
                self._parts.append(out)
            return True
        except Exception:  # never raise into C: a False here would cancel the decode
            return not ask
        finally:
            self.t_callback_us += (time.perf_counter() - t0) * 1e6

    def take(self) -> np.ndarray:
        """Rows captured since the last ``take`` (all decodes): ``[n_out, n_embd] float32``."""
        if self._c is not None:
            try:
                return self._c.rows(0)
            finally:
                self._c.clear()
        out = np.concatenate(self._parts) if self._parts else np.zeros((0, self.n_embd), dtype=np.float32)
        self._parts = []
        return out

    def clear(self) -> None:
        self._parts = []
        if self._c is not None:
            self._c.clear()


def make_feature_tap(layers, model):
    """The tap for a drafter's ``target_feature_layers`` on the target ``model``: a
    ``NextnTap`` (rows of ``model.n_embd_out``) for ``(NEXTN_FEATURES,)``, else a
    ``FeatureTap`` on those layer ids."""
    if tuple(layers) == (NEXTN_FEATURES,):
        return NextnTap(model.n_embd_out)
    return FeatureTap(layers, model.n_layer, model.n_embd)
