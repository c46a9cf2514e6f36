"""Training data for EAGLE-3 heads: the target's features and next-token targets, on disk.

A head learns to predict what *this* target says next from the target's own hidden states.
For every token of every training sequence this module records, through llama.cpp and the
same ``FeatureTap`` (``cb_eval`` on ``l_out-(k-1)``) the runtime uses:

* ``feats``: the inputs of the head's three target layers, ``[3 * n_embd]`` per token (the
  row the runtime feeds the head's encoder at that position);
* ``topk_ids`` / ``topk_logits``: the target's ``k`` highest next-token logits at that position
  (a full distribution is 1 MiB per token on a 262k vocabulary; the trainer renormalises the
  top-k over the draft vocabulary anyway).

Sequences come from the user's text/code files (chunks of ``seq_len`` tokens) and from
**self-distillation**: prompts cut from the same files, continued greedily by the target
(``gen_tokens`` new tokens each, many sequences per batched decode), so the head sees what the
target itself writes. Features and targets of generated tokens are captured while they are
generated (no second pass).

Shards (``shard-00000.npz`` ...) hold whole sequences; the work plan (``plan.npz``) is fixed
on the first run, so a rerun with the same directory skips finished shards (resume).
Features are stored as float16 scaled per row and layer (``feats_scale``): Gemma 3's residual
stream reaches ~1e5, beyond float16's range.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sysconfig
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".sh", ".json", ".toml", ".cfg", ".ini", ".html", "")
PLAN_VERSION = 1
HARVEST_SHARE = 0.4
"""Share of the time left before ``prepare_data``'s ``deadline`` that harvesting self-written
prompts may take; the rest is for answering them (a harvest that ran to the deadline left no
time to record a single answer)."""


# -- corpus --------------------------------------------------------------------------------


def _read_text(path: Path, max_bytes: int) -> str | None:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read(max_bytes)
        else:
            with path.open("rb") as f:
                raw = f.read(max_bytes)
    except (OSError, EOFError):
        return None
    if b"\0" in raw[:4096]:
        return None  # binary
    return raw.decode("utf-8", errors="replace")


def iter_text_files(paths: Iterable[str | os.PathLike], *, max_bytes: int = 1 << 20) -> Iterable[tuple[str, str]]:
    """``(path, text)`` for every readable text file under ``paths`` (files or folders, searched
    recursively, sorted), ``.gz`` files decompressed; binaries and unknown suffixes skipped.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    for p in paths:
        p = Path(p).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"training data not found: {p}")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
        for f in files:
            inner = f.with_suffix("") if f.suffix == ".gz" else f
            if f != p and inner.suffix.lower() not in TEXT_SUFFIXES:
                continue
            text = _read_text(f, max_bytes)
            if text and text.strip():
                yield str(f), text


def stdlib_sources() -> list[Path]:
    """The Python standard library's sources (with their docstrings): text that every machine
    with Python has. Installed packages (``site-packages``) and the test suite are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "__pycache__", "idlelib", "config-3"}
    return sorted(p for p in root.iterdir() if not any(p.name.startswith(s) for s in skip))


# -- records and shards --------------------------------------------------------------------


@dataclass
class SequenceRecord:
    """Everything recorded for one sequence of ``n`` tokens.

    Attributes:
        tokens: [n] int32 token ids (position ``i`` holds token ``i``).
        feats: [n, 3 * n_embd] float32 target features at each position.
        topk_ids: [n, k] int32 the target's top-k next-token ids at each position (best first).
        topk_logits: [n, k] float32 their raw logits.
        n_prompt: leading tokens that were given (the rest the target generated).
    """

    tokens: np.ndarray
    feats: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    n_prompt: int


def _scale_rows(feats: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [n, B * E] -> (float16 [n, B * E], float32 [n, B]) with ``x = half * scale``."""
    n, w = feats.shape
    blocks = feats.reshape(n, n_blocks, w // n_blocks)
    scale = np.maximum(np.abs(blocks).max(axis=2), 1e-30) / 32768.0  # [n, B]
    half = (blocks / scale[:, :, None]).astype(np.float16).reshape(n, w)
    return half, scale.astype(np.float32)


def write_shard(path: Path, records: Sequence[SequenceRecord], n_blocks: int = 3, restricted: bool = False) -> None:
    """Save ``records`` as one ``.npz`` (written to a temporary name, then renamed).
    ``restricted``: the top-k is over the draft vocabulary only (``TeacherForcedRecorder``)."""
    lengths = np.array([r.tokens.size for r in records], dtype=np.int64)
    feats = np.concatenate([r.feats for r in records])
    half, scale = _scale_rows(feats, n_blocks)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        lengths=lengths,
        n_prompt=np.array([r.n_prompt for r in records], dtype=np.int64),
        tokens=np.concatenate([r.tokens for r in records]).astype(np.int32),
        feats=half,
        feats_scale=scale,
        topk_ids=np.concatenate([r.topk_ids for r in records]).astype(np.int32),
        topk_logits=np.concatenate([r.topk_logits for r in records]).astype(np.float16),
        restricted=np.array(bool(restricted)),
    )
    os.replace(tmp, path)


@dataclass
class Shard:
    """A loaded shard: arrays over all its tokens plus sequence boundaries.

    Attributes:
        starts: [n_seq + 1] int64 offsets of the sequences in the token arrays.
        tokens: [N] int32; feats: [N, 3 * n_embd] float16 (times ``feats_scale``);
        feats_scale: [N, 3] float32; topk_ids: [N, k] int32; topk_logits: [N, k] float16.
    """

    starts: np.ndarray
    tokens: np.ndarray
    feats: np.ndarray
    feats_scale: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    restricted: bool = False  # top-k over the draft vocabulary only (teacher-forced text)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    def features(self, lo: int, hi: int) -> np.ndarray:
        """Float32 features of tokens ``lo .. hi - 1``: [hi - lo, 3 * n_embd]."""
        f = self.feats[lo:hi].astype(np.float32)
        n_blocks = self.feats_scale.shape[1]
        return (f.reshape(hi - lo, n_blocks, -1) * self.feats_scale[lo:hi, :, None]).reshape(hi - lo, -1)


def load_shard(path: str | os.PathLike) -> Shard:
    with np.load(path) as z:
        lengths = z["lengths"]
        return Shard(
            starts=np.concatenate([[0], np.cumsum(lengths)]),
            tokens=z["tokens"], feats=z["feats"], feats_scale=z["feats_scale"],
            topk_ids=z["topk_ids"], topk_logits=z["topk_logits"],
            restricted=bool(z["restricted"]) if "restricted" in z.files else False,
        )  # fmt: skip


def answer_top1_counts(shard_files, n_vocab: int) -> np.ndarray:
    """How often each target id is the target's top-1 on the **answers** of recorded prompt +
    greedy-answer shards (positions from each sequence's ``n_prompt`` on; shards restricted
    to a draft vocabulary or without ``n_prompt`` are skipped): the tokens a drafter is asked
    for in use (``eagle3_gguf.prune_draft_vocab``'s counts).

    Returns:
        ``[n_vocab]`` int64.
    """
    counts = np.zeros(n_vocab, dtype=np.int64)
    for p in shard_files:
        with np.load(p) as z:
            if "n_prompt" not in z.files or ("restricted" in z.files and bool(z["restricted"])):
                continue
            lengths, n_prompt, top1 = z["lengths"], z["n_prompt"], z["topk_ids"][:, 0]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        answer = np.zeros(top1.size, dtype=bool)
        for lo, hi, k in zip(starts[:-1], starts[1:], n_prompt):
            answer[lo + int(k) : hi] = True
        counts += np.bincount(top1[answer].astype(np.int64), minlength=n_vocab)[:n_vocab]
    return counts


def shard_paths(data_dir: str | os.PathLike) -> list[Path]:
    """Finished shards of a data directory, in order."""
    return sorted(Path(data_dir).glob("shard-[0-9][0-9][0-9][0-9][0-9].npz"))


# -- the recorder --------------------------------------------------------------------------


class FeatureRecorder:
    """Runs the target through llama.cpp and records ``SequenceRecord``s.

    Args:
        target: the target GGUF path.
        layers: the head's target layer ids (``eagle3.target_layers``).
        topk: next-token candidates kept per position.
        n_ctx: KV cells (all generation sequences together).
        n_seq: sequences generated in parallel.
        n_threads: llama.cpp threads (default: all).
    """

    def __init__(self, target, layers: Sequence[int], *, topk: int = 8, n_ctx: int = 8192, n_seq: int = 16,
                 n_batch: int = 256, n_threads: int | None = None) -> None:  # fmt: skip
        from localspec.backend import Batch, Context, Model
        from localspec.backend.features import FeatureTap

        self.model = Model(target)
        self.tap = FeatureTap(layers, self.model.n_layer, self.model.n_embd)
        # a unified KV cache: with one stream per sequence llama.cpp splits a generation step
        # into one micro-batch per sequence (measured ~8x slower here)
        self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq, n_threads=n_threads,
                           cb_eval=self.tap.callback, cb_eval_user_data=self.tap.user_data)  # fmt: skip
        self.batch = Batch(n_batch, 1)
        self.topk = int(topk)
        self.n_seq = int(n_seq)
        self.eog = np.array(sorted(self.model.eog_ids), dtype=np.int64)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def _topk(self) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of the last decode's logits rows: ([n, k] int32, [n, k] float32)."""
        import torch

        logits = torch.from_numpy(self.ctx.logits())  # [n_outputs, n_vocab] float32, a view
        v, i = torch.topk(logits, self.topk, dim=1)
        return i.numpy().astype(np.int32), v.numpy()

    def _prefill(self, tokens: Sequence[int], seq_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode ``tokens`` from position 0 into ``seq_id`` with logits for every row."""
        feats, ids, logits = [], [], []
        nb = self.batch.capacity
        for i0 in range(0, len(tokens), nb):
            chunk = tokens[i0 : i0 + nb]
            self.batch.set_sequence(chunk, i0, seq_id=seq_id, output="all")
            self.ctx.decode(self.batch)
            feats.append(self.tap.take())
            i, v = self._topk()
            ids.append(i)
            logits.append(v)
        return np.concatenate(feats), np.concatenate(ids), np.concatenate(logits)

    def record_text(self, tokens: Sequence[int]) -> SequenceRecord:
        """Features and targets of a given token sequence (one prefill, logits for all rows)."""
        self.ctx.clear()
        self.tap.clear()
        f, i, v = self._prefill(list(tokens), 0)
        return SequenceRecord(np.asarray(tokens, dtype=np.int32), f, i, v, n_prompt=len(tokens))

    def record_generated(self, prompts: Sequence[Sequence[int]], gen_tokens: int) -> list[SequenceRecord]:
        """Greedy continuations of ``prompts`` (at most ``n_seq`` of them, generated together):
        features and targets of prompt and generated tokens alike. A sequence stops at an
        end-of-generation token (which is kept as its last token)."""
        from localspec.backend import Batch

        if len(prompts) > self.n_seq:
            raise ValueError(f"at most {self.n_seq} prompts at once")
        self.ctx.clear()
        self.tap.clear()
        toks = [list(p) for p in prompts]
        parts = [[] for _ in prompts]  # per sequence: list of (feats, ids, logits) blocks
        nxt = []
        for s, p in enumerate(toks):
            f, i, v = self._prefill(p, s)
            parts[s].append((f, i, v))
            nxt.append(int(i[-1, 0]))
        live = [s for s in range(len(toks)) if nxt[s] not in self.eog]
        b = Batch(max(1, len(toks)), 1)
        for _ in range(gen_tokens):
            if not live:
                break
            n = len(live)
            b.token[:n] = [nxt[s] for s in live]
            b.pos[:n] = [len(toks[s]) for s in live]
            b.n_seq_id[:n] = 1
            b.seq_id[:n, 0] = live
            b.output[:n] = 1
            b.n_tokens = n
            self.ctx.decode(b)
            f = self.tap.take()
            i, v = self._topk()
            still = []
            for j, s in enumerate(live):
                toks[s].append(nxt[s])
                parts[s].append((f[j : j + 1], i[j : j + 1], v[j : j + 1]))
                nxt[s] = int(i[j, 0])
                if nxt[s] not in self.eog:
                    still.append(s)
            live = still
        out = []
        for s, p in enumerate(prompts):
            f, i, v = (np.concatenate([blk[c] for blk in parts[s]]) for c in range(3))
            out.append(SequenceRecord(np.asarray(toks[s], dtype=np.int32), f, i, v, n_prompt=len(p)))
        return out


class _FinalNormTap:
    """A ``FeatureTap`` that also captures the target's final-norm output (``result_norm``, the
    lm_head's input) and then ends the graph: ``cb_eval`` returning False makes the scheduler
    skip the remaining nodes, which after ``result_norm`` are only the lm_head (``result_output``).
    Every KV write and every layer has run by then; llama.cpp still reports success and copies
    an output buffer whose contents are stale (never read)."""

    NAME = b"result_norm"

    def __init__(self, layers: Sequence[int], n_layer: int, n_embd: int) -> None:
        from localspec.backend import _llama
        from localspec.backend.features import _NAME_OFFSET, FeatureTap
        from localspec.backend.tensor import GgmlTensor

        self.tap = FeatureTap(layers, n_layer, n_embd, native=False)  # its Python callback, wrapped here
        self._inner = self.tap._on_eval
        self._name_offset, self._tensor, self._get = _NAME_OFFSET, GgmlTensor, _llama.ggml_tensor_get
        self.n_embd = int(n_embd)
        self.norm: list[np.ndarray] = []
        self.callback = _llama.lib.ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, t_ptr: int, ask: bool, user_data) -> bool:
        import ctypes

        try:
            if ctypes.string_at(t_ptr + self._name_offset) != self.NAME:
                return self._inner(t_ptr, ask, user_data)
            if ask:
                return True
            t = self._tensor.from_address(t_ptr)
            out = np.empty((int(t.ne[1]), self.n_embd), dtype=np.float32)
            self._get(t_ptr, out.ctypes.data, 0, out.nbytes)
            self.norm.append(out)
            return False  # stop: the lm_head is not computed
        except Exception:  # never raise into C
            return not ask

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """(features [n, width], final-norm rows [n, n_embd]) since the last take."""
        f = self.tap.take()
        h = np.concatenate(self.norm) if self.norm else np.zeros((0, self.n_embd), np.float32)
        self.norm = []
        if h.shape[0] != f.shape[0]:
            raise RuntimeError(f"captured {f.shape[0]} feature rows but {h.shape[0]} final-norm rows")
        return f, h

    def clear(self) -> None:
        self.tap.clear()
        self.norm = []


class TeacherForcedRecorder:
    """Records given text fast: one prefill per chunk, the target's distribution computed only
    over the draft vocabulary.

    For a sequence of tokens (teacher forcing: the text's own tokens, not the target's choices)
    one ``llama_decode`` with every row an output runs the target's layers; the tap captures the
    head's three feature layers and the final-norm rows and stops the graph before the 262k-row
    lm_head (~64% of the target's multiply-adds on Gemma 3 270M). The logits of the draft
    vocabulary are then ``result_norm @ W[d2t].T`` in float32 (``W`` the target's lm_head,
    dequantised from the GGUF; the target's final logit soft-capping applied when it has one),
    ranked in torch. Compared with ``FeatureRecorder.record_text`` on the same text the features
    are identical and the logits agree up to llama.cpp's quantised matrix product (its
    activations are rounded to 8 bits; ``tests/test_eagle3_train.py`` bounds the difference);
    the top-k is the top-k *of the draft vocabulary*, not of the whole vocabulary, so a position
    whose full-vocabulary top-1 lies outside ``d2t`` is recorded with the best in-vocabulary
    token as its top-1 (shards say so: ``restricted``).

    Args:
        target: the target GGUF path.
        layers: the head's target layer ids.
        d2t: [n_draft] int64 target ids of the draft vocabulary.
        topk: candidates kept per position.
        n_batch: tokens per decode (the longest chunk).
        n_threads: llama.cpp threads (default: all).
    """

    def __init__(self, target, layers: Sequence[int], d2t: np.ndarray, *, topk: int = 8, n_batch: int = 512,
                 n_threads: int | None = None) -> None:  # fmt: skip
        import torch

        from localspec.backend import Batch, Context, Model

        from ..gguf_index import GGUFIndex

        self.model = Model(target)
        self.tap = _FinalNormTap(layers, self.model.n_layer, self.model.n_embd)
        self.ctx = Context(self.model, n_ctx=max(n_batch, 256), n_batch=n_batch, n_seq_max=1, n_threads=n_threads,
                           cb_eval=self.tap.callback)  # fmt: skip
        self.batch = Batch(n_batch, 1)
        self.topk = int(topk)
        self.d2t = np.asarray(d2t, dtype=np.int64)
        idx = GGUFIndex(target)
        self.w = torch.from_numpy(np.ascontiguousarray(idx.rows(idx.lm_head_name(), self.d2t), dtype=np.float32))  # [V_d, E]
        arch = idx.values["general.architecture"]
        self.softcap = float(idx.values.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def draft_logits(self, h: np.ndarray):
        """[n, n_embd] final-norm rows -> [n, n_draft] float32 torch logits."""
        import torch

        z = torch.from_numpy(h) @ self.w.T
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def record_text(self, tokens: Sequence[int]) -> SequenceRecord:
        """Features and draft-vocabulary top-k of ``tokens`` (at most ``n_batch`` of them),
        ``topk_ids`` as target ids."""
        import torch

        tokens = list(tokens)
        if len(tokens) > self.batch.capacity:
            raise ValueError(f"{len(tokens)} tokens exceed the batch capacity {self.batch.capacity}")
        self.ctx.clear()
        self.tap.clear()
        self.batch.set_sequence(tokens, 0, seq_id=0, output="all")
        self.ctx.decode(self.batch)
        f, h = self.tap.take()
        v, i = torch.topk(self.draft_logits(h), self.topk, dim=1)
        ids = self.d2t[i.numpy()].astype(np.int32)
        return SequenceRecord(np.asarray(tokens, dtype=np.int32), f, ids, v.numpy(), n_prompt=len(tokens))


def text_token_counts(plan: "DataPlan", n_vocab: int) -> np.ndarray:
    """[n_vocab] int64 occurrences of each token in the plan's text chunks (BOS excluded)."""
    toks = [np.asarray(t[1:], dtype=np.int64) for jobs in plan.shards for k, t in jobs if k == "text"]
    return np.bincount(np.concatenate(toks) if toks else np.zeros(0, np.int64), minlength=n_vocab)


def record_text_plan(
    target,
    data_dir: str | os.PathLike,
    plan: "DataPlan",
    layers: Sequence[int],
    d2t: np.ndarray,
    *,
    topk: int = 8,
    n_threads: int | None = None,
    progress: bool = True,
    deadline: float | None = None,
) -> list[Path]:
    """Record the text chunks of ``plan`` with ``TeacherForcedRecorder`` into shards (resumable
    and bounded by ``deadline`` like ``extract``). ``d2t`` is stored in ``data_dir/d2t.npy`` on
    the first run and must match on later ones.

    Raises:
        ValueError: the plan holds self-distillation jobs (use ``extract``), or ``d2t`` differs
            from the one the folder was recorded with.
    """
    from tqdm.auto import tqdm

    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(k != "text" for jobs in plan.shards for k, _ in jobs):
        raise ValueError("record_text_plan records text chunks only")
    d2t = np.asarray(d2t, dtype=np.int64)
    d2t_path = out / "d2t.npy"
    if d2t_path.exists():
        if not np.array_equal(np.load(d2t_path), d2t):
            raise ValueError(f"{out} was recorded with another draft vocabulary")
    else:
        np.save(d2t_path, d2t)
    todo = [i for i in range(len(plan.shards)) if not (out / f"shard-{i:05d}.npz").exists()]
    if todo and (deadline is None or time.time() < deadline):
        n_batch = max(len(t) for jobs in plan.shards for _, t in jobs)
        rec = TeacherForcedRecorder(target, layers, d2t, topk=topk, n_batch=n_batch, n_threads=n_threads)
        bar = tqdm(total=sum(len(t) for i in todo for _, t in plan.shards[i]), unit="tok", desc="text features",
                   disable=not progress)  # fmt: skip
        try:
            for i in todo:
                if deadline is not None and time.time() >= deadline:
                    break
                records = []
                for _, toks in plan.shards[i]:
                    records.append(rec.record_text(toks))
                    bar.update(len(toks))
                write_shard(out / f"shard-{i:05d}.npz", records, restricted=True)
        finally:
            bar.close()
            rec.close()
    return [out / f"shard-{i:05d}.npz" for i in range(len(plan.shards)) if (out / f"shard-{i:05d}.npz").exists()]


# -- the work plan -------------------------------------------------------------------------


@dataclass
class DataPlan:
    """What each shard holds: lists of text chunks and of self-distillation prompts.

    ``shards[i]`` is a list of jobs ``(kind, tokens)`` with kind ``"text"`` (record the tokens
    as they are) or ``"gen"`` (continue the prompt for ``gen_tokens`` tokens).
    """

    shards: list[list[tuple[str, list[int]]]]
    gen_tokens: int
    meta: dict

    def save(self, path: Path) -> None:
        arrays, kinds, lens = [], [], []
        for s, jobs in enumerate(self.shards):
            for kind, toks in jobs:
                kinds.append((s, 0 if kind == "text" else 1))
                lens.append(len(toks))
                arrays.append(np.asarray(toks, dtype=np.int32))
        tmp = path.with_suffix(".tmp.npz")
        np.savez(
            tmp,
            shard_kind=np.array(kinds, dtype=np.int64).reshape(-1, 2),
            lengths=np.array(lens, dtype=np.int64),
            tokens=np.concatenate(arrays) if arrays else np.zeros(0, np.int32),
            n_shards=np.array(len(self.shards)),
            gen_tokens=np.array(self.gen_tokens),
            meta=np.array(json.dumps(self.meta)),
        )
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "DataPlan":
        with np.load(path) as z:
            shards: list[list[tuple[str, list[int]]]] = [[] for _ in range(int(z["n_shards"]))]
            off = 0
            tokens = z["tokens"]  # read once: each z[...] decompresses the whole array again
            for (s, k), n in zip(z["shard_kind"], z["lengths"]):
                shards[int(s)].append(("text" if k == 0 else "gen", tokens[off : off + n].tolist()))
                off += int(n)
            return cls(shards, int(z["gen_tokens"]), json.loads(str(z["meta"])))

    @staticmethod
    def read_meta(path: Path) -> dict:
        """The ``meta`` of the plan saved at ``path``, without reading its token sequences."""
        with np.load(path) as z:
            return json.loads(str(z["meta"]))


def make_plan(
    model,
    texts: Iterable[tuple[str, str]],
    *,
    max_tokens: int,
    seq_len: int = 512,
    self_distill: int = 0,
    prompt_tokens: int = 128,
    gen_tokens: int = 256,
    shard_tokens: int = 32768,
    seed: int = 0,
    chat_prompts: Sequence[Sequence[int]] = (),
) -> DataPlan:
    """Cut the corpus into jobs and group them into shards.

    Args:
        model: the target ``Model`` (tokeniser).
        texts: ``(name, text)`` pairs (``iter_text_files``).
        max_tokens: corpus tokens to record as text chunks (documents are taken in a seeded
            random order until this many are collected).
        seq_len: tokens per text chunk (each chunk starts with the target's BOS, if it has one).
        self_distill: number of self-distillation prompts (cut from the same documents:
            ``prompt_tokens`` tokens from a random place in a document not used as text).
        gen_tokens: tokens the target generates per prompt.
        shard_tokens: approximate tokens per shard.
        chat_prompts: further self-distillation prompts as token ids, used as they are (the
            target's own chat- and code-like requests, ``self_prompts``).
    """
    rng = np.random.default_rng(seed)
    docs = list(texts)
    order = rng.permutation(len(docs))
    bos = [model.bos] if getattr(model, "add_bos", False) and model.bos >= 0 else []
    chunks: list[list[int]] = []
    prompts: list[list[int]] = []
    n_text = 0
    for d in order:
        name, text = docs[int(d)]
        if n_text < max_tokens:
            ids = model.tokenize(text, add_special=False)
            for i0 in range(0, len(ids), seq_len - len(bos)):
                piece = ids[i0 : i0 + seq_len - len(bos)]
                if len(piece) < 32:
                    break
                chunks.append(bos + piece)
                n_text += len(piece) + len(bos)
                if n_text >= max_tokens:
                    break
        elif len(prompts) < self_distill:
            ids = model.tokenize(text, add_special=False)
            if len(ids) < prompt_tokens + 8:
                continue
            for _ in range(max(1, min(4, len(ids) // (4 * prompt_tokens)))):
                i0 = int(rng.integers(0, len(ids) - prompt_tokens))
                prompts.append(bos + ids[i0 : i0 + prompt_tokens])
                if len(prompts) >= self_distill:
                    break
        else:
            break
    jobs = [("text", c) for c in chunks] + [("gen", p) for p in prompts] + [("gen", list(p)) for p in chat_prompts]
    rng.shuffle(jobs)
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for kind, toks in jobs:
        n = len(toks) + (gen_tokens if kind == "gen" else 0)
        if size and size + n > shard_tokens:
            shards.append([])
            size = 0
        shards[-1].append((kind, toks))
        size += n
    meta = dict(version=PLAN_VERSION, max_tokens=max_tokens, seq_len=seq_len, self_distill=self_distill,
                prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, seed=seed, n_docs=len(docs),
                n_text_tokens=n_text, n_prompts=len(prompts), n_chat_prompts=len(chat_prompts))  # fmt: skip
    return DataPlan([s for s in shards if s], gen_tokens, meta)


def extract(
    target,
    data_dir: str | os.PathLike,
    plan: DataPlan,
    layers: Sequence[int],
    *,
    topk: int = 8,
    n_seq: int = 16,
    n_threads: int | None = None,
    progress: bool = True,
    max_shards: int | None = None,
    deadline: float | None = None,
) -> list[Path]:
    """Record every shard of ``plan`` (the first ``max_shards``) that ``data_dir`` does not
    hold yet, stopping before a shard when ``time.time()`` has passed ``deadline`` (seconds
    since the epoch): a run is bounded by time, and a rerun continues where it stopped.

    Returns:
        The paths of the finished shards (old and new), in plan order.
    """
    from tqdm.auto import tqdm

    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_shards = len(plan.shards) if max_shards is None else min(max_shards, len(plan.shards))
    todo = [i for i in range(n_shards) if not (out / f"shard-{i:05d}.npz").exists()]
    if todo and (deadline is None or time.time() < deadline):
        max_seq = max(len(t) + (plan.gen_tokens if k == "gen" else 0) for s in plan.shards for k, t in s)
        rec = FeatureRecorder(target, layers, topk=topk, n_seq=n_seq, n_ctx=max(4096, n_seq * (max_seq + 64)),
                              n_threads=n_threads)  # fmt: skip
        total = sum(len(t) + (plan.gen_tokens if k == "gen" else 0) for i in todo for k, t in plan.shards[i])
        bar = tqdm(total=total, unit="tok", desc="target features", disable=not progress)
        try:
            for i in todo:
                if deadline is not None and time.time() >= deadline:
                    break
                records = []
                jobs = plan.shards[i]
                for kind, toks in jobs:
                    if kind == "text":
                        records.append(rec.record_text(toks))
                        bar.update(len(toks))
                gen = [t for k, t in jobs if k == "gen"]
                for g0 in range(0, len(gen), n_seq):
                    group = gen[g0 : g0 + n_seq]
                    recs = rec.record_generated(group, plan.gen_tokens)
                    records.extend(recs)
                    bar.update(sum(len(p) for p in group) + len(group) * plan.gen_tokens)
                write_shard(out / f"shard-{i:05d}.npz", records)
                bar.set_postfix(shard=f"{i + 1}/{len(plan.shards)}")
        finally:
            bar.close()
            rec.close()
    return [out / f"shard-{i:05d}.npz" for i in range(n_shards) if (out / f"shard-{i:05d}.npz").exists()]


def prepare_data(
    target,
    data_dir: str | os.PathLike,
    sources: Sequence[str | os.PathLike],
    layers: Sequence[int],
    **plan_args,
) -> list[Path]:
    """Plan (once: ``plan.npz`` in ``data_dir``) and record the shards; resumable.

    ``plan_args`` go to ``make_plan`` (and ``topk``, ``n_seq``, ``n_threads``, ``progress``,
    ``max_shards``, ``deadline`` to ``extract``). A plan already in ``data_dir`` is reused, whatever the arguments.

    ``self_prompts`` (a ``plan_args`` key, default 0): that many chat- and code-like prompts
    the target writes itself (``self_prompts.harvest_prompts``, seeded by ``seed``; with a
    ``deadline``, the harvest stops at ``HARVEST_SHARE`` of the time left so that the rest
    answers what it found), answered by the target like the other self-distillation prompts;
    the harvest is saved as
    ``self_prompts.json`` beside the plan (one already there is reused: copy another folder's
    to answer the same prompts in another framing). ``self_prompt_tokens``: tokens per list
    continuation. ``self_prompt_framing``: ``"chat"`` (default: one user turn, as ``chat`` and
    ``serve`` give it) or ``"bare"`` (the prompt text alone, as ``generate``, ``complete`` and
    ``bench`` without ``--chat-format`` give it; a base model continues it as text).
    """
    from localspec.backend import Model

    ex_args = {k: plan_args.pop(k) for k in ("topk", "n_seq", "n_threads", "progress", "max_shards", "deadline")
               if k in plan_args}  # fmt: skip
    n_self = int(plan_args.pop("self_prompts", 0) or 0)
    self_tokens = int(plan_args.pop("self_prompt_tokens", 160))
    framing = plan_args.pop("self_prompt_framing", "chat")
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    plan_path = d / "plan.npz"
    if plan_path.exists():
        plan = DataPlan.load(plan_path)
    else:
        if n_self > 0:
            dl = ex_args.get("deadline")
            now = time.time()
            plan_args["chat_prompts"] = harvest_chat_prompts(
                target, d / "self_prompts.json", n_self, seed=plan_args.get("seed", 0), max_tokens=self_tokens,
                deadline=None if dl is None else now + HARVEST_SHARE * max(0.0, dl - now),
                framing=framing)  # fmt: skip
        m = Model(target, vocab_only=True)
        try:
            plan = make_plan(m, iter_text_files(sources), **plan_args)
        finally:
            m.close()
        plan.meta["layers"] = [int(k) for k in layers]
        plan.save(plan_path)
    if plan.meta.get("layers") != [int(k) for k in layers]:
        raise ValueError(f"{d} holds features of layers {plan.meta.get('layers')}, not {list(layers)}: use another --data-dir")
    return extract(target, d, plan, layers, **ex_args)


def harvest_chat_prompts(target, out: Path, n: int, *, seed: int = 0, max_tokens: int = 160,
                         deadline: float | None = None, framing: str = "chat") -> list[list[int]]:  # fmt: skip
    """``n`` prompts the target writes itself (``self_prompts.harvest_prompts``; fewer when
    ``deadline`` passes first), saved to ``out`` (JSON: prompts, kinds, rounds) and returned as
    token ids: chat-formatted (``tui.chat_format.chat_prompt_tokens``) when ``framing`` is
    ``"chat"``, the text alone with BOS (``Model.tokenize``) when ``"bare"``. An existing
    ``out`` is reused.

    Raises:
        ValueError: ``framing`` is neither ``"chat"`` nor ``"bare"``."""
    if framing not in ("chat", "bare"):
        raise ValueError(f"self-prompt framing {framing!r}: choose 'chat' or 'bare'")
    from localspec import Engine
    from localspec.costmodel import CostModel

    from localspec.tui.chat_format import chat_prompt_tokens

    from .self_prompts import harvest_prompts

    eng = Engine(target, drafter=None, cost_model=CostModel({1: 1000.0}), n_ctx=1024)
    try:
        if out.exists():
            prompts = json.loads(out.read_text())["prompts"]
        else:
            h = harvest_prompts(eng, n, seed=seed, max_tokens=max_tokens, deadline=deadline)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(dict(seed=seed, rounds=h.rounds, generated_tokens=h.generated_tokens,
                                           prompts=h.prompts, kinds=h.kinds), indent=1))  # fmt: skip
            os.replace(tmp, out)
            prompts = h.prompts
        if framing == "bare":
            return [eng.tokenize(p) for p in prompts]
        return [chat_prompt_tokens(eng.model, p) for p in prompts]
    finally:
        eng.close()


# -- learning from use ---------------------------------------------------------------------


def usage_plan(usage_dir: str | os.PathLike, n_vocab: int, *, seq_len: int = 512, min_tokens: int = 16) -> DataPlan:
    """The token sequences ``localspec.usage.UsageLog`` recorded in ``usage_dir`` as a plan of
    text chunks (each sequence cut into pieces of at most ``seq_len`` tokens; pieces shorter
    than ``min_tokens`` dropped), one shard per usage shard. ``meta["digest"]`` identifies
    the data (SHA-256 of the chunks).

    A shard that cannot be read (cut short, not a usage shard) is skipped with a warning that
    names it.

    Raises:
        FileNotFoundError: no usage shards in ``usage_dir``.
        ValueError: no chunk fits the target (``n_vocab``) and ``min_tokens`` (the unreadable
            shards named).
    """
    import hashlib

    from localspec.usage import usage_shards

    files = usage_shards(usage_dir)
    if not files:
        raise FileNotFoundError(f"no recorded usage in {usage_dir} (chat/serve --record-usage DIR writes it)")
    h = hashlib.sha256()
    shards: list[list[tuple[str, list[int]]]] = []
    n_seq = n_skipped = 0
    bad: list[str] = []
    for f in files:
        try:  # a shard cut short (a full disk, a copy) or not ours: the others still teach
            with np.load(f, allow_pickle=False) as z:
                lengths, tokens = np.asarray(z["lengths"], dtype=np.int64), np.asarray(z["tokens"])
            if lengths.ndim != 1 or tokens.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != tokens.size:
                raise ValueError("its lengths do not match its tokens")
        except Exception as e:  # zipfile.BadZipFile, EOFError, KeyError, ValueError (pickled data), OSError
            bad.append(f"{f} ({type(e).__name__}: {e})")
            logging.getLogger("localspec.train").warning("skipping the usage shard %s: it cannot be read (%s: %s)", f, type(e).__name__, e)
            continue
        starts = np.concatenate([[0], np.cumsum(lengths)])
        jobs = []
        for i in range(lengths.size):
            seq = tokens[starts[i] : starts[i + 1]]
            if seq.size and (seq.min() < 0 or seq.max() >= n_vocab):
                n_skipped += 1  # recorded with another vocabulary
                continue
            n_seq += 1
            for i0 in range(0, seq.size, seq_len):
                piece = seq[i0 : i0 + seq_len]
                if piece.size >= min_tokens:
                    jobs.append(("text", piece.tolist()))
                    h.update(piece.astype(np.int32).tobytes())
        if jobs:
            shards.append(jobs)
    if not shards:
        why = f"{n_skipped} recorded with another vocabulary" + (f"; unreadable: {', '.join(bad)}" if bad else "")
        raise ValueError(f"no usable sequences in {usage_dir} ({why})")
    meta = dict(version=PLAN_VERSION, usage=str(usage_dir), seq_len=seq_len, n_sequences=n_seq,
                n_skipped=n_skipped, digest=h.hexdigest())  # fmt: skip
    return DataPlan(shards, 0, meta)


def record_usage(
    target,
    usage_dir: str | os.PathLike,
    data_dir: str | os.PathLike,
    layers: Sequence[int],
    d2t: np.ndarray,
    *,
    seq_len: int = 512,
    topk: int = 8,
    n_threads: int | None = None,
    progress: bool = True,
    deadline: float | None = None,
) -> list[Path]:
    """Teacher-forced features and draft-vocabulary targets (``TeacherForcedRecorder``) of
    the recorded usage in ``usage_dir``, as training shards in ``data_dir`` (resumable like
    ``record_text_plan``). ``data_dir`` is emptied first when it holds another recording
    (other usage data, layers or draft vocabulary).
    """
    from localspec.backend import Model

    m = Model(target, vocab_only=True)
    try:
        plan = usage_plan(usage_dir, m.n_vocab, seq_len=seq_len)
    finally:
        m.close()
    plan.meta["layers"] = [int(k) for k in layers]
    d = Path(data_dir)
    plan_path = d / "plan.npz"
    d2t = np.asarray(d2t, dtype=np.int64)
    if plan_path.exists():
        old = DataPlan.read_meta(plan_path)
        same_d2t = (d / "d2t.npy").exists() and np.array_equal(np.load(d / "d2t.npy"), d2t)
        if old.get("digest") != plan.meta["digest"] or old.get("layers") != plan.meta["layers"] or not same_d2t:
            for p in shard_paths(d):
                p.unlink()
            (d / "d2t.npy").unlink(missing_ok=True)
            plan_path.unlink()
    d.mkdir(parents=True, exist_ok=True)
    if not plan_path.exists():
        plan.save(plan_path)
    return record_text_plan(target, d, plan, layers, d2t, topk=topk, n_threads=n_threads, progress=progress,
                            deadline=deadline)  # fmt: skip
