"""``Batch``: a ``llama_batch`` whose arrays are owned numpy buffers.

``llama_batch_init`` mallocs one seq-id array per token, which forces a Python loop to fill;
here every field is a numpy array (the seq ids one ``[capacity, n_seq_max]`` block) and the
``llama_batch`` struct just points into them, so a whole token tree is written with a few
vectorised assignments. The buffers live as long as the ``Batch``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ._llama import lib


class Batch:
    """A reusable decode batch of up to ``capacity`` tokens, each in up to ``n_seq_max`` sequences.

    Fields (numpy views, first ``n_tokens`` rows are used):
        token:    [capacity] int32
        pos:      [capacity] int32
        n_seq_id: [capacity] int32
        seq_id:   [capacity, n_seq_max] int32
        output:   [capacity] int8   (1 = return logits for this token)
    """

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        if capacity < 1 or n_seq_max < 1:
            raise ValueError("capacity and n_seq_max must be >= 1")
        self.capacity = int(capacity)
        self.n_seq_max = int(n_seq_max)
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq_id = np.zeros((capacity, n_seq_max), dtype=np.int32)
        self.output = np.zeros(capacity, dtype=np.int8)
        row_bytes = self.seq_id.strides[0]
        base = self.seq_id.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + i * row_bytes, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self.n_tokens = 0
        self._struct = lib.llama_batch()
        self._struct.token = self.token.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        self._struct.embd = ctypes.cast(None, ctypes.POINTER(ctypes.c_float))
        self._struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        self._struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self._struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id)))
        self._struct.logits = self.output.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    @property
    def struct(self):
        """The ``llama_batch`` value to pass to ``llama_decode`` (shares these buffers)."""
        self._struct.n_tokens = self.n_tokens
        return self._struct

    def set_sequence(self, tokens, pos0: int, *, seq_id: int = 0, output: str = "last") -> None:
        """Fill with one run of tokens at positions ``pos0, pos0+1, ...`` in ``seq_id``.

        Args:
            tokens: [n] token ids.
            output: ``"last"`` (logits of the last token only), ``"all"`` or ``"none"``.
        """
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"{n} tokens exceed the batch capacity {self.capacity}")
        self.token[:n] = tokens
        self.pos[:n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.n_seq_id[:n] = 1
        self.seq_id[:n, 0] = seq_id
        self.output[:n] = 1 if output == "all" else 0
        if output == "last" and n:
            self.output[n - 1] = 1
        self.n_tokens = n

    def set_tree(
        self, tokens: np.ndarray, pos: np.ndarray, seq_sets: np.ndarray, n_seq: np.ndarray, output=None
    ) -> None:
        """Fill with tokens laid out as sequences (e.g. a token tree).

        Args:
            tokens:   [n] int32 node tokens.
            pos:      [n] int32 positions (``n_past + depth``).
            seq_sets: [n, k] int32 sequence ids of each node (first ``n_seq[i]`` are used).
            n_seq:    [n] int32 number of sequence ids of each node.
            output:   [n] int8 1 = return logits (default: every token).

        Raises:
            ValueError: more tokens than the capacity, more sequence ids per token than
                ``n_seq_max``, or a token in no sequence or in more than ``k`` (llama.cpp
                reads such a batch out of bounds: a segfault, not an error).
        """
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"{n} tokens exceed the batch capacity {self.capacity}")
        k = seq_sets.shape[1]
        if k > self.n_seq_max:
            raise ValueError(f"{k} sequences per token exceed n_seq_max {self.n_seq_max}")
        if n and not (1 <= int(np.min(n_seq)) and int(np.max(n_seq)) <= k):
            raise ValueError(f"every token needs 1..{k} sequence ids (n_seq), got {int(np.min(n_seq))}..{int(np.max(n_seq))}")
        self.token[:n] = tokens
        self.pos[:n] = pos
        self.n_seq_id[:n] = n_seq
        self.seq_id[:n, :k] = seq_sets
        self.output[:n] = 1 if output is None else output
        self.n_tokens = n
