"""GBNF grammar constraints through llama.cpp's grammar sampler.

``GrammarState`` wraps one ``llama_sampler`` of type grammar. We never let llama.cpp *sample*
with it: we only ask which candidate tokens it allows (``allowed``) and advance it with tokens
it allowed (``accept``). Accepting a token the grammar forbids aborts the process inside
llama.cpp, so ``accept`` re-checks first and raises ``GrammarError`` instead.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

from .backend._llama import captured_stderr, held_errors, lib, recent_errors
from .errors import GrammarError


class _TokenDataBuffer:
    """A reusable ``llama_token_data`` array viewed as a numpy structured array."""

    dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

    def __init__(self) -> None:
        self.arr = np.zeros(0, dtype=self.dtype)
        self.c_array = lib.llama_token_data_array()

    def fill(self, ids: np.ndarray, logits: np.ndarray | None = None) -> np.ndarray:
        """Point the C array at ``ids`` ([n] int) with ``logits`` ([n] float32, default 0)."""
        n = int(ids.size)
        if self.arr.size < n:
            self.arr = np.zeros(max(n, 2 * self.arr.size), dtype=self.dtype)
        view = self.arr[:n]
        view["id"] = ids
        view["logit"] = 0.0 if logits is None else logits
        view["p"] = 0.0
        self.c_array.data = view.ctypes.data_as(lib.llama_token_data_p)
        self.c_array.size = n
        self.c_array.selected = -1
        self.c_array.sorted = False
        return view


class _ParseFailed(Exception):
    pass


def parse_error(printed: list[str]) -> str:
    """The reason llama.cpp's grammar parser gave (``captured_stderr``'s text: "parse: error
    parsing grammar: REASON" then the grammar), cut to one line of at most 120 characters;
    else the error lines it logged (an undefined rule, a missing root)."""
    text = printed[0] if printed else ""
    _, found, rest = text.partition("error parsing grammar: ")
    if found:
        reason = rest.split("\n\n", 1)[0].strip().replace("\n", "\\n")
        return reason if len(reason) <= 120 else reason[:117] + "..."
    return "; ".join(recent_errors()) or "parse error"


class GrammarState:
    """The state of a GBNF grammar after the tokens accepted so far.

    Args:
        model: a ``localspec.backend.Model`` (for its vocabulary).
        text: the grammar in GBNF.
        root: the start rule.

    Raises:
        GrammarError: the grammar does not parse.
    """

    def __init__(self, model, text: str, root: str = "root", *, _handle=None) -> None:
        self._smpl = None
        self.model = model
        self.text = text
        self.root = root
        if _handle is None:
            recent_errors(clear=True)
            try:
                with held_errors(), captured_stderr() as printed:  # into the error, not onto the terminal
                    _handle = lib.llama_sampler_init_grammar(model.vocab, text.encode("utf-8"), root.encode("utf-8"))
                    if not _handle:
                        raise _ParseFailed  # (held_errors drops the lines logged when its block raises)
            except _ParseFailed:
                raise GrammarError(f"the GBNF grammar does not parse: {parse_error(printed)}") from None
            if printed and printed[0].strip():  # not the parser's: another thread wrote it meanwhile
                sys.stderr.write(printed[0])
        self._smpl = _handle
        self._buf = _TokenDataBuffer()

    def clone(self) -> "GrammarState":
        """An independent copy of this state."""
        return GrammarState(self.model, self.text, self.root, _handle=lib.llama_sampler_clone(self._smpl))

    def allowed(self, token_ids: np.ndarray) -> np.ndarray:
        """[n] bool: which of ``token_ids`` ([n] int32) may come next."""
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        if ids.size == 0:
            return np.zeros(0, dtype=bool)
        view = self._buf.fill(ids)
        lib.llama_sampler_apply(self._smpl, ctypes.byref(self._buf.c_array))
        return np.isfinite(view["logit"])

    def allows(self, token: int) -> bool:
        return bool(self.allowed(np.array([token], dtype=np.int32))[0])

    def accept(self, token: int) -> None:
        """Advance past ``token``. End-of-generation tokens end the grammar and are not fed in.

        Raises:
            GrammarError: the grammar does not allow ``token`` here.
        """
        if self.model.is_eog(token):
            return
        if not self.allows(token):
            raise GrammarError(f"token {token} ({self.model.token_bytes(token)!r}) is not allowed by the grammar here")
        lib.llama_sampler_accept(self._smpl, int(token))

    def close(self) -> None:
        if self._smpl is not None:
            lib.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
