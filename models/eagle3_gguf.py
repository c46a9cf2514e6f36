"""Write EAGLE-3 draft heads as GGUF files for llama.cpp's ``eagle3`` architecture.

The layout is the one llama.cpp (as vendored by llama-cpp-python 0.3.36) loads; ``gguf``
0.19 has no ``MODEL_ARCH.EAGLE3``, so the keys and tensor names are written here:

=============================  ===============================  ==========================
tensor                         numpy shape (rows = outputs)     meaning
=============================  ===============================  ==========================
``fc.weight``                  [n_embd, 3 * n_embd_target]      fuses the 3 target features
``blk.0.attn_norm.weight``     [n_embd]                         RMSNorm of token embeddings
``blk.0.attn_norm_2.weight``   [n_embd]                         RMSNorm of the fused features
``blk.0.attn_q.weight``        [n_head * head_dim, 2 * n_embd]  attention over [emb ; feat]
``blk.0.attn_k.weight``        [n_head_kv * head_dim, 2 * n_embd]
``blk.0.attn_v.weight``        [n_head_kv * head_dim, 2 * n_embd]
``blk.0.attn_output.weight``   [n_embd, n_head * head_dim]
``blk.0.ffn_norm.weight``      [n_embd]
``blk.0.ffn_gate/up.weight``   [n_ff, n_embd]                   SwiGLU
``blk.0.ffn_down.weight``      [n_embd, n_ff]
``output_norm.weight``         [n_embd]
``output.weight``              [n_draft_vocab, n_embd]          draft-vocabulary lm_head
``d2t``                        [n_draft_vocab] int64            draft id -> **absolute** target id
=============================  ===============================  ==========================

Conventions a trainer must follow (llama.cpp's ``eagle3`` graph, ``src/models/eagle3.cpp``):

* Features: ``eagle3.target_layers = [k0, k1, k2]`` are layer ids whose **inputs** are read
  (the output of layer ``k - 1``), concatenated in that order into ``3 * n_embd_target``
  floats per position (``backend.features.FeatureTap`` produces exactly these rows).
* Decoder input at position ``P``: the token at ``P + 1`` and ``g_P`` (the ``fc`` output of
  the target features at ``P``, or, while drafting, the head's own pre-norm output at ``P``);
  it predicts the token at ``P + 2``.
* Token embeddings come **unscaled** from the target's ``token_embd`` (borrowed through
  ``ctx_other``; Gemma multiplies by sqrt(n_embd) in its own graph, EAGLE-3 does not), so
  the head's ``n_embd`` must equal the target's hidden size.
* ``fc.weight`` is stored in float32: it multiplies raw target hidden states, and Gemma 3's
  reach ~1e5, beyond float16 (llama.cpp would convert them to float16 for an F16 matrix and
  get infinities).
* RMSNorm weights are used as is (no Gemma-style ``1 + w``); RoPE is type NORM (adjacent
  pairs rotated, as in llama.cpp's Llama), so Q/K weights trained with Hugging Face's
  half-split rotary layout must be permuted like ``convert_hf_to_gguf.py`` does for Llama.
* ``norm_before_residual`` (default False): the residual around attention is the raw fused
  feature row, not its normalised form.
* The head GGUF carries the target's tokenizer (copied from the target GGUF).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ..paths import atomic_path
from .gguf_index import GGUFIndex

ARCH = "eagle3"


@dataclass(frozen=True)
class Eagle3Config:
    """Hyper-parameters of an EAGLE-3 head.

    Attributes:
        target_layers: the 3 target layer ids whose inputs are the features.
        n_embd_target: the target's hidden size (features are ``3 * n_embd_target`` wide).
        n_embd: the head's hidden size (must equal ``n_embd_target`` when the token
            embeddings are borrowed from the target, as here).
        n_head / n_head_kv / head_dim: attention heads, key/value heads, head size.
        n_ff: SwiGLU hidden size.
        n_ctx_train: longest context (positions) the head is meant for.
        rope_freq_base: RoPE base.
        rms_eps: RMSNorm epsilon.
        norm_before_residual: see the module docstring.
    """

    target_layers: tuple[int, int, int]
    n_embd_target: int
    n_embd: int
    n_head: int = 4
    n_head_kv: int = 1
    head_dim: int = 128
    n_ff: int = 2048
    n_ctx_train: int = 32768
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        if len(self.target_layers) != 3:
            raise ValueError("EAGLE-3 reads exactly 3 target layers")
        if self.n_embd != self.n_embd_target:
            raise ValueError("n_embd must equal the target's hidden size (the token embeddings are the target's)")
        if self.n_head % self.n_head_kv:
            raise ValueError("n_head must be a multiple of n_head_kv")


@dataclass
class Eagle3Weights:
    """The tensors of a head, as float arrays in ``[out, in]`` orientation (see the table in
    the module docstring); ``d2t`` holds absolute target token ids."""

    fc: np.ndarray
    attn_norm: np.ndarray
    hidden_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    output_norm: np.ndarray
    output: np.ndarray
    d2t: np.ndarray

    def check(self, cfg: Eagle3Config) -> None:
        """Raise ``ValueError`` when a shape does not match ``cfg``."""
        e, q, kv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        n_draft = self.d2t.shape[0]
        want = {
            "fc": (e, 3 * cfg.n_embd_target), "attn_norm": (e,), "hidden_norm": (e,),
            "wq": (q, 2 * e), "wk": (kv, 2 * e), "wv": (kv, 2 * e), "wo": (e, q),
            "ffn_norm": (e,), "w_gate": (cfg.n_ff, e), "w_up": (cfg.n_ff, e), "w_down": (e, cfg.n_ff),
            "output_norm": (e,), "output": (n_draft, e), "d2t": (n_draft,),
        }  # fmt: skip
        for f in fields(self):
            got = tuple(getattr(self, f.name).shape)
            if got != want[f.name]:
                raise ValueError(f"EAGLE-3 tensor {f.name}: shape {got}, expected {want[f.name]}")
        bad = d2t_problem(self.d2t)
        if bad is not None:
            raise ValueError(f"d2t {bad}; it must hold distinct, non-negative target token ids")


def d2t_problem(d2t) -> str | None:
    """What is wrong with a head's draft-vocabulary map (``d2t``: [V] target id of each draft
    id, EAGLE-3 and Medusa heads), or None: it must hold at least one id, every id non-negative
    and none twice (the draft distributions over it are kept by ascending target id, and the
    target verifies those ids). The ids' upper bound is the target's, checked against it.
    Writers raise ``ValueError`` with it, loaders ``ModelLoadError``
    (``drafters.vocab_check.check_draft_map``)."""
    d2t = np.asarray(d2t, dtype=np.int64).reshape(-1)
    if d2t.size == 0:
        return "is empty"
    if int(d2t.min()) < 0:
        return f"holds negative target ids ({int(d2t.min())})"
    n_twice = d2t.size - np.unique(d2t).size
    return f"holds {n_twice} target ids twice" if n_twice else None


_TENSOR_NAMES = {
    "fc": "fc.weight",
    "attn_norm": "blk.0.attn_norm.weight",
    "hidden_norm": "blk.0.attn_norm_2.weight",
    "wq": "blk.0.attn_q.weight",
    "wk": "blk.0.attn_k.weight",
    "wv": "blk.0.attn_v.weight",
    "wo": "blk.0.attn_output.weight",
    "ffn_norm": "blk.0.ffn_norm.weight",
    "w_gate": "blk.0.ffn_gate.weight",
    "w_up": "blk.0.ffn_up.weight",
    "w_down": "blk.0.ffn_down.weight",
    "output_norm": "output_norm.weight",
    "output": "output.weight",
}


def _target_reader(target) -> GGUFIndex:
    return target if isinstance(target, GGUFIndex) else GGUFIndex(target)


def _writer(out, arch: str):
    """A ``GGUFWriter`` that also takes raw entries (``gguf_edit.raw_writer``): the target's
    tokenizer is copied byte for byte instead of being decoded and re-encoded (262k strings)."""
    from .gguf_edit import raw_writer

    return raw_writer(out, arch)


def write_eagle3_gguf(
    out: str | os.PathLike,
    target,
    cfg: Eagle3Config,
    w: Eagle3Weights,
    *,
    matrix_dtype=np.float16,
    name: str = "EAGLE-3 head",
) -> Path:
    """Write a head GGUF that llama.cpp loads as architecture ``eagle3``.

    Args:
        out: the file to write.
        target: the target GGUF (path or a ``GGUFIndex``): its tokenizer entries are copied
            and ``d2t`` is checked against its vocabulary size.
        cfg / w: hyper-parameters and weights (shapes checked).
        matrix_dtype: storage type of the decoder and output matrices: ``"q8_0"``, ``"f16"``
            (or ``np.float16``, the default) or ``"f32"``; ``fc`` and the norms are always float32.
    Returns:
        ``out`` as a ``Path``.
    Raises:
        ValueError: shapes, ``d2t`` ids or target layers that do not fit the target.
    """
    from gguf import GGMLQuantizationType

    w.check(cfg)
    r = _target_reader(target)
    arch = r.values["general.architecture"]
    n_vocab = r.array_len("tokenizer.ggml.tokens")
    n_layer = int(r.values[f"{arch}.block_count"])
    if int(w.d2t.max()) >= n_vocab:
        raise ValueError(f"d2t holds id {int(w.d2t.max())} but the target vocabulary has {n_vocab} tokens")
    if not _distinct_readable(cfg.target_layers, n_layer):
        raise ValueError(f"target layers must be three distinct layers of 1..{n_layer - 1}, got {cfg.target_layers}")
    with atomic_path(out) as tmp:  # out never holds half a head (Ctrl-C, a full disk)
        wr = _writer(tmp, ARCH)
        wr.add_name(name)
        wr.add_uint32(f"{ARCH}.context_length", cfg.n_ctx_train)
        wr.add_uint32(f"{ARCH}.embedding_length", cfg.n_embd)
        wr.add_uint32(f"{ARCH}.block_count", 1)
        wr.add_uint32(f"{ARCH}.feed_forward_length", cfg.n_ff)
        wr.add_uint32(f"{ARCH}.attention.head_count", cfg.n_head)
        wr.add_uint32(f"{ARCH}.attention.head_count_kv", cfg.n_head_kv)
        wr.add_uint32(f"{ARCH}.attention.key_length", cfg.head_dim)
        wr.add_uint32(f"{ARCH}.attention.value_length", cfg.head_dim)
        wr.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
        wr.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_freq_base)
        wr.add_uint32(f"{ARCH}.rope.dimension_count", cfg.head_dim)
        wr.add_array(f"{ARCH}.target_layers", [int(k) for k in cfg.target_layers])
        wr.add_uint32(f"{ARCH}.target_hidden_size", cfg.n_embd_target)
        wr.add_bool(f"{ARCH}.norm_before_residual", cfg.norm_before_residual)
        for key, raw in r.raw.items():
            if key.startswith("tokenizer."):
                wr.add_raw(key, raw)
        for attr, tname in _TENSOR_NAMES.items():
            a = np.asarray(getattr(w, attr), dtype=np.float32)
            # fc multiplies raw target hidden states, which exceed the float16 range on some
            # models (Gemma 3's residual stream reaches ~1e5): keep it (and the norms) in float32
            if a.ndim == 1 or attr == "fc":
                wr.add_tensor(tname, a)
            else:
                _add_matrix(wr, tname, a, matrix_dtype)
        wr.add_tensor("d2t", np.asarray(w.d2t, dtype=np.int64), raw_dtype=GGMLQuantizationType.I64)
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
    return Path(out)


def _add_matrix(wr, name: str, a: np.ndarray, dtype) -> None:
    """Add a float32 matrix as ``dtype``: ``"q8_0"``, ``"f16"`` / ``np.float16`` or ``"f32"`` /
    ``np.float32``. Q8_0 needs rows whose length is a multiple of 32 (else float16 is used)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    kind = dtype.lower() if isinstance(dtype, str) else {"float16": "f16", "float32": "f32"}.get(np.dtype(dtype).name)
    if kind == "q8_0" and a.shape[-1] % 32 == 0:
        wr.add_tensor(name, quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    elif kind in ("f16", "q8_0"):
        wr.add_tensor(name, a.astype(np.float16))
    elif kind == "f32":
        wr.add_tensor(name, a)
    else:
        raise ValueError(f"matrix type {dtype!r}: use q8_0, f16 or f32")


def frequent_draft_vocab(target, size: int) -> np.ndarray:
    """A draft vocabulary without a corpus: the ``size`` normal tokens the target's
    SentencePiece/BPE scores rank most frequent, plus its end-of-generation tokens.

    Returns:
        [size] int64 sorted absolute target ids.
    """
    r = _target_reader(target)
    scores = np.asarray(r.values["tokenizer.ggml.scores"], dtype=np.float64)
    types = np.asarray(r.values["tokenizer.ggml.token_type"])
    eog = r.eog_ids()
    normal = np.flatnonzero(types == 1)
    if normal.size + len(eog) < size:
        raise ValueError(f"the target has only {normal.size} normal tokens; choose a smaller draft vocabulary")
    order = normal[np.lexsort((normal, -scores[normal]))]
    ids = np.unique(np.concatenate([np.asarray(eog, dtype=np.int64), order[: size - len(set(eog))]]))
    return ids[:size].astype(np.int64)


def prune_draft_vocab(head: str | os.PathLike, out: str | os.PathLike, target, counts: np.ndarray, size: int) -> Path:
    """Write ``head`` with its draft vocabulary cut to the ``size`` tokens that ``counts``
    ranks highest (ties: the lower draft id), keeping the target's end-of-generation tokens
    that the head has; every other weight unchanged (Q8_0 and float16 matrices are stored
    again in their type: Q8_0 blocks re-quantise to the same bytes).

    The cut head's greedy draft equals the whole head's wherever the whole head's argmax
    is kept, and a level's readout reads ``size / n_draft`` of the bytes (the readout is
    most of a level's weights: docs/drafters.md). ``counts`` should come from data like
    what the head drafts in use (the recipe: the target's top-1 on its answers).

    Args:
        head / out: the head GGUF to read (``read_eagle3_gguf``) and the one to write.
        target: the target GGUF (path or ``GGUFIndex``): tokenizer entries and eog ids.
        counts: ``[n_vocab]`` int or float, how often each target id is worth drafting.
        size: draft tokens to keep, at most the head's.
    Returns:
        ``out`` as a ``Path``.
    Raises:
        ValueError: ``size`` outside 1..n_draft, ``counts`` not over the target's vocabulary,
            or a head ``read_eagle3_gguf`` refuses or whose matrices mix storage types.
    """
    cfg, w, r, counts = _head_and_counts(head, target, counts)
    if not 1 <= size <= w.d2t.size:
        raise ValueError(f"the draft vocabulary can be cut to 1..{w.d2t.size} tokens, not {size}")
    score = counts[w.d2t].astype(np.float64)
    eog = r.eog_ids()
    score[np.isin(w.d2t, eog)] = np.inf
    keep = np.sort(np.argsort(-score, kind="stable")[:size])
    w.d2t, w.output = w.d2t[keep], w.output[keep]
    dtype, name = _matrix_storage(head)
    return write_eagle3_gguf(out, r, cfg, w, matrix_dtype=dtype, name=f"{name}, draft vocabulary cut to {size}")


def extend_draft_vocab(head: str | os.PathLike, out: str | os.PathLike, target, counts: np.ndarray, n_new: int) -> Path:
    """Write ``head`` with ``n_new`` more draft tokens: the target ids that ``counts`` ranks
    highest (ties: the lower id) among those with a count above 0 and not already in the draft
    vocabulary. Every other weight is unchanged.

    A new token's ``output`` row is the target's lm_head row mapped the way training moved the
    old rows (``readout_map``): every row starts as the target's own (``eagle3_train.
    init_from_target``) and training turns them as a whole. On the shipped head (2026-12-06)
    the trained rows keep a cosine of only 0.58 to the target's, while one linear map fitted
    on 3,500 of them predicts the other 596 at a cosine of 0.92. The target's rows taken as
    they are drafted worse than no new tokens (bare Spec-Bench translation, 4,096 German
    tokens added: mean acceptance 1.13 against 1.23 with chains of 6).

    Args:
        head / out: the head GGUF to read (``read_eagle3_gguf``) and the one to write.
        target: the target GGUF (path or ``GGUFIndex``): its lm_head (or tied token
            embeddings) and tokenizer entries.
        counts: ``[n_vocab]`` int or float, how often each target id is worth drafting (the
            recipe: the target's top-1 on answers in the languages added).
        n_new: tokens to add, at least 1; fewer are added when fewer have a count.
    Returns:
        ``out`` as a ``Path``.
    Raises:
        ValueError: ``n_new`` below 1, ``counts`` not over the target's vocabulary, no token
            to add, or a head ``read_eagle3_gguf`` refuses or whose matrices mix storage types.
    """
    cfg, w, r, counts = _head_and_counts(head, target, counts)
    if n_new < 1:
        raise ValueError(f"n_new must be at least 1, not {n_new}")
    new = draft_tokens_to_add(w.d2t, counts, n_new)
    if new.size == 0:
        raise ValueError("no token to add: every counted token is already in the draft vocabulary")
    lm_head = r.lm_head_name()
    a = readout_map(w.output, r.rows(lm_head, w.d2t))
    d2t = np.concatenate([w.d2t, new])
    rows = np.concatenate([w.output, (r.rows(lm_head, new) @ a).astype(np.float32)])
    perm = np.argsort(d2t, kind="stable")
    w.d2t, w.output = d2t[perm], rows[perm]
    dtype, name = _matrix_storage(head)
    return write_eagle3_gguf(out, r, cfg, w, matrix_dtype=dtype, name=f"{name}, {new.size} draft tokens added")


def draft_tokens_to_add(d2t: np.ndarray, counts: np.ndarray, n_new: int) -> np.ndarray:
    """Sorted int64 target ids: the at most ``n_new`` ids outside ``d2t`` that ``counts`` ranks
    highest (ties: the lower id), among those with a count above 0 (``extend_draft_vocab``'s
    choice; empty when the draft vocabulary already holds every counted id)."""
    score = np.asarray(counts, dtype=np.float64).copy()
    score[d2t] = 0.0
    order = np.argsort(-score, kind="stable")
    return np.sort(order[: min(n_new, int((score > 0).sum()))]).astype(np.int64)


def readout_map(trained: np.ndarray, target_rows: np.ndarray, ridge: float = 0.1) -> np.ndarray:
    """The linear map from the target's lm_head rows to a trained head's readout rows: the
    ``[n_embd, n_embd]`` float64 ``A`` minimising ``||target_rows @ A - trained||^2 + ridge
    ||A||^2`` (ridge regression, least squares over the draft tokens).

    Args:
        trained: ``[n_draft, n_embd]`` the head's ``output`` rows.
        target_rows: ``[n_draft, n_embd]`` the target's lm_head rows of the same tokens.
        ridge: the penalty on ``A``'s squares (0.1: the best of 0-10 at predicting held-out
            rows of the shipped head, 2026-12-06).
    Raises:
        ValueError: the two do not have the same shape.
    """
    x, y = np.asarray(target_rows, np.float64), np.asarray(trained, np.float64)
    if x.shape != y.shape:
        raise ValueError(f"trained rows {y.shape} and target rows {x.shape} differ in shape")
    return np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)


def _head_and_counts(head, target, counts) -> tuple[Eagle3Config, Eagle3Weights, GGUFIndex, np.ndarray]:
    """``read_eagle3_gguf(head)``, the target's reader and ``counts`` as an array.

    Raises:
        ValueError: ``counts`` not one entry per target token (or what ``read_eagle3_gguf``
            raises)."""
    cfg, w = read_eagle3_gguf(head)
    r = _target_reader(target)
    n_vocab = r.array_len("tokenizer.ggml.tokens")
    counts = np.asarray(counts)
    if counts.shape != (n_vocab,):
        raise ValueError(f"counts must have one entry per target token ({n_vocab}), got shape {counts.shape}")
    return cfg, w, r, counts


def _matrix_storage(head: str | os.PathLike) -> tuple[str, str]:
    """``(matrix_dtype, general.name)`` of a head GGUF, for writing it again in its type.

    Raises:
        ValueError: matrices stored in more than one type."""
    from gguf import GGMLQuantizationType

    idx = GGUFIndex(head)
    qtypes = {idx.tensors[n].qtype for a, n in _TENSOR_NAMES.items() if a != "fc" and len(idx.tensors[n].shape) == 2}
    if len(qtypes) != 1:
        raise ValueError(f"{head}: its matrices are stored in {len(qtypes)} types; only heads with one type "
                         "can be rewritten")  # fmt: skip
    dtype = {GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.F32: "f32"}.get(qtypes.pop(), "f16")
    return dtype, idx.values.get("general.name", "EAGLE-3 head")


def default_target_layers(n_layer: int) -> tuple[int, int, int]:
    """EAGLE-3's usual feature layers (low, middle, high): ``(2, n_layer // 2, n_layer - 3)``
    (the EAGLE repository's and SpecForge's choice). Where those are not three distinct
    readable layers (targets of fewer than 8 layers: 6 gives ``(2, 3, 3)``), the first, the
    middle and the last readable one, ``(1, n_layer // 2, n_layer - 1)``.

    Raises:
        ValueError: fewer than 4 layers (three distinct inputs of layers ``1 .. n_layer - 1``).
    """
    if n_layer < 4:
        raise ValueError(f"an EAGLE-3 head reads three distinct layers of 1..n_layer - 1: the target has {n_layer} layers, it needs 4 or more")
    usual = (2, n_layer // 2, n_layer - 3)
    return usual if _distinct_readable(usual, n_layer) else (1, n_layer // 2, n_layer - 1)


def _distinct_readable(layers, n_layer: int) -> bool:
    """Three distinct layer ids whose inputs can be read (``1 .. n_layer - 1``)."""
    return len(set(layers)) == 3 and all(1 <= k < n_layer for k in layers)


def random_eagle3(
    target: str | os.PathLike,
    out: str | os.PathLike,
    *,
    draft_vocab: int = 8192,
    seed: int = 0,
    n_head: int = 4,
    head_dim: int = 128,
    n_ff: int = 2048,
) -> Path:
    """An untrained EAGLE-3 head for ``target`` (random weights, std 0.02; norms 1).

    It runs end to end like a trained head and every speculative path stays lossless, but
    its drafts are almost never accepted. For tests and plumbing, not for speed.
    """
    r = _target_reader(target)
    arch = r.values["general.architecture"]
    n_embd = int(r.values[f"{arch}.embedding_length"])
    n_layer = int(r.values[f"{arch}.block_count"])
    n_ctx = int(r.values[f"{arch}.context_length"])
    cfg = Eagle3Config(
        target_layers=default_target_layers(n_layer),
        n_embd_target=n_embd,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=1,
        head_dim=head_dim,
        n_ff=n_ff,
        n_ctx_train=n_ctx,
    )
    rng = np.random.default_rng(seed)
    d2t = frequent_draft_vocab(r, draft_vocab)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    q, kv = n_head * head_dim, head_dim
    ones = np.ones(n_embd, dtype=np.float32)
    w = Eagle3Weights(
        fc=mat(n_embd, 3 * n_embd), attn_norm=ones, hidden_norm=ones,
        wq=mat(q, 2 * n_embd), wk=mat(kv, 2 * n_embd), wv=mat(kv, 2 * n_embd), wo=mat(n_embd, q),
        ffn_norm=ones, w_gate=mat(n_ff, n_embd), w_up=mat(n_ff, n_embd), w_down=mat(n_embd, n_ff),
        output_norm=ones, output=mat(d2t.size, n_embd), d2t=d2t,
    )  # fmt: skip
    return write_eagle3_gguf(out, r, cfg, w, name=f"random EAGLE-3 head (seed {seed})")


def read_eagle3_gguf(path: str | os.PathLike) -> tuple[Eagle3Config, Eagle3Weights]:
    """A head GGUF written by ``write_eagle3_gguf`` (architecture ``eagle3`` with ``d2t``, no
    token embeddings of its own) as float32 weights and its hyper-parameters: what training
    continues from (``train-eagle3 --from-usage``).

    Raises:
        ValueError: not such a head (another architecture, no ``d2t``, its own token
            embeddings, ``norm_before_fc``), or shapes that do not match its keys.
    """
    r = GGUFIndex(path)
    v = r.values
    if v.get("general.architecture") != ARCH:
        raise ValueError(f"{path} is not an EAGLE-3 head (architecture {v.get('general.architecture')!r})")
    if "d2t" not in r.tensors or "token_embd.weight" in r.tensors or v.get(f"{ARCH}.norm_before_fc"):
        raise ValueError(f"{path}: only heads written by localspec (d2t, the target's embeddings) can be trained further")
    cfg = Eagle3Config(
        target_layers=tuple(int(k) for k in v[f"{ARCH}.target_layers"]),
        n_embd_target=int(v[f"{ARCH}.target_hidden_size"]), n_embd=int(v[f"{ARCH}.embedding_length"]),
        n_head=int(v[f"{ARCH}.attention.head_count"]), n_head_kv=int(v[f"{ARCH}.attention.head_count_kv"]),
        head_dim=int(v[f"{ARCH}.attention.key_length"]), n_ff=int(v[f"{ARCH}.feed_forward_length"]),
        n_ctx_train=int(v[f"{ARCH}.context_length"]), rope_freq_base=float(v[f"{ARCH}.rope.freq_base"]),
        rms_eps=float(v[f"{ARCH}.attention.layer_norm_rms_epsilon"]),
        norm_before_residual=bool(v.get(f"{ARCH}.norm_before_residual", False)),
    )  # fmt: skip
    w = Eagle3Weights(d2t=np.array(r.data("d2t"), dtype=np.int64),
                      **{attr: r.rows(name) for attr, name in _TENSOR_NAMES.items()})  # fmt: skip
    w.check(cfg)
    return cfg, w
