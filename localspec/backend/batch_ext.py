"""``ExtBatch``: an owned ``llama_batch_ext`` (llama.cpp's extended batch API).

The extended batch carries, per entry, a token id and/or an embedding row, so a model can
take both at once: an EAGLE-3 head's decoder reads the next token *and* a hidden-state row
per position, and its encoder reads rows of target features. llama.cpp copies the rows into
the batch when they are added, so the caller's arrays need not outlive the call. Run it with
``Context.process(batch, encode=...)``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ._llama import lib


class ExtBatch:
    """A reusable extended batch for one context (its ``n_batch`` entries at most).

    Args:
        ctx_handle: the ``llama_context *`` the batch is built for (entry limits, widths).
    """

    def __init__(self, ctx_handle) -> None:
        self._b = lib.llama_batch_ext_init(ctx_handle)
        if not self._b:
            raise MemoryError("llama_batch_ext_init failed")
        self.n_tokens = 0
        self.n_outputs = 0

    @property
    def handle(self):
        return self._b

    def clear(self) -> None:
        lib.llama_batch_ext_clear(self._b)
        self.n_tokens = 0
        self.n_outputs = 0

    def add(self, *, token: int | None, pos: int, seq_id: int, output: bool, embd: np.ndarray | None = None) -> int:
        """Append one entry; returns its index.

        Args:
            token: the token id, or None for an embedding-only entry (encoder input).
            pos: its position.
            seq_id: its sequence.
            output: return logits (and output embeddings) for it.
            embd: [width] float32 row (decoder state or encoder input), or None.
        Raises:
            ValueError: llama.cpp refused the entry (batch full, bad id / width / sequence).
        """
        if token is None:
            idx = lib.llama_batch_ext_add_embd(self._b, seq_id, _embd(embd))
        else:
            idx = lib.llama_batch_ext_add_token(self._b, seq_id, int(token))
            if idx >= 0 and embd is not None and not lib.llama_batch_ext_set_embd_token(self._b, idx, _embd(embd)):
                raise ValueError(f"llama.cpp refused an embedding row of width {embd.shape[-1]}")
        if idx < 0:
            why = {-1: "the batch is full", -2: "invalid token or embedding", -3: "invalid sequence id"}.get(idx, str(idx))
            raise ValueError(f"cannot add a batch entry: {why}")
        p = lib.llama_pos(int(pos))
        lib.llama_batch_ext_set_pos(self._b, idx, ctypes.byref(p))
        lib.llama_batch_ext_set_output_logits(self._b, idx, bool(output))
        self.n_tokens += 1
        self.n_outputs += int(bool(output))
        return idx

    def close(self) -> None:
        if self._b:
            lib.llama_batch_ext_free(self._b)
            self._b = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def _embd(row: np.ndarray):
    row = np.ascontiguousarray(row, dtype=np.float32)
    e = lib.llama_embd()
    e.data = row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    e.n_rows = 1
    e.n_embd = row.shape[-1]
    e._keep = row  # alive until llama.cpp has copied it (during the call)
    return e
