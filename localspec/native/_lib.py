"""ctypes bindings of the C library built from ``native/`` (see ``native/localspec_native.h``
for the contracts). Only this module touches raw pointers and function signatures."""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import warnings
from ctypes import POINTER, c_double, c_float, c_int8, c_int32, c_int64, c_uint64, c_void_p
from pathlib import Path

ABI_VERSION = 13

# error codes (LS_ERR_*)
ERR_BANNED = -1
ERR_NONE_ALLOWED = -2
ERR_ZERO_DRAFT_PROB = -3
ERR_NO_DRAFT_DIST = -4
ERR_NOMEM = -5
ERR_BAD_TREE = -6
ERR_ARG = -7

VERIFY_GREEDY = 0
VERIFY_REJECTION = 1
VERIFY_THRESHOLD = 2  # LOSSY (ls_verify_thresholds)

_LIB_STEM = "_lsnative"


class Sampling(ctypes.Structure):
    """``ls_sampling``."""

    _fields_ = [
        ("temperature", c_double),
        ("top_p", c_double),
        ("min_p", c_double),
        ("top_k", c_int32),
        ("penalty_last_n", c_int32),
        ("has_penalties", c_int32),
        ("_pad", c_int32),
        ("repeat_penalty", c_float),
        ("frequency_penalty", c_float),
        ("presence_penalty", c_float),
        ("_padf", c_float),
        ("bias_ids", c_void_p),
        ("bias_vals", c_void_p),
        ("n_bias", c_int64),
        ("seed", c_uint64),
    ]


class Tree(ctypes.Structure):
    """``ls_tree``."""

    _fields_ = [
        ("n_nodes", c_int32),
        ("_pad", c_int32),
        ("token_ids", c_void_p),
        ("parents", c_void_p),
        ("draft_probs", c_void_p),
        ("draft_dists", c_void_p),
        ("dist_is_f64", c_void_p),
        ("dist_ids", c_void_p),
        ("dist_len", c_void_p),
    ]


class DraftParams(ctypes.Structure):
    """``ls_draft_params``."""

    _fields_ = [
        ("min_n", c_int32),
        ("max_n", c_int32),
        ("max_occurrences", c_int32),
        ("depth_cap", c_int32),
        ("node_cap", c_int32),
        ("max_match", c_int32),
        ("n_len_edges", c_int32),
        ("n_rank", c_int32),
        ("n_depth_by_match", c_int32),
        ("_pad", c_int32),
        ("len_edges", c_void_p),
        ("depth_by_match", c_void_p),
        ("estimates", c_void_p),
    ]


class MatT(ctypes.Structure):
    """``ls_mat_t``: one weight matrix of a head (kind ``LS_MAT_*``, sizes, data addresses)."""

    _fields_ = [("kind", c_int32), ("out_scale", c_float), ("m", c_int64), ("k", c_int64), ("w", c_void_p), ("d", c_void_p),
                ("w4", c_void_p), ("d4", c_void_p)]


LS_MAT_Q8, LS_MAT_F32T, LS_MAT_F16, LS_MAT_BF16 = 0, 1, 2, 3


class HeadT(ctypes.Structure):
    """``ls_head_t``: an EAGLE-3 head's decoder layer for ``ls_head_level``."""

    _fields_ = [
        *[(f, c_int32) for f in ("n_embd", "n_head", "n_head_kv", "head_dim", "n_rot", "n_ff", "norm_before_residual", "pad")],
        ("eps", c_float),
        ("pad2", c_float),
        *[(f, c_void_p) for f in ("rope_inv", "attn_norm", "hidden_norm", "ffn_norm", "output_norm")],
        *[(f, MatT) for f in ("wq", "kv", "wo", "gate_up", "down", "output")],
    ]


_P = c_void_p  # every array argument is passed as an address (ndarray.ctypes.data)

_SIGNATURES = {
    "ls_abi_version": (c_int32, []),
    "ls_has_openmp": (c_int32, []),
    "ls_stream_key": (c_uint64, [c_uint64, c_int64, c_int32]),
    "ls_uniforms": (None, [c_uint64, _P, c_int64, _P]),
    "ls_gumbel_noise": (None, [c_uint64, _P, c_int64, _P]),
    "ls_workspace_new": (c_void_p, [c_int64, c_int32]),
    "ls_workspace_free": (None, [c_void_p]),
    "ls_workspace_set_threads": (None, [c_void_p, c_int32]),
    "ls_argmax": (c_int64, [_P, c_int64]),
    "ls_logsumexp": (c_double, [_P, c_int64]),
    "ls_rows_logsumexp": (None, [_P, c_int64, c_int64, _P, c_int64, _P, c_int32]),
    "ls_top_k": (c_int64, [_P, c_int64, c_int64, c_void_p, _P]),
    "ls_candidates": (c_int64, [POINTER(Sampling), _P, c_int64, _P, _P, c_int64, c_void_p, _P, _P]),
    "ls_choose": (c_int64, [POINTER(Sampling), _P, c_int64, _P, _P, c_int64, c_int64, c_void_p]),
    "ls_sample_from": (c_int64, [_P, c_int64, c_double]),
    "ls_verify": (
        c_int32,
        [POINTER(Tree), _P, c_int64, c_int64, POINTER(Sampling), c_int32, c_int64, _P, c_int64, c_void_p, _P, _P,
         POINTER(c_int32)],
    ),
    "ls_verify_thresholds": (
        c_int32,
        [POINTER(Tree), _P, c_int64, c_int64, POINTER(Sampling), c_double, c_double, c_int64, _P, c_int64, c_void_p,
         _P, _P, POINTER(c_int32)],
    ),
    "ls_ngram_new": (c_void_p, [c_int32]),
    "ls_ngram_free": (None, [c_void_p]),
    "ls_ngram_len": (c_int64, [c_void_p]),
    "ls_ngram_extend": (c_int32, [c_void_p, _P, c_int64]),
    "ls_ngram_truncate": (None, [c_void_p, c_int64]),
    "ls_ngram_tokens": (c_int64, [c_void_p, c_int64, c_int64, _P]),
    "ls_ngram_lookup": (c_int32, [c_void_p, c_int32, c_int32, c_int32, _P, _P, _P]),
    "ls_ngram_draft": (c_int32, [c_void_p, POINTER(DraftParams), c_int32, _P, _P, _P, _P, _P, _P, _P]),
    "ls_memory_bytes": (c_int64, [c_int64, c_int32]),
    "ls_memory_new": (c_void_p, [c_int64, c_int32, c_int32]),
    "ls_memory_free": (None, [c_void_p]),
    "ls_memory_stats": (None, [c_void_p, _P]),
    "ls_memory_write": (c_int32, [c_void_p, _P, c_int64]),
    "ls_memory_tokens": (c_int64, [c_void_p, c_int64, c_int64, _P]),
    "ls_memory_draft": (
        c_int32,
        [c_void_p, _P, c_int64, POINTER(DraftParams), c_double, c_int32, c_int32, c_int32, _P, _P, _P, _P, _P, _P],
    ),
    "ls_gemm_t": (c_int32, [_P, c_int64, c_int64, _P, c_int64, _P, c_int32]),
    "ls_q8_quantize_rows": (c_int32, [_P, c_int64, c_int64, _P, _P]),
    "ls_gemm_q8": (c_int32, [_P, _P, c_int64, c_int64, _P, c_int64, _P, c_int32]),
    "ls_q8_pack4": (c_int32, [_P, _P, c_int64, c_int64, _P, _P]),
    "ls_gemm_h16": (c_int32, [_P, c_int32, c_int64, c_int64, _P, c_int64, _P, c_int32]),
    "ls_mat_apply": (c_int32, [POINTER(MatT), _P, c_int64, _P, c_int32]),
    "ls_head_level": (
        c_int32,
        [POINTER(HeadT), c_int64, _P, _P, _P, _P, _P, c_int64, c_int64, _P, _P, _P, _P, _P, _P, _P, c_int32],
    ),
    "ls_head_attn": (c_int32, [_P, c_int64, c_int32, c_int32, c_int32, _P, _P, _P, _P, c_float, _P, c_int32]),
    "ls_rms_norm_rows": (c_int32, [_P, c_int64, c_int64, _P, c_float, _P]),
    "ls_rope_norm": (c_int32, [_P, c_int64, c_int32, c_int32, c_int32, _P, _P]),
    "ls_swiglu_rows": (c_int32, [_P, c_int64, c_int64, _P]),
    "ls_tap_new": (c_void_p, [c_int32, c_void_p, c_int64, c_int64, c_int64, c_int64, c_void_p]),
    "ls_tap_free": (None, [c_void_p]),
    "ls_tap_rows": (c_int64, [c_void_p, c_int32]),
    "ls_tap_data": (c_void_p, [c_void_p, c_int32]),
    "ls_tap_error": (c_int32, [c_void_p]),
    "ls_tap_clear": (None, [c_void_p]),
    "ls_tap_n_asked": (c_int64, [c_void_p]),
    "ls_tap_n_copied": (c_int64, [c_void_p]),
    "ls_tap_set_paused": (None, [c_void_p, c_int32]),
    "ls_tap_set_stop": (None, [c_void_p, c_int32]),
    "ls_tap_set_stopping": (None, [c_void_p, c_int32]),
    "ls_tap_set_next": (None, [c_void_p, c_void_p, c_void_p]),
    "ls_tap_watch": (c_int32, [c_void_p, ctypes.c_char_p, c_int64]),
    "ls_tap_watched_src": (c_void_p, [c_void_p, c_int32]),
    "ls_lm_head": (c_int32, [_P, c_int64, c_int64, c_int64, _P, c_int64, c_void_p, c_int64, c_void_p, _P, c_int32, c_int32]),
    "ls_lm_head_kernel_available": (c_int32, [c_int32]),
}  # fmt: skip


def library_candidates() -> list[Path]:
    """Where the library may be: ``LOCALSPEC_NATIVE_LIB``, else next to this module with any
    extension-module suffix of this interpreter (the package build names it like one)."""
    env = os.environ.get("LOCALSPEC_NATIVE_LIB")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    return [here / (_LIB_STEM + s) for s in importlib.machinery.EXTENSION_SUFFIXES]


def stale_sources(library: Path, src_dir: Path) -> list[str]:
    """Names of the C sources and headers in ``src_dir`` modified after ``library`` was
    written, sorted: a library built before them. A compile error does not fail
    ``pip install -e .`` (the extension is optional, so that a machine without a compiler
    still installs), and it leaves the previous library in place."""
    t = library.stat().st_mtime
    return sorted(p.name for p in src_dir.glob("*.[ch]") if p.stat().st_mtime > t)


def load() -> ctypes.CDLL:
    """Load the library and declare its functions.

    Raises:
        OSError: no library file, it does not load, or its ABI version is not ours.
    """
    tried = []
    for path in library_candidates():
        if not path.is_file():
            tried.append(str(path))
            continue
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = lib.ls_abi_version()
        if version != ABI_VERSION:
            raise OSError(f"{path} has ABI version {version}, expected {ABI_VERSION}: rebuild with `pip install -e .`")
        src = Path(__file__).resolve().parents[2] / "native"  # a source checkout's native/ (editable installs)
        if not os.environ.get("LOCALSPEC_NATIVE_LIB") and (src / "localspec_native.h").is_file():
            stale = stale_sources(path, src)
            if stale:
                warnings.warn(f"{path.name} is older than native/{', native/'.join(stale[:3])}: rebuild with "
                              "`pip install -e . -v` (a compile error keeps the previous library)", RuntimeWarning,
                              stacklevel=2)  # fmt: skip
        return lib
    raise OSError("the native library is not built (looked for " + ", ".join(tried) + "); `pip install -e .` builds it")


__all__ = ["DraftParams", "Sampling", "Tree", "load", "c_int8", "c_int32", "c_void_p"]
