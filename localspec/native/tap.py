"""``NativeTap``: llama.cpp's ``cb_eval`` in C (``native/ls_tap.c``), for
``backend.features.FeatureTap`` and ``FinalNormTap``.

The scheduler calls an eval callback twice per graph node (ask, then observe for the nodes
answered yes): from Python that is a ctypes transition per call, ~760 a decode of the default
model (~0.6 ms, measured by the taps' ``t_callback_us``). The C callback compares the node's
name with the tap's and copies the named float32 tensors' rows into buffers it owns; Python
reads them after the decode (``take``). Same rows, same order, as the Python callback.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from . import _lib, lib


class NativeTap:
    """Rows of the float32 graph tensors ``names`` (each ``[rows, width]``), captured in C.

    Args:
        names: graph tensor names (at most 8, each shorter than 64 bytes).
        width: floats per row (the tensors' ``ne[0]``).
        tensor_type: the ``ctypes.Structure`` of ``struct ggml_tensor`` (field offsets).
        tensor_get: address of ``ggml_backend_tensor_get``.
        callback_type: the ``ggml_backend_sched_eval_callback`` ctypes prototype.
    Raises:
        ValueError: bad names or width (``ls_tap_new`` refused them).
    """

    def __init__(self, names: Sequence[str], width: int, *, tensor_type, tensor_get: int, callback_type) -> None:
        enc = [n.encode() for n in names]
        arr = (ctypes.c_char_p * len(enc))(*enc)
        self.width = int(width)
        self.n = len(enc)
        self._ptr = lib.ls_tap_new(self.n, ctypes.addressof(arr), self.width, tensor_type.type.offset,
                                   tensor_type.ne.offset, tensor_type.name.offset, tensor_get)  # fmt: skip
        if not self._ptr:
            raise ValueError(f"the native tap refused names {list(names)} / width {width}")
        self.callback = callback_type(ctypes.cast(lib.ls_tap_eval, ctypes.c_void_p).value)
        self.user_data = ctypes.c_void_p(self._ptr)
        # whoever keeps the callback or the user data (a Context) keeps the buffers alive
        self.callback._tap = self
        self.user_data._tap = self

    def rows(self, i: int) -> np.ndarray:
        """A copy of name ``i``'s rows since the last ``clear``: ``[n, width]`` float32.

        Raises:
            TypeError: a tensor of that name was not float32 of ``width`` (or memory ran out).
        """
        err = lib.ls_tap_error(self._ptr)
        if err:
            what = "not an F32 tensor of width %d" % self.width if err == _lib.ERR_ARG else "out of memory"
            raise TypeError(f"native tap: a captured tensor was {what}")
        n = int(lib.ls_tap_rows(self._ptr, i))
        if n <= 0:
            return np.zeros((0, self.width), dtype=np.float32)
        ptr = lib.ls_tap_data(self._ptr, i)
        buf = (ctypes.c_float * (n * self.width)).from_address(ptr)
        return np.frombuffer(buf, dtype=np.float32).reshape(n, self.width).copy()

    def n_rows(self, i: int) -> int:
        return int(lib.ls_tap_rows(self._ptr, i))

    def clear(self) -> None:
        lib.ls_tap_clear(self._ptr)

    def set_paused(self, paused: bool) -> None:
        """While paused the callback observes no node: nothing is copied, and ggml's scheduler
        computes the graph without splitting it at the named tensors."""
        lib.ls_tap_set_paused(self._ptr, int(bool(paused)))

    def set_stop(self, i: int) -> None:
        """Name ``i`` (-1: none) is the stop node: while ``set_stopping(True)``, the callback
        copies its rows and then answers false, so ggml skips the rest of the graph split (the
        lm_head after ``result_norm``: ``backend.readout``); while not stopping, it does not
        observe that name at all."""
        lib.ls_tap_set_stop(self._ptr, int(i))

    def set_stopping(self, mode: int) -> None:
        """0: the stop node is not observed; 1: its rows are copied; 2: copied, then the rest
        of the graph split is skipped."""
        lib.ls_tap_set_stopping(self._ptr, int(mode))

    def watch(self, name: str, off_src: int) -> None:
        """Record ``src[0]`` and ``src[1]`` of graph node ``name`` whenever it is asked about
        (``off_src``: byte offset of ``src`` in ``struct ggml_tensor``); see ``watched``."""
        if lib.ls_tap_watch(self._ptr, name.encode(), int(off_src)) != 0:
            raise ValueError(f"cannot watch {name!r}")

    def watched(self, j: int) -> int | None:
        """Address of the watched node's ``src[j]`` (j = 0, 1) as last seen, or None."""
        return lib.ls_tap_watched_src(self._ptr, int(j)) or None

    def set_next(self, callback, user_data) -> None:
        """Chain ``callback`` (a ``ggml_backend_sched_eval_callback``, with its ``user_data``;
        None: none): asked about every node as well, it observes exactly the nodes it asked to
        observe (before this tap copies them), as if it were the context's only callback. The
        references are kept for the tap's lifetime."""
        self._next = (callback, user_data)
        fn = ctypes.cast(callback, ctypes.c_void_p).value if callback is not None else None
        ud = user_data.value if isinstance(user_data, ctypes.c_void_p) else user_data
        lib.ls_tap_set_next(self._ptr, fn, ud)

    @property
    def n_asked(self) -> int:
        """Graph nodes the callback was asked about since the tap was made (test hook, with
        ``n_copied``: tests/test_eagle3.py checks that the C callback copies only the named
        tensors)."""
        return int(lib.ls_tap_n_asked(self._ptr))

    @property
    def n_copied(self) -> int:
        """Tensors the callback copied since the tap was made (test hook, see ``n_asked``)."""
        return int(lib.ls_tap_n_copied(self._ptr))

    def close(self) -> None:
        if self._ptr:
            lib.ls_tap_free(self._ptr)
            self._ptr = None

    def __del__(self) -> None:
        self.close()
