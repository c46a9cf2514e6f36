"""EAGLE-3 heads shipped with localspec (package data under ``models/heads/``).

``heads/manifest.json`` lists each head with the SHA-256 and size of the target GGUF it was
trained for; ``shipped_head(target)`` returns the head for a target file when one ships (the
default model has one: ``--drafter eagle3`` needs no ``--eagle`` path then). How the shipped
head was made: docs/eagle3-training.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

HEADS_DIR = Path(__file__).with_name("heads")


def _manifest() -> list[dict]:
    try:
        return json.loads((HEADS_DIR / "manifest.json").read_text())["heads"]
    except (OSError, ValueError, KeyError):
        return []


def _sha256(path: Path) -> str:
    """SHA-256 of a file; for the assembled default model the registry's stamp is trusted."""
    from .registry import _models_dir

    stamp = _models_dir() / (path.stem + ".stamp.json")
    try:
        st = path.stat()
        info = json.loads(stamp.read_text())
        if path.resolve().parent == _models_dir().resolve() and info.get("size") == st.st_size and info.get("mtime_ns") == st.st_mtime_ns:
            return info["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_head(target: str | os.PathLike, kind: str = "eagle3") -> Path | None:
    """The shipped head of ``kind`` (``"eagle3"``, or ``"medusa"`` for Medusa heads) trained
    for the GGUF ``target`` (matched by size, then SHA-256), or None when none ships for it.
    Manifest entries without a ``kind`` are EAGLE-3 heads."""
    p = Path(target)
    try:
        size = p.stat().st_size
    except OSError:
        return None
    for entry in _manifest():
        if entry.get("kind", "eagle3") != kind:
            continue
        head = HEADS_DIR / entry["file"]
        if entry["target_size"] == size and head.exists() and _sha256(p) == entry["target_sha256"]:
            return head
    return None
