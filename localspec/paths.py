"""Where localspec keeps its files (assembled default model, cost tables)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$LOCALSPEC_CACHE_DIR`` or the platform's user cache directory for localspec."""
    env = os.environ.get("LOCALSPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localspec"))
