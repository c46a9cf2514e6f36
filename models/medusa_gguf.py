"""Medusa heads as a GGUF file: the format, its writer and its reader.

llama.cpp has no Medusa architecture; localspec runs the heads itself (``drafters.medusa``,
C kernels) and uses GGUF only as the container, written and read with the ``gguf`` library.

Metadata (``general.architecture = "medusa"``):

================================  ======  ==================================================
key                               type    meaning
================================  ======  ==================================================
``medusa.head_count``             u32     K, the number of heads (head k drafts k+1 ahead)
``medusa.embedding_length``       u32     E, the target's hidden size (input width)
``medusa.vocab_size``             u32     V, the draft vocabulary's size (rows of a readout)
``medusa.target_vocab_size``      u32     the target's vocabulary size (``d2t`` ids below it)
``medusa.target_vocab_sha256``    string  SHA-256 of the target's pieces of the ``d2t`` tokens
                                          (``vocab_fingerprint``): the same token texts
``medusa.target``                 string  the target it was trained for (informative)
``medusa.final_logit_softcapping`` f32    the target's soft-capping, applied to the readout
                                          (0: none)
``medusa.training``               string  JSON: data, steps, held-out accuracy per head
================================  ======  ==================================================

Tensors (``k`` = 0 .. K-1; shapes in numpy order, GGUF stores them reversed):

==========================  =========  ======  ================================================
name                        shape      type    meaning
==========================  =========  ======  ================================================
``medusa.{k}.ffn.weight``   [E, E]     F16     ``W_k`` of the residual block ``h + SiLU(W_k h + b_k)``
``medusa.{k}.ffn.bias``     [E]        F32     ``b_k``
``medusa.{k}.output.weight`` [V, E]    F16     the head's readout (logits = ``U_k r``), draft ids
``medusa.output.weight``    [V, E]     F16     instead of the per-head readouts: one readout
                                               shared by every head (``U_k = U``)
``d2t``                     [V]        I64     target id of each draft id (distinct)
==========================  =========  ======  ================================================

A shared readout is written whenever the heads' readouts are equal (the default recipe keeps
them the lm_head's rows): the file is half the size, and the runtime reads the matrix once
for all K heads (``native.rows.gemm_t``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..paths import atomic_path

ARCH = "medusa"


class MedusaFormatError(ValueError):
    """A file that is not a valid Medusa heads GGUF (one line, names the file and the fault)."""


@dataclass
class MedusaWeights:
    """The heads' weights, float32 in memory.

    Attributes:
        w: [K, E, E] residual-block matrices (``y = W h + b``).
        b: [K, E] biases.
        out: [K, V, E] readouts over the draft vocabulary, or [1, V, E]: one shared by every head.
        d2t: [V] int64 target ids.
        softcap: the target's final logit soft-capping (0 = none).
        target_vocab_size / target_vocab_sha256 / target: see the module docstring.
        training: what the trainer reports (JSON-able dict).
    """

    w: np.ndarray
    b: np.ndarray
    out: np.ndarray
    d2t: np.ndarray
    softcap: float = 0.0
    target_vocab_size: int = 0
    target_vocab_sha256: str = ""
    target: str = ""
    training: dict = field(default_factory=dict)

    @property
    def n_heads(self) -> int:
        return int(self.w.shape[0])

    @property
    def n_embd(self) -> int:
        return int(self.w.shape[1])

    @property
    def n_vocab_draft(self) -> int:
        return int(self.d2t.size)

    @property
    def shared_readout(self) -> bool:
        return self.out.shape[0] == 1 or all(np.array_equal(self.out[0], o) for o in self.out[1:])


def vocab_fingerprint(model, d2t: np.ndarray) -> str:
    """SHA-256 over the target's pieces (``Model.token_bytes``, special tokens rendered) of the
    ``d2t`` tokens, each prefixed with its length: heads drafted for another tokenizer draft
    other texts under the same ids."""
    h = hashlib.sha256()
    for t in np.asarray(d2t, dtype=np.int64):
        piece = model.token_bytes(int(t), special=True)
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    return h.hexdigest()


def write_medusa_gguf(path: str | os.PathLike, wts: MedusaWeights) -> Path:
    """Write ``wts`` as a Medusa heads GGUF (matrices in F16, biases in F32, ``d2t`` I64)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = Path(path)
    k, e = wts.n_heads, wts.n_embd
    if wts.w.shape != (k, e, e) or wts.b.shape != (k, e) or wts.out.shape[1:] != (wts.n_vocab_draft, e) or (
        wts.out.shape[0] not in (1, k)
    ):
        raise ValueError(f"inconsistent Medusa shapes: w {wts.w.shape}, b {wts.b.shape}, out {wts.out.shape}, d2t {wts.d2t.shape}")
    with atomic_path(path) as tmp:  # path never holds half a file (Ctrl-C, a full disk)
        wr = GGUFWriter(str(tmp), ARCH)
        wr.add_name("Medusa heads")
        wr.add_uint32(f"{ARCH}.head_count", k)
        wr.add_uint32(f"{ARCH}.embedding_length", e)
        wr.add_uint32(f"{ARCH}.vocab_size", wts.n_vocab_draft)
        wr.add_uint32(f"{ARCH}.target_vocab_size", int(wts.target_vocab_size))
        wr.add_string(f"{ARCH}.target_vocab_sha256", wts.target_vocab_sha256)
        wr.add_string(f"{ARCH}.target", wts.target)
        wr.add_float32(f"{ARCH}.final_logit_softcapping", float(wts.softcap))
        wr.add_string(f"{ARCH}.training", json.dumps(wts.training, sort_keys=True))
        shared = wts.shared_readout
        for i in range(k):
            wr.add_tensor(f"{ARCH}.{i}.ffn.weight", np.ascontiguousarray(wts.w[i], dtype=np.float16))
            wr.add_tensor(f"{ARCH}.{i}.ffn.bias", np.ascontiguousarray(wts.b[i], dtype=np.float32))
            if not shared:
                wr.add_tensor(f"{ARCH}.{i}.output.weight", np.ascontiguousarray(wts.out[i], dtype=np.float16))
        if shared:
            wr.add_tensor(f"{ARCH}.output.weight", np.ascontiguousarray(wts.out[0], dtype=np.float16))
        wr.add_tensor("d2t", np.ascontiguousarray(wts.d2t, dtype=np.int64), raw_dtype=GGMLQuantizationType.I64)
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
    return path


def _field(reader, key: str, path: Path, kind=int):
    f = reader.fields.get(key)
    if f is None:
        raise MedusaFormatError(f"{path} is not a Medusa heads file: it has no {key}")
    v = f.parts[f.data[0]]
    if kind is str:
        return bytes(v).decode("utf-8")
    return kind(v[0])


def _optional(reader, key: str, path: Path) -> str:
    """A string entry that may be absent (empty strings are not written)."""
    return _field(reader, key, path, str) if key in reader.fields else ""


def _refuse_architecture(path: Path, arch: str) -> None:
    """Raise the one-line error for a GGUF of another architecture than ``medusa``."""
    if arch == "eagle3":
        raise MedusaFormatError(f"{path} is an EAGLE-3 head, not Medusa heads: use it with --drafter eagle3 --eagle {path}")
    raise MedusaFormatError(f"{path} is a {arch} model, not Medusa heads (their architecture is medusa): "
                            f"a model drafts with --drafter draft --draft-model {path}")  # fmt: skip


def read_medusa_gguf(path: str | os.PathLike) -> MedusaWeights:
    """Load a Medusa heads GGUF.

    Raises:
        FileNotFoundError: no such file.
        MedusaFormatError: not a GGUF, not ``medusa``, missing keys / tensors, or shapes
            that disagree with the metadata.
    """
    from gguf import GGUFReader

    from .gguf_index import gguf_architecture

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Medusa heads file {path} does not exist")
    # the architecture first, from the header's first entry: gguf's reader parses every
    # key, and another model's tokenizer arrays (262,144 strings) took it 11 s to refuse
    arch = gguf_architecture(path)
    if arch is not None and arch != ARCH:
        _refuse_architecture(path, arch)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct.error / OSError on bad files
        raise MedusaFormatError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture", path, str)
    if arch != ARCH:
        _refuse_architecture(path, arch)
    k = _field(reader, f"{ARCH}.head_count", path)
    e = _field(reader, f"{ARCH}.embedding_length", path)
    v = _field(reader, f"{ARCH}.vocab_size", path)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise MedusaFormatError(f"{path} has no tensor {name}")
        a = np.asarray(t.data)
        if a.size != int(np.prod(shape)):
            raise MedusaFormatError(f"{path}: tensor {name} has {a.size} values, expected shape {shape}")
        return np.ascontiguousarray(a.reshape(shape), dtype=dtype)

    w = np.stack([get(f"{ARCH}.{i}.ffn.weight", (e, e), np.float32) for i in range(k)])
    b = np.stack([get(f"{ARCH}.{i}.ffn.bias", (e,), np.float32) for i in range(k)])
    if f"{ARCH}.output.weight" in tensors:
        out = get(f"{ARCH}.output.weight", (v, e), np.float32)[None]
    else:
        out = np.stack([get(f"{ARCH}.{i}.output.weight", (v, e), np.float32) for i in range(k)])
    d2t = get("d2t", (v,), np.int64)
    if not (np.isfinite(w).all() and np.isfinite(b).all() and np.isfinite(out).all()):
        raise MedusaFormatError(f"{path} holds non-finite weights")
    try:
        training = json.loads(_field(reader, f"{ARCH}.training", path, str))
    except (MedusaFormatError, ValueError):
        training = {}
    return MedusaWeights(
        w=w, b=b, out=out, d2t=d2t,
        softcap=_field(reader, f"{ARCH}.final_logit_softcapping", path, float),
        target_vocab_size=_field(reader, f"{ARCH}.target_vocab_size", path),
        target_vocab_sha256=_optional(reader, f"{ARCH}.target_vocab_sha256", path),
        target=_optional(reader, f"{ARCH}.target", path),
        training=training,
    )  # fmt: skip


@dataclass
class TargetReadout:
    """What the heads borrow from the target: its lm_head (rows on demand), soft-cap, EOG ids."""

    index: object
    name: str
    n_vocab: int
    n_embd: int
    softcap: float
    eog: list[int]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self.index.rows(self.name, np.asarray(ids, dtype=np.int64))


def read_target_readout(target) -> TargetReadout:
    from .gguf_index import GGUFIndex

    idx = GGUFIndex(target)
    v = idx.values
    arch = v["general.architecture"]
    eog = idx.eog_ids()
    return TargetReadout(idx, idx.lm_head_name(), idx.array_len("tokenizer.ggml.tokens"), int(v[f"{arch}.embedding_length"]),
                         float(v.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0), eog)  # fmt: skip


def untrained_heads(target, d2t: np.ndarray, n_heads: int = 4, seed: int | None = None, scale: float = 0.02):
    """``MedusaWeights`` straight from the target (``W_k = 0`` or small random with ``seed``,
    ``U_k`` = the lm_head rows of ``d2t``): for tests and as a baseline. Needs no torch."""
    tr = read_target_readout(target)
    d2t = np.asarray(d2t, dtype=np.int64)
    u0 = tr.rows(d2t)
    e = tr.n_embd
    if seed is None:
        w = np.zeros((n_heads, e, e), np.float32)
    else:
        w = (np.random.default_rng(seed).standard_normal((n_heads, e, e)) * scale).astype(np.float32)
    return MedusaWeights(w=w, b=np.zeros((n_heads, e), np.float32), out=u0[None],
                         d2t=d2t, softcap=tr.softcap, target_vocab_size=tr.n_vocab)  # fmt: skip


def stamp_for_target(wts: MedusaWeights, target) -> MedusaWeights:
    """Fill ``target_vocab_sha256`` / ``target`` from the target GGUF (its vocabulary only)."""
    from localspec.backend import Model

    m = Model(target, vocab_only=True)
    try:
        wts.target_vocab_sha256 = vocab_fingerprint(m, wts.d2t)
        wts.target_vocab_size = m.n_vocab
        wts.target = Path(target).name
    finally:
        m.close()
    return wts
