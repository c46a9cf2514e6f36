"""The one place that imports llama-cpp-python's raw bindings.

Initialises the llama.cpp backend once per process and routes llama.cpp's log through
Python's ``logging`` (logger ``localspec.llama``). By default only warnings and errors pass;
``LOCALSPEC_LLAMA_LOG=debug|info|warn|error|none`` changes that. The most recent error lines
are kept so that a failed model load can say *why* it failed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import sys
import threading

# ggml's tiled K-quant matmul (batches of >= 8 rows) rounds differently from the
# single-row kernel; "exact" kernels keep it off so that a verification batch computes every
# row bit for bit as a single-token decode would (docs/architecture.md, "Exact kernels").
# ggml reads this variable once, at the first matmul of the process.
if os.environ.get("LOCALSPEC_KERNELS", "exact") == "exact":
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")

import llama_cpp as _lib  # noqa: E402 - raw ctypes bindings (llama_cpp.llama_cpp re-exported)

lib = _lib
log = logging.getLogger("localspec.llama")

# Extension APIs of this llama.cpp (llama-ext.h: nextn embeddings, ctx_other), bound by
# llama-cpp-python under their C++ symbol names; EAGLE-3 heads use them.
import llama_cpp.llama_cpp_ext as ext  # noqa: E402
from llama_cpp._ggml import libggml as _libggml  # noqa: E402



def _ext_function(names: tuple[str, ...], argtypes, restype):
    """A llama-ext.h function by its C or C++ (Itanium) symbol name; None when absent."""
    for name in names:
        f = getattr(_lib.llama_cpp._lib, name, None)
        if f is not None:
            f.argtypes, f.restype = argtypes, restype
            return f
    return None


# const int32_t * llama_model_target_layer_ids(const llama_model *); uint32_t ..._n(...)
model_target_layer_ids = _ext_function(
    ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model"),
    [ctypes.c_void_p],
    ctypes.POINTER(ctypes.c_int32),
)
model_target_layer_ids_n = _ext_function(
    ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model"),
    [ctypes.c_void_p],
    ctypes.c_uint32,
)

# void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size)
ggml_tensor_get = _libggml.ggml_backend_tensor_get
ggml_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
ggml_tensor_get.restype = None

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5
_LEVELS = {"debug": 1, "info": 2, "warn": 3, "warning": 3, "error": 4, "none": 99}
_PY_LEVEL = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

_init_lock = threading.Lock()
_initialised = False
_recent_errors: collections.deque[str] = collections.deque(maxlen=16)
_last_level = 2
_min_level = _LEVELS.get(os.environ.get("LOCALSPEC_LLAMA_LOG", "error").lower(), 4)


def _on_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    global _last_level
    if level == 5:  # GGML_LOG_LEVEL_CONT continues the previous line
        level = _last_level
    _last_level = level
    try:
        msg = text.decode("utf-8", errors="replace").rstrip("\n")
    except Exception:  # pragma: no cover - never let a log line raise into C
        return
    if level >= 4 and msg:
        _recent_errors.append(msg)
        held = getattr(_held, "lines", None)
        if held is not None:  # inside ``held_errors``: the caller's error will carry it
            held.append(msg)
            return
    if level >= _min_level and msg:
        log.log(_PY_LEVEL.get(level, logging.INFO), "%s", msg)


_held = threading.local()


@contextlib.contextmanager
def held_errors():
    """Around a llama.cpp call (a model load, a context's creation) whose failure raises an
    error that quotes ``recent_errors()``: the error lines llama.cpp logs on this thread meanwhile
    are held back, dropped when the block raises (its one-line message repeats them) and logged
    as usual when it does not. Without it a failed load printed each line twice."""
    _held.lines = lines = []
    try:
        yield
    finally:
        _held.lines = None
    if _min_level <= 4:  # reached only when the block did not raise
        for msg in lines:
            log.error("%s", msg)


_log_callback = lib.llama_log_callback(_on_log)  # keep a reference: C holds the pointer

_stderr_lock = threading.Lock()


@contextlib.contextmanager
def captured_stderr():
    """Around a llama.cpp call that writes to file descriptor 2 itself, not through its log
    (the grammar parser prints ``parse: error parsing grammar: ...`` and the grammar with
    ``fprintf(stderr, ...)``): yields a list that holds the text written meanwhile, which does
    not reach the terminal. One block at a time; other threads' writes to fd 2 inside it (a
    few milliseconds) are captured too: the caller writes the text out again when it is not
    the call's own (``GrammarState``)."""
    import tempfile

    out: list[str] = []
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode("utf-8", errors="replace"))


# Ctrl-C while llama.cpp calls back into Python (its log during a model load, the abort
# callback of a long decode) raises KeyboardInterrupt inside the callback, where ctypes can only
# print it ("Exception ignored on calling ctypes callback function") and return to C: the load
# then finished and the program went on as if nothing was pressed. The hook below keeps such an
# interrupt instead, for the thread it was raised in, and ``raise_if_interrupted`` raises it once
# the native call is over (``Model``, ``Context`` and ``Context.decode`` call it).
_interrupt_lock = threading.Lock()
_interrupted_threads: set[int] = set()
_previous_unraisablehook = None


def _unraisablehook(unraisable) -> None:
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        with _interrupt_lock:
            _interrupted_threads.add(threading.get_ident())
        return
    (_previous_unraisablehook or sys.__unraisablehook__)(unraisable)


def raise_if_interrupted() -> None:
    """Raise the KeyboardInterrupt that a llama.cpp callback on this thread swallowed, if any.

    Raises:
        KeyboardInterrupt: Ctrl-C was pressed during the native call that just returned."""
    if _interrupted_threads:
        me = threading.get_ident()
        with _interrupt_lock:
            hit = me in _interrupted_threads
            _interrupted_threads.discard(me)
        if hit:
            raise KeyboardInterrupt


def ensure_backend() -> None:
    """Initialise llama.cpp once (idempotent, thread-safe) and install the log hook and the
    hook that keeps a Ctrl-C raised inside a callback (``raise_if_interrupted``; other
    unraisable exceptions go to the hook that was installed before)."""
    global _initialised, _previous_unraisablehook
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        if sys.unraisablehook is not _unraisablehook:
            _previous_unraisablehook = sys.unraisablehook
            sys.unraisablehook = _unraisablehook
        lib.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lib.llama_backend_init()
        _initialised = True


def recent_errors(clear: bool = True) -> list[str]:
    """Error lines llama.cpp logged since the last call (newest last)."""
    out = list(_recent_errors)
    if clear:
        _recent_errors.clear()
    return out


def set_log_level(name: str) -> None:
    """Set the lowest llama.cpp log level passed to Python logging ('debug' ... 'none')."""
    global _min_level
    _min_level = _LEVELS[name.lower()]


def exact_kernels() -> bool:
    """True when this process runs llama.cpp's CPU kernels in the exact configuration:
    batched rows computed bit for bit like single-token decodes (tiled K-quant matmul off;
    models load without weight repacking). Chosen by ``LOCALSPEC_KERNELS=exact|fast`` before
    localspec is imported (default ``exact``)."""
    return os.environ.get("GGML_CPU_TILED_MM") == "0"


def cpu_amx() -> bool:
    """True when llama.cpp's CPU backend runs AMX kernels here (``AMX_INT8 = 1`` in
    ``system_info()``): then repacked weights go to its AMX buffer type, whose matmul
    segfaults on batches of 2+ rows (llama.cpp issue 20824, open and unfixed; reproduced
    here 2026-12-03 with Gemma 3 270M Q4_K_M in ``ggml_backend_amx_mul_mat``)."""
    return "AMX_INT8 = 1" in system_info()


def system_info() -> str:
    """llama.cpp's build/system summary (CPU features, GPU backends)."""
    ensure_backend()
    return lib.llama_print_system_info().decode("utf-8", errors="replace")


def supports_gpu_offload() -> bool:
    """True when this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan, ...)."""
    ensure_backend()
    return bool(lib.llama_supports_gpu_offload())
