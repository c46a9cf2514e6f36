"""``GGUFIndex``: a fast, read-only index of a GGUF file (metadata and tensor locations).

``gguf.GGUFReader`` builds numpy views for every item of every array, which on a 262k-token
vocabulary takes 10-40 s; EAGLE-3 training and head export only need a few scalars, the raw
bytes of the tokenizer entries (copied verbatim into the head) and rows of two tensors. This
index walks the file once with ``struct`` (a fraction of a second) and dequantises rows on
demand with ``gguf.quants``. File layout: GGUF v3 (header, key/value entries, tensor infos,
aligned tensor data).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    """shape: dims in GGUF order (``ne``, fastest first); qtype: ``GGMLQuantizationType`` value;
    offset: absolute byte offset of the data."""

    shape: tuple[int, ...]
    qtype: int
    offset: int


class GGUFIndex:
    """Metadata values, raw key/value bytes and tensor locations of a GGUF file.

    Attributes:
        values: key -> value (scalars, strings; arrays of numbers as lists, or numpy arrays
            when longer than 64; string arrays are left out: read them with gguf if needed).
        raw: key -> the entry's serialized value (type tag included), to copy into another GGUF.
        tensors: name -> ``TensorInfo``.
    Raises:
        ValueError: not a GGUF file, or a truncated or corrupt one (a header that runs past
            the end of the file, or tensor data that does not fit in it), naming the file
            and its size.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._eog: list[int] | None = None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ValueError(f"{path} is not a GGUF file ({size} bytes)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mm[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        try:
            self._walk()
        except (struct.error, ValueError, OverflowError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is a truncated or corrupt GGUF file ({size} bytes; {e})") from None

    def _walk(self) -> None:
        mm = self._mm
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        off = 24
        self.values: dict[str, object] = {}
        self.raw: dict[str, bytes] = {}
        for key, value, start, off in self._entries(n_kv):
            if value is not None:
                self.values[key] = value
            self.raw[key] = bytes(mm[start:off])
        infos = []
        for _ in range(n_tensors):
            name, off = self._str(off)
            (n_dims,) = struct.unpack_from("<I", mm, off)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, off + 4)
            qtype, rel = struct.unpack_from("<IQ", mm, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in dims), int(qtype), int(rel)))
        align = int(self.values.get("general.alignment", 32))
        data = (off + align - 1) // align * align
        self.tensors = {n: TensorInfo(s, q, data + r) for n, s, q, r in infos}
        from gguf import GGML_QUANT_SIZES

        known = {int(q) for q in GGML_QUANT_SIZES}
        for name, t in self.tensors.items():
            # a type this gguf version does not know has no size here: only rows() would fail
            if t.qtype in known and t.offset + self.nbytes(name) > len(mm):
                raise ValueError(f"the data of tensor {name!r} ends past the end of the file")

    def _entries(self, n_kv: int):
        """The ``n_kv`` key/value entries from the end of the header on, one at a time:
        ``(key, value, start, end)``, the value's bytes (type tag included) at ``start:end``
        (``_value``: None for string arrays)."""
        off = 24
        for _ in range(n_kv):
            key, start = self._str(off)
            (vtype,) = struct.unpack_from("<I", self._mm, start)
            value, off = self._value(vtype, start + 4)
            yield key, value, start, off

    def _str(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mm, off)
        if off + 8 + n > len(self._mm):
            raise ValueError("a string runs past the end of the file")
        return self._mm[off + 8 : off + 8 + n].decode("utf-8", errors="replace"), off + 8 + n

    def _value(self, vtype: int, off: int):
        mm = self._mm
        if vtype in _SCALAR:
            fmt = "<" + _SCALAR[vtype]
            return struct.unpack_from(fmt, mm, off)[0], off + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._str(off)
        if vtype == _ARRAY:
            sub, n = struct.unpack_from("<IQ", mm, off)
            off += 12
            if sub in _SCALAR:
                size = struct.calcsize("<" + _SCALAR[sub])
                vals = np.frombuffer(mm, dtype=_NUMPY[sub], count=n, offset=off).copy()
                return (vals.tolist() if n <= 64 else vals), off + n * size
            if sub == _STRING:
                for _ in range(n):
                    (k,) = struct.unpack_from("<Q", mm, off)
                    off += 8 + k
                return None, off
            raise ValueError(f"{self.path}: nested arrays are not supported")
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")

    def types(self, key: str) -> tuple[int, int | None]:
        """``(GGUFValueType, sub-type of an array or None)`` of an entry."""
        vtype, sub = struct.unpack_from("<I", self.raw[key])[0], None
        if vtype == _ARRAY:
            sub = struct.unpack_from("<I", self.raw[key], 4)[0]
        return vtype, sub

    def contents(self, key: str):
        """The whole value of an entry, as ``gguf``'s ``ReaderField.contents()`` gives it:
        scalars, ``str``, arrays as lists (string arrays decoded, UTF-8).

        Raises:
            KeyError: no such key.
            UnicodeDecodeError: a string that is not UTF-8 (as ``gguf`` raises).
        """
        raw = self.raw[key]
        vtype, sub = self.types(key)
        if vtype != _ARRAY:
            return self.values[key]
        if sub in _SCALAR:
            return np.frombuffer(raw, dtype=_NUMPY[sub], offset=16).tolist()
        (n,) = struct.unpack_from("<Q", raw, 8)
        out, off, unpack = [], 16, struct.Struct("<Q").unpack_from
        for _ in range(n):
            (k,) = unpack(raw, off)
            out.append(raw[off + 8 : off + 8 + k].decode("utf-8"))
            off += 8 + k
        return out

    def nbytes(self, name: str) -> int:
        """Bytes of a tensor's data."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.qtype)]
        return int(np.prod(t.shape)) * type_size // block

    def data(self, name: str) -> np.ndarray:
        """A read-only view of a tensor's data, shaped and typed as ``gguf.GGUFReader`` gives
        it: numpy order (``ne`` reversed); F16/F32/F64/I8-I64 in their dtype, every other
        (quantised) type as ``uint8`` with the last axis in bytes."""
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        t = self.tensors[name]
        qt = Q(t.qtype)
        shape = tuple(reversed(t.shape))
        plain = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}  # fmt: skip
        if qt in plain:
            dtype = np.dtype(plain[qt])
        else:
            dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, qt)
        count = self.nbytes(name) // dtype.itemsize
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=t.offset).reshape(shape)

    def eog_ids(self) -> list[int]:
        """The vocabulary's end-of-generation ids as llama.cpp gives them (``llama_vocab_is_eog``,
        from a vocabulary-only load: the file's ``eos``/``eot`` ids and the end-of-turn tokens
        llama.cpp recognises by their text, such as Gemma's ``<end_of_turn>``, which the keys
        alone miss), sorted, without repeats; read once.

        Raises:
            ModelLoadError: llama.cpp cannot read the file's vocabulary.
        """
        if self._eog is None:
            from localspec.backend import Model

            with Model(self.path, vocab_only=True) as vocab:
                self._eog = sorted(vocab.eog_ids)
        return list(self._eog)

    def array_len(self, key: str) -> int:
        """Number of items of an array entry (e.g. ``tokenizer.ggml.tokens``)."""
        return struct.unpack_from("<IIQ", self.raw[key])[2]

    def lm_head_name(self) -> str:
        """The tensor holding a model's output matrix: ``output.weight``, or ``token_embd.weight``
        where the two are tied (Gemma) and the file has no ``output.weight``."""
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def rows(self, name: str, ids: np.ndarray | None = None) -> np.ndarray:
        """Rows of a 2-D tensor (or the whole 1-D tensor), dequantised: [len(ids), ne0] float32.

        Raises:
            KeyError: no such tensor.
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        qt = GGMLQuantizationType(t.qtype)
        block, type_size = GGML_QUANT_SIZES[qt]
        ne0 = t.shape[0]
        n_rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        row_bytes = ne0 // block * type_size
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=n_rows * row_bytes, offset=t.offset).reshape(n_rows, row_bytes)
        sel = raw if ids is None else raw[np.asarray(ids, dtype=np.int64)]
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dt = np.float32 if qt == GGMLQuantizationType.F32 else np.float16
            out = np.ascontiguousarray(sel).view(dt).astype(np.float32)
        else:
            out = np.asarray(dequantize(np.ascontiguousarray(sel), qt), dtype=np.float32)
        out = out.reshape(-1, ne0)
        return out[0] if len(t.shape) == 1 else out


def gguf_value(path: str | os.PathLike, key: str):
    """The value of metadata ``key`` in a GGUF file, reading only the key/value entries up to
    it (the general and architecture keys come first, before the tokenizer's long arrays): a
    cheap look at a file before loading it. None when the file has no such key or is not a
    readable GGUF (missing, truncated, another format)."""
    idx = GGUFIndex.__new__(GGUFIndex)
    idx.path = str(path)
    try:
        with open(idx.path, "rb") as f:
            idx._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # missing, a directory, an empty file
        return None
    try:
        if idx._mm[:4] != b"GGUF" or len(idx._mm) < 24:
            return None
        _, _, n_kv = struct.unpack_from("<IQQ", idx._mm, 4)
        for k, value, _start, _end in idx._entries(n_kv):  # stops at the key: the rest is not read
            if k == key:
                return value
    except (ValueError, struct.error, OverflowError):
        return None
    finally:
        idx._mm.close()
    return None


def gguf_architecture(path: str | os.PathLike) -> str | None:
    """``general.architecture`` of a GGUF file (``gguf_value``; by convention the first
    entry), or None."""
    arch = gguf_value(path, "general.architecture")
    return arch if isinstance(arch, str) else None
