"""localspec's own C kernels (``native/``), loaded through ctypes.

The package build compiles ``native/*.c`` into a shared library next to this module
(``_lsnative`` with the interpreter's extension suffix; no Python API inside). When it is
there, the hot paths use it by default:

* ``LogitsProcessor.candidates / choose`` (sampling.py) and ``verify.verify`` for requests
  without a grammar: the truncation chain, seeded Gumbel-max and the tree walks;
* the n-gram drafter's index and trie of continuations (``NativeNgramIndex``).

The numpy / Python code stays the reference and the fallback: the tests compare the two on
the same inputs (same candidate sets, accepted paths and tokens; probabilities to 1e-6).

Switches:
    ``AVAILABLE`` / ``LOAD_ERROR``: whether the library loaded, and why not.
    ``LOCALSPEC_NATIVE=0`` in the environment, or ``use(False)``: force the reference.
    ``LOCALSPEC_NATIVE_THREADS`` / ``set_threads(n)``: threads for whole-row passes
    (default 1; results never depend on it). ``LOCALSPEC_NATIVE_LIB``: load this file instead.
"""

from __future__ import annotations

import contextlib
import os
import threading

from . import _lib

try:
    lib = _lib.load()
    AVAILABLE = True
    LOAD_ERROR: str | None = None
except (OSError, AttributeError) as e:  # not built, or built from other sources
    lib = None
    AVAILABLE = False
    LOAD_ERROR = str(e)

_switched_off = os.environ.get("LOCALSPEC_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _default_threads() -> int:
    """1 unless ``LOCALSPEC_NATIVE_THREADS`` says otherwise. A whole-row pass takes well
    under a millisecond on one core, and OpenMP barriers stall badly when other processes
    compete for the cores (measured on the 2-core development machine under load: 2
    threads made a top-p row 15x slower; idle, they made it 1.7x faster)."""
    env = os.environ.get("LOCALSPEC_NATIVE_THREADS")
    return max(1, int(env)) if env else 1


_threads = _default_threads()


def enabled() -> bool:
    """True when the kernels are loaded and not switched off: callers take the native path."""
    return AVAILABLE and not _switched_off


@contextlib.contextmanager
def use(flag: bool):
    """Temporarily force the native path on (if available) or off (the numpy reference).
    Objects that pick an implementation at construction (the n-gram index) follow the
    setting in force when they are created."""
    global _switched_off
    old = _switched_off
    _switched_off = not flag
    try:
        yield
    finally:
        _switched_off = old


def threads() -> int:
    return _threads


def set_threads(n: int) -> None:
    """Threads for whole-row passes (used where the library was built with OpenMP)."""
    global _threads
    _threads = max(1, int(n))


def has_openmp() -> bool:
    return bool(AVAILABLE and lib.ls_has_openmp())


def describe() -> dict:
    """What is loaded, for reports and ``localspec bench kernels``."""
    return {
        "available": AVAILABLE,
        "enabled": enabled(),
        "openmp": has_openmp(),
        "threads": _threads,
        "load_error": LOAD_ERROR,
    }


class Workspace:
    """Scratch memory of the C kernels for one vocabulary size (``ls_workspace``)."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = int(n_vocab)
        self.ptr = lib.ls_workspace_new(self.n_vocab, _threads)
        if not self.ptr:
            raise MemoryError(f"cannot allocate a native workspace for {n_vocab} tokens")
        self._threads = _threads

    def get(self) -> int:
        if self._threads != _threads:
            lib.ls_workspace_set_threads(self.ptr, _threads)
            self._threads = _threads
        return self.ptr

    def __del__(self) -> None:
        if getattr(self, "ptr", None) and lib is not None:
            lib.ls_workspace_free(self.ptr)
            self.ptr = None


_local = threading.local()


def workspace(n_vocab: int) -> int:
    """This thread's workspace for ``n_vocab`` (created once, reused by every request)."""
    cache = getattr(_local, "ws", None)
    if cache is None:
        cache = _local.ws = {}
    ws = cache.get(n_vocab)
    if ws is None:
        ws = cache[n_vocab] = Workspace(n_vocab)
    return ws.get()


__all__ = ["AVAILABLE", "LOAD_ERROR", "describe", "enabled", "has_openmp", "set_threads", "threads", "use", "workspace"]
