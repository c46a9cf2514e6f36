"""Derived draft models: layer-truncated copies of a target GGUF.

``derive_draft(target, out, n_layers)`` keeps the first ``n_layers`` transformer blocks, the
final norm, the token embeddings and the output matrix (or the tied embeddings), and fixes
the metadata: ``{arch}.block_count`` and every per-layer metadata array (one entry per block,
e.g. per-layer head counts or sliding-window patterns) are cut to ``n_layers``. The
vocabulary is copied unchanged, so the draft passes the vocabulary check by construction.

The result is a real, different draft: its hidden state after ``n_layers`` blocks goes
straight to the final norm and lm_head, so it agrees with the target on easy tokens and
not on hard ones. On large targets it is cheap; on a small target whose lm_head dominates
(Gemma 3 270M: the 262k-row tied embedding is ~70% of a decode) it costs most of a target
step and is useful to test the draft-model path with realistic, imperfect acceptance.
"""

from __future__ import annotations

import os
from pathlib import Path

from .gguf_edit import copy_gguf, open_index


def _block_of(tensor_name: str) -> int | None:
    parts = tensor_name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


def derive_draft(target: str | os.PathLike, out: str | os.PathLike, n_layers: int) -> Path:
    """Write a copy of ``target`` truncated to its first ``n_layers`` blocks.

    Args:
        target: the target GGUF.
        out: the draft GGUF to write.
        n_layers: blocks to keep, ``1 <= n_layers < block_count``.
    Returns:
        ``out`` as a ``Path``.
    Raises:
        ValueError: ``n_layers`` out of range, a model with extra prediction blocks (MTP /
            NextN layers sit at the end and would be cut off), or a truncated or corrupt
            ``target`` (``open_index``).
    """
    r = open_index(target)  # read once, for the checks and the copy
    meta = r.values
    arch = meta.get("general.architecture", "llama")
    n_block = int(meta[f"{arch}.block_count"])
    if not 1 <= n_layers < n_block:
        raise ValueError(f"--layers must be in 1..{n_block - 1} for this {n_block}-block model, got {n_layers}")
    if int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0):
        raise ValueError("models with NextN/MTP prediction blocks cannot be truncated this way")

    def per_layer(key: str, value):
        if key.startswith(f"{arch}.") and isinstance(value, list) and len(value) == n_block:
            return value[:n_layers]
        return value

    name = meta.get("general.name") or Path(target).stem
    copy_gguf(
        r,
        out,
        set_kv={f"{arch}.block_count": n_layers, "general.name": f"{name} (first {n_layers} of {n_block} layers)"},
        keep_tensor=lambda t: (_block_of(t) is None) or _block_of(t) < n_layers,
        edit_kv=per_layer,
    )
    return Path(out)
