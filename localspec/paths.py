"""Where localspec keeps its files (assembled default model, cost tables, readout verdicts),
and how it writes files a reader must never see half written (``atomic_path``)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """``$LOCALSPEC_CACHE_DIR`` or the platform's user cache directory for localspec."""
    env = os.environ.get("LOCALSPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localspec"))


def read_json_cache(path: Path) -> dict:
    """The JSON object in the cache file ``path``; ``{}`` when it is missing, unreadable or
    not a JSON object (a cache is only a cache)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_cache(path: Path, data: dict) -> None:
    """Write ``data`` to the cache file ``path`` atomically (a temporary file renamed over it,
    so a reader never sees half a file); errors of the file system are ignored."""
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(data, indent=1))
    except OSError:
        pass


def update_json_cache(path: Path, key: str, entry: dict | None) -> None:
    """Put ``entry`` under ``key`` in the cache file ``path`` (None: remove the key), keeping
    the other keys as the file holds them now (another process may have written some)."""
    data = read_json_cache(path)
    if entry is None:
        if data.pop(key, None) is None:
            return
    else:
        data[key] = entry
    write_json_cache(path, data)


_PARTIAL: set[Path] = set()  # temporary files of ``atomic_path`` blocks still being written


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path in ``path``'s folder to write to, renamed over ``path`` when the block
    ends and removed when it raises (a KeyboardInterrupt too; a hard exit on Ctrl-C removes it
    with ``remove_partial_files``): ``path`` never holds half a file, and a file already there
    stays as it was until the new one is complete.

    Raises:
        OSError: the rename failed (the temporary file is removed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _PARTIAL.add(tmp)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        _PARTIAL.discard(tmp)
        tmp.unlink(missing_ok=True)


def remove_partial_files() -> None:
    """Remove the temporary files of unfinished ``atomic_path`` blocks (before ``os._exit``)."""
    for tmp in list(_PARTIAL):
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
