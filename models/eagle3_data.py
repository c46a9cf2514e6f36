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
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".sh", ".json", ".toml", ".cfg", ".ini", ".html", "")
PLAN_VERSION = 1


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


def write_shard(path: Path, records: Sequence[SequenceRecord], n_blocks: int = 3) -> None:
    """Save ``records`` as one ``.npz`` (written to a temporary name, then renamed)."""
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
        )  # fmt: skip


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
                           cb_eval=self.tap.callback)  # fmt: skip
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
            for (s, k), n in zip(z["shard_kind"], z["lengths"]):
                shards[int(s)].append(("text" if k == 0 else "gen", z["tokens"][off : off + n].tolist()))
                off += int(n)
            return cls(shards, int(z["gen_tokens"]), json.loads(str(z["meta"])))


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
    jobs = [("text", c) for c in chunks] + [("gen", p) for p in prompts]
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
                n_text_tokens=n_text, n_prompts=len(prompts))  # fmt: skip
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
) -> list[Path]:
    """Record every shard of ``plan`` (the first ``max_shards``) that ``data_dir`` does not
    hold yet.

    Returns:
        The paths of those shards (old and new).
    """
    from tqdm.auto import tqdm

    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_shards = len(plan.shards) if max_shards is None else min(max_shards, len(plan.shards))
    todo = [i for i in range(n_shards) if not (out / f"shard-{i:05d}.npz").exists()]
    if todo:
        max_seq = max(len(t) + (plan.gen_tokens if k == "gen" else 0) for s in plan.shards for k, t in s)
        rec = FeatureRecorder(target, layers, topk=topk, n_seq=n_seq, n_ctx=max(4096, n_seq * (max_seq + 64)),
                              n_threads=n_threads)  # fmt: skip
        total = sum(len(t) + (plan.gen_tokens if k == "gen" else 0) for i in todo for k, t in plan.shards[i])
        bar = tqdm(total=total, unit="tok", desc="target features", disable=not progress)
        try:
            for i in todo:
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
    return [out / f"shard-{i:05d}.npz" for i in range(n_shards)]


def prepare_data(
    target,
    data_dir: str | os.PathLike,
    sources: Sequence[str | os.PathLike],
    layers: Sequence[int],
    **plan_args,
) -> list[Path]:
    """Plan (once: ``plan.npz`` in ``data_dir``) and record the shards; resumable.

    ``plan_args`` go to ``make_plan`` (and ``topk``, ``n_seq``, ``n_threads``, ``progress``,
    ``max_shards`` to ``extract``). A plan already in ``data_dir`` is reused, whatever the arguments.
    """
    from localspec.backend import Model

    ex_args = {k: plan_args.pop(k) for k in ("topk", "n_seq", "n_threads", "progress", "max_shards") if k in plan_args}
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    plan_path = d / "plan.npz"
    if plan_path.exists():
        plan = DataPlan.load(plan_path)
    else:
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
