"""Copy a GGUF file with edits, through the ``gguf`` library.

Used to make the small test GGUFs (the default model with a chat template, with FIM tokens,
with a changed vocabulary) and derived drafts (layer-truncated copies). The source is read
through ``GGUFIndex``; tensor data is streamed from the memory-mapped source, so a copy never
holds the model in memory; writing goes through ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..paths import atomic_path
from .gguf_index import GGUFIndex


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


def open_index(path: str | os.PathLike) -> GGUFIndex:
    """A ``GGUFIndex`` on ``path`` (one ``struct`` walk of the header: ~0.2 s on a 262k-token
    vocabulary, where ``gguf.GGUFReader`` takes 10-40 s building numpy views of every entry).

    Raises:
        ValueError: the file is not a GGUF, or is truncated or corrupt (naming the file and
            its size).
    """
    return GGUFIndex(path)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All metadata key/values of a GGUF (arrays as lists, strings decoded), as
    ``gguf.GGUFReader``'s ``field.contents()`` gives them.

    Raises:
        ValueError: a truncated or corrupt file (``open_index``).
    """
    r = open_index(path)
    return {k: r.contents(k) for k in r.raw}


class RawValue(bytes):
    """A metadata value already serialised (type tag included), written as is."""


def raw_writer(out: str | os.PathLike, arch: str, **kwargs):
    """A ``gguf.GGUFWriter`` that also takes ``add_raw(key, serialised_value)``: entries copied
    byte for byte from another GGUF (``GGUFIndex.raw``) instead of decoded and re-encoded
    (a 262k-string vocabulary)."""
    from gguf import GGUFWriter

    class Writer(GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if isinstance(val, RawValue):
                return bytes(val)
            return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)

        def add_raw(self, key: str, raw: bytes) -> None:
            from gguf.gguf_writer import GGUFValue, GGUFValueType

            if any(key in kv for kv in self.kv_data):
                raise ValueError(f"Duplicated key name {key!r}")
            self.kv_data[0][key] = GGUFValue(RawValue(raw), GGUFValueType.ARRAY)

    return Writer(str(out), arch=arch, **kwargs)


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

    Unedited entries are copied byte for byte; tensor data is streamed from the mapped
    source. The source is read through ``GGUFIndex`` (a fraction of a second; ``GGUFReader``
    took 10-40 s per copy of a model with a 262k-token vocabulary).

    Args:
        src: a GGUF path, or a ``GGUFIndex`` already open on one (to make many copies).
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
    Raises:
        ValueError: a truncated or corrupt source (``open_index``).
    """
    from gguf import GGUFValueType

    set_kv = dict(set_kv or {})
    drop = set(drop_kv)
    r = src if isinstance(src, GGUFIndex) else open_index(src)
    arch = r.values.get("general.architecture", "llama")
    if "general.architecture" in set_kv:
        v = set_kv.pop("general.architecture")
        arch = v[0] if isinstance(v, tuple) else v
    with atomic_path(dst) as tmp:  # dst never holds half a model (Ctrl-C, a full disk)
        w = raw_writer(tmp, arch)
        for key in r.raw:
            if key == "general.architecture" or key in drop or key in set_kv:
                continue
            if edit_kv is not None:
                val = r.contents(key)
                new = edit_kv(key, val)
                if new is not val:  # edited: encode the new value with the entry's own types
                    vtype, sub = r.types(key)
                    w.add_key_value(key, new, GGUFValueType(vtype), sub_type=None if sub is None else GGUFValueType(sub))
                    continue
            w.add_raw(key, r.raw[key])
        for key, v in set_kv.items():
            if isinstance(v, tuple):
                val, vtype, *rest = v
                sub = rest[0] if rest else None
            else:
                val = v
                vtype, sub = _infer_type(v)
            w.add_key_value(key, val, vtype, sub_type=sub)
        tensors = [t for t in r.tensors if keep_tensor is None or keep_tensor(t)]
        for t in tensors:
            data = r.data(t)
            w.add_tensor_info(rename_tensor(t) if rename_tensor else t, data.shape, data.dtype, data.nbytes, r.tensors[t].qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            w.write_tensor_data(r.data(t))
        w.close()
    return Path(dst)
