"""llama.cpp's ``infill`` sampler as a per-position candidate filter.

Editor plugins (llama.vim, llama.vscode) ask for the sampler chain ``top_k -> top_p ->
infill``. The infill sampler depends on nothing but the candidate set of the position it is
applied to: when end-of-generation tokens hold enough of the probability it keeps only
them; otherwise it merges candidates whose text is a prefix of another's and drops the ones
left below probability 0.2 (``llama_sampler_infill_apply`` in llama.cpp's
``src/llama-sampler.cpp``). llama.cpp's final ``dist`` sampler then draws from the softmax of
the survivors' logits. Because it is stateless, it can run at every verified position of a
token tree exactly as in plain decoding: wrapped as a ``sampling.CandidateFilter`` it keeps
speculation lossless. We call llama.cpp's own implementation on the candidates.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .backend._llama import lib
from .errors import InvalidRequestError
from .grammar import _TokenDataBuffer

# The merge step compares every pair of candidates (quadratic): beyond this many candidates
# (no top-k) it would take seconds per token, as it would in llama.cpp.
MAX_INFILL_CANDIDATES = 1024


class InfillFilter:
    """llama.cpp's ``infill`` sampler over a position's candidates (``CandidateFilter``).

    Args:
        model: the target ``backend.Model`` (its vocabulary: token texts, end-of-generation ids).

    Owns one ``llama_sampler``; ``close()`` frees it. Not thread-safe: use one per request.
    """

    name = "infill"

    def __init__(self, model) -> None:
        self._smpl = None
        self.model = model
        self._smpl = lib.llama_sampler_init_infill(model.vocab)
        if not self._smpl:
            raise InvalidRequestError("llama.cpp could not create the infill sampler")
        self._buf = _TokenDataBuffer()

    def __call__(self, ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Filter candidates.

        Args:
            ids: [m] int token ids of the candidates.
            logits: [m] float32 their logits (before temperature).
        Returns:
            ``(ids [k] int64, logits [k] float32)``: the candidates llama.cpp's ``dist`` sampler
            would draw from after ``infill`` (possibly a single end-of-text token).
        Raises:
            InvalidRequestError: more than ``MAX_INFILL_CANDIDATES`` candidates (use top_k).
        """
        if self._smpl is None:
            raise InvalidRequestError("the infill sampler is closed")
        if ids.size > MAX_INFILL_CANDIDATES:
            raise InvalidRequestError(
                f"the infill sampler needs at most {MAX_INFILL_CANDIDATES} candidates, got {ids.size}; "
                "set top_k (editor plugins send top_k 40)"
            )
        self._buf.fill(np.ascontiguousarray(ids, dtype=np.int32), np.asarray(logits, dtype=np.float32))
        lib.llama_sampler_apply(self._smpl, ctypes.byref(self._buf.c_array))
        out = self._buf.arr[: int(self._buf.c_array.size)]
        return out["id"].astype(np.int64), out["logit"].astype(np.float32)

    def close(self) -> None:
        if self._smpl is not None:
            lib.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
