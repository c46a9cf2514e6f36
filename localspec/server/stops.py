"""The editor's stopping rules, applied to the text as it streams.

Both follow llama.cpp's server (``process_token`` in ``tools/server/server-context.cpp``):

* ``n_indent``: once the completion has started a new line, a line whose first
  non-whitespace character comes at an indentation below ``n_indent`` ends it, and that line
  is cut before the character (the completion left the block the cursor is in).
* ``t_max_predict_ms``: once this much time has passed since the first generated token,
  the completion ends at the next token that contains a newline (the newline is kept), so
  the editor gets whole lines on time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopCheck:
    """The outcome of pushing one chunk of text.

    Attributes:
        keep: how many characters of the chunk belong to the completion.
        stop: the completion ends here.
        reason: ``"indent"`` or ``"time"`` when it ends, else None.
    """

    keep: int
    stop: bool = False
    reason: str | None = None


class EditorStops:
    """Applies ``n_indent`` and ``t_max_predict_ms`` to the generated text.

    Args:
        n_indent: minimum indentation of new lines (0 = off). As in llama.cpp, a blank line
            counts as indentation 0 (it ends the completion too).
        t_max_predict_ms: time limit after the first token (<= 0 = off).
    """

    def __init__(self, n_indent: int = 0, t_max_predict_ms: float = 0) -> None:
        self.n_indent = n_indent
        self.t_max_predict_ms = t_max_predict_ms
        self.text = ""
        self._line: int | None = None  # start of a line whose indentation is not known yet
        self._pos = 0  # where to look for the next newline

    def push(self, chunk: str, elapsed_ms: float) -> StopCheck:
        """Add ``chunk`` (the text of one token); ``elapsed_ms`` since the first generated token."""
        start = len(self.text)
        self.text += chunk
        if self.n_indent > 0:
            cut = self._indent_cut()
            if cut is not None:
                self.text = self.text[:cut]
                return StopCheck(cut - start, True, "indent")
        if "\n" in chunk and self.t_max_predict_ms > 0 and elapsed_ms > self.t_max_predict_ms:
            return StopCheck(len(chunk), True, "time")
        return StopCheck(len(chunk))

    def _indent_cut(self) -> int | None:
        """Index of the first character of a line (after the first) indented less than
        ``n_indent``, once its indentation is known; None otherwise."""
        t = self.text
        while True:
            if self._line is None:
                nl = t.find("\n", self._pos)
                if nl < 0:
                    self._pos = len(t)
                    return None
                self._line = nl + 1
            j = self._line
            while j < len(t) and t[j] in " \t":
                j += 1
            if j == len(t):
                return None  # only whitespace so far: wait for more text
            if j - self._line < self.n_indent:
                return j
            self._line, self._pos = None, j
