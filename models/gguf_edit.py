"""Copy a GGUF file with edits, through the ``gguf`` library.

Used to make the small test GGUFs (the default model with a chat template, with FIM tokens,
with a changed vocabulary) and derived drafts (layer-truncated copies). Tensor data is
streamed from the memory-mapped source, so a copy never holds the model in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

_VIRTUAL = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


def _infer_type(val: Any):
    from gguf import GGUFValueType as T

    if isinstance(val, bool):
        return T.BOOL, None
    if isinstance(val, int):
        return (T.UINT32 if val >= 0 else T.INT32), None
    if isinstance(val, float):
        return T.FLOAT32, None
    if isinstance(val, str):
        return T.STRING, None
    if isinstance(val, (list, tuple)):
        if not val:
            raise ValueError("cannot infer the type of an empty array")
        sub, _ = _infer_type(val[0])
        return T.ARRAY, sub
    raise TypeError(f"cannot store {type(val).__name__} in GGUF metadata")


def open_reader(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` on ``path``.

    Raises:
        ValueError: the file is truncated or corrupt (the reader's own errors, such as
            ``cannot reshape array of size ...``, say neither), naming the file and its size.
    """
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        size = Path(path).stat().st_size
        raise ValueError(
            f"{path} is a truncated or corrupt GGUF file ({size} bytes; the reader said: {e})"
        ) from None


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata key/values of a GGUF (arrays as lists, strings decoded).

    Raises:
        ValueError: a truncated or corrupt file (``open_reader``).
    """
    r = open_reader(path)
    return {k: f.contents() for k, f in r.fields.items() if k not in _VIRTUAL}


def copy_gguf(
    src,
    dst: str | os.PathLike,
    *,
    set_kv: Mapping[str, Any] | None = None,
    drop_kv: Iterable[str] = (),
    keep_tensor: Callable[[str], bool] | None = None,
    rename_tensor: Callable[[str], str] | None = None,
    edit_kv: Callable[[str, Any], Any] | None = None,
) -> Path:
    """Write ``dst``: a copy of ``src`` with metadata and tensors edited.

    Args:
        src: a GGUF path, or a ``gguf.GGUFReader`` already open on one (parsing the metadata
            of a 262k-token vocabulary takes seconds: reuse one reader for many copies).
        set_kv: keys to add or replace. A value is either a plain Python value (type
            inferred: bool, non-negative int -> UINT32, int -> INT32, float -> FLOAT32, str,
            list of those) or a ``(value, GGUFValueType[, sub_type])`` tuple.
        drop_kv: keys to remove.
        keep_tensor: predicate on tensor names (default: keep all).
        rename_tensor: new name for a kept tensor.
        edit_kv: ``(key, value) -> value`` applied to every copied value (e.g. to change one
            entry of the vocabulary).
    Returns:
        ``dst`` as a ``Path``.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    set_kv = dict(set_kv or {})
    drop = set(drop_kv)
    r = src if isinstance(src, GGUFReader) else open_reader(src)
    arch_field = r.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "llama"
    if "general.architecture" in set_kv:
        v = set_kv.pop("general.architecture")
        arch = v[0] if isinstance(v, tuple) else v
    w = GGUFWriter(str(dst), arch=arch, endianess=r.endianess)
    for key, field in r.fields.items():
        if key in _VIRTUAL or key == "general.architecture" or key in drop or key in set_kv:
            continue
        val = field.contents()
        if edit_kv is not None:
            val = edit_kv(key, val)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, val, vtype, sub_type=sub)
    for key, v in set_kv.items():
        if isinstance(v, tuple):
            val, vtype, *rest = v
            sub = rest[0] if rest else None
        else:
            val = v
            vtype, sub = _infer_type(v)
        w.add_key_value(key, val, vtype, sub_type=sub)
    tensors = [t for t in r.tensors if keep_tensor is None or keep_tensor(t.name)]
    for t in tensors:
        name = rename_tensor(t.name) if rename_tensor else t.name
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(np.asarray(t.data))
    w.close()
    return Path(dst)
