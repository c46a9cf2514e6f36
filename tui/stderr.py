"""Keep native output off the chat screen.

Textual draws on the terminal through ``sys.__stderr__`` (file descriptor 2). llama.cpp
writes some messages straight to descriptor 2 with ``fprintf`` (e.g. why a GBNF grammar does
not parse), which would land in the middle of the drawing. ``NativeStderr`` gives Textual its
own duplicate of the terminal descriptor and points descriptor 2 at a temporary file while
the app runs; ``take()`` returns what was written there since the last call, so the app can
show it as part of an error message.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading


class NativeStderr:
    """Context manager: while active, descriptor 2 writes to a temporary file and
    ``sys.__stderr__`` / ``sys.stderr`` write to the terminal."""

    def __init__(self) -> None:
        self._file = None
        self._term = None
        self._saved_fd = -1
        self._saved = None
        self._pos = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "NativeStderr":
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="a+b")  # O_APPEND: writes go to the end
        self._saved_fd = os.dup(2)
        self._term = os.fdopen(os.dup(2), "w", encoding="utf-8", errors="replace")
        self._saved = (sys.__stderr__, sys.stderr)
        os.dup2(self._file.fileno(), 2)
        sys.__stderr__ = sys.stderr = self._term
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._term.flush()
        finally:
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            sys.__stderr__, sys.stderr = self._saved
            self._term.close()
            self._file.close()

    def take(self) -> str:
        """Text written to descriptor 2 since the last call ("" when inactive)."""
        if self._file is None or self._file.closed:
            return ""
        with self._lock:
            self._file.seek(self._pos)
            data = self._file.read()
            self._pos += len(data)
        return data.decode("utf-8", errors="replace")
