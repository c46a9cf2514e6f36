"""Train an EAGLE-3 head on recorded target data (``eagle3_data``) and export it as GGUF.

* Draft vocabulary: the ``vocab_size`` tokens the target predicts most often in the data (its
  top-1 next tokens), plus its end-of-generation tokens; ``d2t`` maps them to target ids.
* Initialisation from the target: the draft ``output`` matrix is the target's lm_head rows of
  the draft vocabulary and ``output_norm`` the target's final norm, so the head starts by
  reading the target's own unembedding.
* Loss: for each unroll step ``k`` (EAGLE-3's training-time test, ``Eagle3Head.forward``),
  the cross-entropy of the head's draft-vocabulary distribution against the target's top-k
  distribution renormalised over the draft vocabulary, at positions whose target top-1 is in
  the draft vocabulary; steps are weighted ``0.8 ** k``. Accuracy per step counts every
  position: the head's argmax (mapped through ``d2t``) equal to the target's top-1.
* Checkpoints (``checkpoint.pt``) every ``ckpt_every`` steps and at the end; a run with the
  same ``work_dir`` resumes from it. Metrics go to ``train_log.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .eagle3_data import Shard, load_shard
from ..eagle3_gguf import Eagle3Config, Eagle3Weights, default_target_layers, read_eagle3_gguf, write_eagle3_gguf
from .eagle3_torch import Eagle3Head
from ..gguf_index import GGUFIndex
from .schedule import warmup_cosine

STEP_WEIGHT = 0.8


@dataclass
class TrainConfig:
    """Optimisation settings.

    Attributes:
        steps: optimiser steps.
        batch: windows per step; seq_len: tokens per window.
        unroll: training-time-test depth (steps of the head on its own states).
        lr / warmup / min_lr_frac: AdamW peak rate, linear warm-up steps, cosine floor.
        vocab_size: draft vocabulary size.
        device: ``cpu``, ``cuda``, ``mps`` or ``auto``.
        bf16: autocast matrix products to bfloat16 where the hardware has it (``bf16_capable``:
            CUDA, or a CPU with AVX-512 BF16 or AMX); elsewhere float32. On a CPU without them
            (AVX2 only) torch's bfloat16 path is emulated: measured 42 s per training step here
            against 1.8 s in float32 (2-core AVX2 VM, 2026-12-02).
        val_frac: fraction of sequences held out for the validation accuracies.
        loss_frac: fraction of positions scored per step (``ttt_loss``); 1 = all.
    """

    steps: int = 2000
    batch: int = 8
    seq_len: int = 256
    unroll: int = 4
    lr: float = 1e-3
    warmup: int = 50
    min_lr_frac: float = 0.1
    weight_decay: float = 0.0
    vocab_size: int = 8192
    device: str = "auto"
    bf16: bool = True
    seed: int = 0
    log_every: int = 25
    ckpt_every: int = 200
    val_frac: float = 0.03
    loss_frac: float = 1.0
    head: dict = field(default_factory=lambda: dict(n_head=4, n_head_kv=1, head_dim=128, n_ff=1024))


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# -- the target's tensors --------------------------------------------------------------------


@dataclass
class TargetTensors:
    """What the head borrows from the target GGUF (rows are dequantised on demand).

    Attributes:
        index: the target's ``GGUFIndex``.
        output_norm: [n_embd] float32; n_vocab, n_layer, n_embd, rms_eps, n_ctx_train:
            hyper-parameters; eog: end-of-generation token ids.
    """

    index: GGUFIndex
    output_norm: np.ndarray
    n_vocab: int
    n_layer: int
    n_embd: int
    rms_eps: float
    n_ctx_train: int
    eog: list[int]

    def embedding_table(self, ids: np.ndarray) -> np.ndarray:
        """[n_vocab, n_embd] float32 token embeddings (unscaled) with only rows ``ids`` filled
        (the others zero): the rows a batch can ask for."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        table = np.zeros((self.n_vocab, self.n_embd), np.float32)
        table[ids] = self.index.rows("token_embd.weight", ids)
        return table

    def lm_head_rows(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), n_embd] float32 rows of the target's output matrix (tied: token_embd)."""
        return self.index.rows(self.index.lm_head_name(), ids)


def read_target(target: str | os.PathLike) -> TargetTensors:
    """Index the target GGUF and read its final norm and hyper-parameters."""
    r = GGUFIndex(target)
    v = r.values
    arch = v["general.architecture"]
    eog = r.eog_ids()
    return TargetTensors(
        index=r, output_norm=r.rows("output_norm.weight"), n_vocab=r.array_len("tokenizer.ggml.tokens"),
        n_layer=int(v[f"{arch}.block_count"]), n_embd=int(v[f"{arch}.embedding_length"]),
        rms_eps=float(v.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        n_ctx_train=int(v[f"{arch}.context_length"]), eog=sorted(set(eog)),
    )  # fmt: skip


# -- data ------------------------------------------------------------------------------------


@dataclass
class VocabChoice:
    """``d2t`` [n_draft] int64 sorted target ids, and the fraction of the data's target top-1
    tokens it covers."""

    d2t: np.ndarray
    coverage: float


def choose_draft_vocab(shards: list[Shard], size: int, always: list[int], prior: np.ndarray | None = None) -> VocabChoice:
    """The ``size`` most frequent target top-1 tokens of the data (ties broken by the tokens'
    own frequency), with ``always`` (end-of-generation ids) included; when the data has fewer
    distinct tokens, the rest in the order of ``prior`` (target ids, most likely first, e.g.
    by tokenizer score)."""
    top1 = np.concatenate([s.topk_ids[:, 0] for s in shards]).astype(np.int64)
    toks = np.concatenate([s.tokens for s in shards]).astype(np.int64)
    n = int(max(top1.max(), toks.max(), max(always, default=0))) + 1
    score = np.bincount(top1, minlength=n) * 1e6 + np.bincount(toks, minlength=n)
    score[list(always)] = np.inf
    order = np.argsort(-score, kind="stable")
    order = order[score[order] > 0][:size]
    if order.size < size:  # little data: fill from the prior, then with the lowest unseen ids
        cand = np.concatenate([np.asarray(prior if prior is not None else [], dtype=np.int64), np.arange(n + size)])
        cand = cand[~np.isin(cand, order)]
        _, first = np.unique(cand, return_index=True)
        order = np.concatenate([order, cand[np.sort(first)][: size - order.size]])
    d2t = np.sort(order).astype(np.int64)
    cov = float(np.isin(top1, d2t).mean())
    return VocabChoice(d2t, cov)


def tokenizer_prior(index: GGUFIndex) -> np.ndarray | None:
    """Normal tokens by descending tokenizer score (SentencePiece log-probabilities), or None
    when the GGUF has no scores."""
    scores = index.values.get("tokenizer.ggml.scores")
    types = index.values.get("tokenizer.ggml.token_type")
    if scores is None or types is None:
        return None
    normal = np.flatnonzero(np.asarray(types) == 1)
    return normal[np.argsort(-np.asarray(scores)[normal], kind="stable")]


def feature_scale(shards: list[Shard], max_rows: int = 20000, seed: int = 0) -> np.ndarray:
    """Per-column RMS of the features (at most ``max_rows`` sampled rows): [3 * n_embd] float32."""
    rng = np.random.default_rng(seed)
    rows = []
    per = max(1, max_rows // max(1, len(shards)))
    for s in shards:
        idx = np.sort(rng.choice(s.n_tokens, size=min(per, s.n_tokens), replace=False))
        rows.append(np.concatenate([s.features(int(i), int(i) + 1) for i in idx]))
    x = np.concatenate(rows)
    return np.maximum(np.sqrt((x.astype(np.float64) ** 2).mean(0)), 1e-3).astype(np.float32)


@dataclass
class Batch:
    """One training batch of ``B`` windows of ``T`` positions.

    tokens [B, T] int64; feats [B, T, 3E] float32; label_ids [B, T, k] int64 (draft ids, -1
    when outside the draft vocabulary); label_logits [B, T, k] float32; top1 [B, T] int64
    target ids; valid [B, T] bool (a real position); pos0 [B] int64.
    """

    tokens: torch.Tensor
    feats: torch.Tensor
    label_ids: torch.Tensor
    label_logits: torch.Tensor
    top1: torch.Tensor
    valid: torch.Tensor


class WindowSampler:
    """Random windows of whole recorded sequences (sequences longer than ``seq_len`` are cut at
    random offsets; positions in a window restart at 0, as RoPE only sees differences)."""

    def __init__(self, shards: list[Shard], seqs: list[tuple[int, int]], t2d: np.ndarray, seq_len: int, seed: int):
        self.shards, self.seqs, self.t2d, self.seq_len = shards, seqs, t2d, seq_len
        lens = np.array([shards[s].starts[i + 1] - shards[s].starts[i] for s, i in seqs], dtype=np.float64)
        self.p = lens / lens.sum()
        self.rng = np.random.default_rng(seed)

    def window(self, s: int, i: int, start: int | None = None) -> tuple[int, int, int]:
        sh = self.shards[s]
        lo, hi = int(sh.starts[i]), int(sh.starts[i + 1])
        if hi - lo > self.seq_len:
            off = int(self.rng.integers(0, hi - lo - self.seq_len + 1)) if start is None else start
            lo = lo + off
            hi = lo + self.seq_len
        return s, lo, hi

    def make(self, windows: list[tuple[int, int, int]], device) -> Batch:
        b, t = len(windows), self.seq_len
        k = self.shards[0].topk_ids.shape[1]
        width = self.shards[0].feats.shape[1]
        tokens = np.zeros((b, t), np.int64)
        feats = np.zeros((b, t, width), np.float32)
        ids = np.full((b, t, k), -1, np.int64)
        logits = np.zeros((b, t, k), np.float32)
        top1 = np.full((b, t), -1, np.int64)
        valid = np.zeros((b, t), bool)
        for j, (s, lo, hi) in enumerate(windows):
            sh, n = self.shards[s], hi - lo
            tokens[j, :n] = sh.tokens[lo:hi]
            feats[j, :n] = sh.features(lo, hi)
            ids[j, :n] = self.t2d[sh.topk_ids[lo:hi]]
            logits[j, :n] = sh.topk_logits[lo:hi]
            top1[j, :n] = sh.topk_ids[lo:hi, 0]
            valid[j, :n] = True
        as_t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return Batch(as_t(tokens), as_t(feats), as_t(ids), as_t(logits), as_t(top1), as_t(valid))

    def sample(self, batch: int, device) -> Batch:
        picks = self.rng.choice(len(self.seqs), size=batch, p=self.p)
        return self.make([self.window(*self.seqs[int(i)]) for i in picks], device)


# -- loss ------------------------------------------------------------------------------------


@dataclass
class StepMetrics:
    """Per unroll step: summed loss, correct top-1, counted positions."""

    loss: list[float]
    correct: list[int]
    count: list[int]


def bf16_capable(device) -> bool:
    """Whether bfloat16 matrix products are native on ``device``: CUDA, or a CPU with AVX-512
    BF16 or AMX tiles (``torch.cpu`` capability checks)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    return any(bool(getattr(cpu, f, lambda: False)()) for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def ttt_loss(
    model: Eagle3Head, b: Batch, unroll: int, bf16: bool, loss_frac: float = 1.0, gen: torch.Generator | None = None
) -> tuple[torch.Tensor, StepMetrics]:
    """Weighted training-time-test loss of a batch and its per-step metrics (see module doc).

    ``loss_frac`` < 1 scores a random subset of the positions of each step (the draft lm_head
    dominates the cost; the decoder still runs on every position, which attention needs).
    """
    dev = b.tokens.device
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
        outs = model(b.tokens, b.feats, unroll)
    t = b.tokens.shape[1]
    total = torch.zeros((), device=dev)
    m = StepMetrics([], [], [])
    for k, hidden in enumerate(outs):
        n = t - k - 1  # origins P whose label (position P + k + 1) is inside the window
        if n <= 0:
            break
        lid = b.label_ids[:, k + 1 : k + 1 + n]  # [B, n, K]
        llg = b.label_logits[:, k + 1 : k + 1 + n]
        valid = b.valid[:, k + 1 : k + 1 + n]
        top1 = b.top1[:, k + 1 : k + 1 + n]
        h = hidden[:, :n]
        if loss_frac < 1.0:
            keep = torch.rand(valid.shape, device=dev, generator=gen) < loss_frac
            valid = valid & keep
            h, lid, llg, top1, valid = h[keep], lid[keep], llg[keep], top1[keep], valid[keep]  # [N, ...]
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model.logits(h)
        logp = torch.log_softmax(logits.float(), -1)  # [..., V]
        mask = valid & (lid[..., 0] >= 0)
        tp = torch.softmax(llg.masked_fill(lid < 0, float("-inf")), -1).nan_to_num(0.0)
        ce = -(tp * logp.gather(-1, lid.clamp(min=0))).sum(-1)
        loss_k = (ce * mask).sum() / mask.sum().clamp(min=1)
        total = total + (STEP_WEIGHT**k) * loss_k
        pred = model.d2t[logp.argmax(-1)]
        m.loss.append(float(loss_k.detach()))
        m.correct.append(int(((pred == top1) & valid).sum()))
        m.count.append(int(valid.sum()))
    return total, m


def init_from_target(model: Eagle3Head, tt: TargetTensors) -> None:
    """Start from the target's own readout: ``output`` = the target's lm_head rows of the draft
    vocabulary, ``output_norm`` = its final norm, and ``fc`` passing the highest feature layer
    through (divided by its typical size, so that the decoder's updates are not dwarfed by
    the raw residual stream): at step 0 the head begins as the target's logit lens at that
    layer (the attention and FFN branches start at zero) and learns the rest."""
    e = tt.n_embd
    scale = model.feat_scale[2 * e : 3 * e]
    with torch.no_grad():
        model.output.weight.copy_(torch.from_numpy(tt.lm_head_rows(model.d2t.cpu().numpy())))
        model.output_norm.copy_(torch.from_numpy(tt.output_norm))
        model.fc.weight.mul_(0.01)
        model.fc.weight[:, 2 * e : 3 * e] += torch.diag(scale / scale.pow(2).mean().sqrt())
        model.wo.weight.zero_()  # the residual branches start silent: h = g
        model.w_down.weight.zero_()


def load_weights(model: Eagle3Head, w: Eagle3Weights) -> None:
    """Set ``model``'s tensors from exported weights (``read_eagle3_gguf``): the inverse of
    ``Eagle3Head.to_weights`` (``fc`` times the model's ``feat_scale``, which export divides
    by), so the model computes what the GGUF computes. ``w.d2t`` must be ``model.d2t``."""
    if not np.array_equal(w.d2t, model.d2t.cpu().numpy()):
        raise ValueError("the weights' draft vocabulary is not the model's")
    pairs = {"fc": model.fc.weight, "attn_norm": model.attn_norm, "hidden_norm": model.hidden_norm,
             "wq": model.wq.weight, "wk": model.wk.weight, "wv": model.wv.weight, "wo": model.wo.weight,
             "ffn_norm": model.ffn_norm, "w_gate": model.w_gate.weight, "w_up": model.w_up.weight,
             "w_down": model.w_down.weight, "output_norm": model.output_norm, "output": model.output.weight}  # fmt: skip
    with torch.no_grad():
        for name, param in pairs.items():
            a = torch.from_numpy(np.asarray(getattr(w, name), dtype=np.float32))
            if name == "fc":
                a = a * model.feat_scale.cpu()[None, :]
            param.copy_(a)


# -- the loop --------------------------------------------------------------------------------


def _lr(cfg, step: int) -> float:
    return warmup_cosine(step, lr=cfg.lr, warmup=cfg.warmup, steps=cfg.steps, min_lr_frac=cfg.min_lr_frac)


@dataclass
class TrainResult:
    """What a run produced: the head GGUF, its config, and the last validation accuracies per
    unroll step (fractions), with sizes and times."""

    gguf: Path
    config: Eagle3Config
    val_accuracy: list[float]
    train_accuracy: list[float]
    vocab_coverage: float
    n_train_tokens: int
    wall_s: float
    steps: int
    val_by_source: dict = field(default_factory=dict)


def evaluate(model: Eagle3Head, sampler: WindowSampler, seqs: list[tuple[int, int]], cfg: TrainConfig, device) -> list[float]:
    """Accuracy per unroll step on ``seqs`` (first window of each sequence)."""
    if not seqs:
        return []
    windows = [sampler.window(s, i, start=0) for s, i in seqs]
    acc = window_accuracy(model, sampler, windows, None, cfg.unroll, cfg.batch, cfg.bf16, device)
    model.train()
    return acc


def window_accuracy(model: Eagle3Head, sampler: WindowSampler, windows: list[tuple[int, int, int]],
                    first_label: list[int] | None, unroll: int, batch: int, bf16: bool, device) -> list[float]:  # fmt: skip
    """The model's accuracy per unroll step (``ttt_loss``, in eval mode, no gradients) over
    ``windows`` (shard, lo, hi) made by ``sampler``; with ``first_label``, only labels at absolute
    token index ``>= first_label[i]`` of window ``i`` count."""
    model.eval()
    corr, cnt = np.zeros(unroll), np.zeros(unroll)
    with torch.no_grad():
        for i0 in range(0, len(windows), batch):
            wins = windows[i0 : i0 + batch]
            b = sampler.make(wins, device)
            if first_label is not None:
                t = b.tokens.shape[1]
                idx = torch.arange(t, device=device)[None, :] + torch.tensor([lo for _, lo, _ in wins], device=device)[:, None]
                b.valid &= idx >= torch.tensor(first_label[i0 : i0 + batch], device=device)[:, None]
            _, m = ttt_loss(model, b, unroll, bf16)
            corr[: len(m.correct)] += m.correct
            cnt[: len(m.count)] += m.count
    return (corr / np.maximum(cnt, 1)).tolist()


def split_sequences(shards: list[Shard], cfg: TrainConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The held-out and the training sequences of ``shards`` as (shard, sequence) pairs: a
    shuffle seeded by ``cfg.seed``, the first ``cfg.val_frac`` of it held out (none with 20
    sequences or fewer)."""
    seqs = [(s, i) for s, sh in enumerate(shards) for i in range(sh.starts.size - 1)]
    rng = np.random.default_rng(cfg.seed)
    rng.shuffle(seqs)
    n_val = int(round(len(seqs) * cfg.val_frac)) if len(seqs) > 20 else 0
    return seqs[:n_val], seqs[n_val:]


def _score_heads(target, shards: list[Shard], windows: list[tuple[int, int, int]], first_label: list[int] | None,
                 heads: list[str | os.PathLike], cfg: TrainConfig) -> list[list[float]]:  # fmt: skip
    """Each head GGUF's accuracy per unroll step (``window_accuracy``) over ``windows`` (shard,
    lo, hi); with ``first_label``, only labels at absolute token index ``>= first_label[i]`` of
    window ``i`` count."""
    tt = read_target(target)
    device = pick_device(cfg.device)
    bf16 = cfg.bf16 and bf16_capable(device)
    used = np.concatenate([np.unique(s.tokens) for s in shards])
    emb = tt.embedding_table(used)
    seq_len = max(hi - lo for _, lo, hi in windows)
    out = []
    for path in heads:
        head_cfg, w = read_eagle3_gguf(path)
        model = Eagle3Head(head_cfg, emb, w.d2t, np.ones(3 * head_cfg.n_embd_target, np.float32))
        load_weights(model, w)
        model.to(device)
        t2d = np.full(tt.n_vocab, -1, np.int64)
        t2d[w.d2t] = np.arange(w.d2t.size)
        sampler = WindowSampler(shards, [], t2d, seq_len, cfg.seed)
        out.append(window_accuracy(model, sampler, windows, first_label, cfg.unroll, cfg.batch, bf16, device))
    return out


def held_out_accuracy(target: str | os.PathLike, shard_files: list[Path], heads: list[str | os.PathLike],
                      cfg: TrainConfig) -> list[list[float]]:  # fmt: skip
    """Each head GGUF's accuracy per unroll step on the sequences that ``train_eagle3`` with
    ``cfg`` holds out of ``shard_files`` (``split_sequences``; first window of each). Heads with
    different draft vocabularies compare fairly: a position whose target top-1 is outside a
    head's vocabulary is a miss for it (``ttt_loss``). Held-out sequences of ``restricted``
    shards (teacher-forced text whose top-1 is the best token of one draft vocabulary) are
    left out. The held-out sequences come from the new head's own data sources, so the
    comparison favours the new head: the recipe ships on ``answer_accuracy`` instead.

    Returns:
        one list of ``cfg.unroll`` fractions per head, in order.
    Raises:
        ValueError: no sequence with full-vocabulary targets is held out (20 sequences or
            fewer, or only teacher-forced text).
    """
    shards = [load_shard(p) for p in shard_files]
    val = [(s, i) for s, i in split_sequences(shards, cfg)[0] if not shards[s].restricted]
    if not val:
        raise ValueError("held_out_accuracy: no sequence with full-vocabulary targets is held out")
    windows = []
    for s, i in val:
        lo, hi = int(shards[s].starts[i]), int(shards[s].starts[i + 1])
        windows.append((s, lo, min(hi, lo + cfg.seq_len)))
    return _score_heads(target, shards, windows, None, heads, cfg)


def answer_accuracy(target: str | os.PathLike, shard_files: list[Path], heads: list[str | os.PathLike],
                    cfg: TrainConfig, context: int = 256) -> list[list[float]]:  # fmt: skip
    """Each head GGUF's accuracy per unroll step on the **answers** of recorded prompt +
    greedy-answer sequences (``FeatureRecorder.record_generated`` shards, which store each
    sequence's ``n_prompt``): the positions a drafter drafts in use, each sequence's last
    ``context`` tokens as the window (its prompt's end as context). With shards recorded apart
    from both heads' training data (the recipe: self-written prompts of another seed) this is
    the comparison that ranked heads as Spec-Bench's mean acceptance length did (the
    2026-12-03 heads: docs/eagle3-training.md), unlike ``held_out_accuracy``.

    Returns:
        one list of ``cfg.unroll`` fractions per head, in order.
    Raises:
        ValueError: no shard with answers (full-vocabulary, generated tokens).
    """
    shards, windows, first = [], [], []
    for p in shard_files:
        sh = load_shard(p)
        with np.load(p) as z:
            n_prompt = z["n_prompt"] if "n_prompt" in z.files else None
        if sh.restricted or n_prompt is None:
            continue
        k = len(shards)
        shards.append(sh)
        for i in range(sh.starts.size - 1):
            lo, hi = int(sh.starts[i]), int(sh.starts[i + 1])
            if hi - lo - int(n_prompt[i]) < 2:
                continue
            windows.append((k, max(lo, hi - context), hi))
            # labels at index >= lo + n_prompt predict the answer's second token on: the first is
            # the target's own (the prefill's), the head drafts from then on
            first.append(lo + int(n_prompt[i]))
    if not windows:
        raise ValueError("answer_accuracy: no recorded answers in these shards")
    return _score_heads(target, shards, windows, first, heads, cfg)


def train_eagle3(
    target: str | os.PathLike,
    shard_files: list[Path],
    work_dir: str | os.PathLike,
    out: str | os.PathLike,
    cfg: TrainConfig,
    *,
    target_layers: tuple[int, int, int] | None = None,
    matrix_dtype: str = "q8_0",
    progress: bool = True,
    d2t: np.ndarray | None = None,
    deadline: float | None = None,
    init_head: str | os.PathLike | None = None,
) -> TrainResult:
    """Train (or resume) a head on ``shard_files`` and write it to ``out``.

    Args:
        target: the target GGUF the data was recorded from.
        shard_files: shards from ``eagle3_data.prepare_data``.
        work_dir: checkpoint and log folder (resumes from ``checkpoint.pt`` there).
        out: head GGUF to write.
        target_layers: the layers the data holds (default: the EAGLE-3 convention).
        matrix_dtype: storage of the decoder and output matrices: ``q8_0``, ``f16`` or ``f32``.
        d2t: the draft vocabulary (sorted target ids) instead of ``choose_draft_vocab``'s; data
            recorded over a draft vocabulary (``restricted`` shards) must be trained with it.
        deadline: ``time.time()`` after which training stops early (checkpointed, exported).
        init_head: a head GGUF (``write_eagle3_gguf``'s) to continue training: its
            hyper-parameters, target layers and draft vocabulary replace ``cfg.head``,
            ``target_layers`` and ``d2t`` (a checkpoint in ``work_dir`` still wins).
    Validation accuracies are reported over all held-out sequences and per source
    (``val_by_source``: ``generated`` = shards with full-vocabulary targets, ``text`` =
    teacher-forced text whose top-1 is the draft vocabulary's best; and, when the shards come
    from several folders, ``"NAME/"`` per folder, e.g. the recipe's ``gen/``, ``chat/``, ``text/``).
    Raises:
        ValueError: no data, or a checkpoint made for other data/settings.
    """
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    if not shard_files:
        raise ValueError("no training data: record shards first (eagle3_data.prepare_data)")
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    bf16 = cfg.bf16 and bf16_capable(device)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    shards = [load_shard(p) for p in shard_files]
    tt = read_target(target)
    layers = tuple(target_layers or default_target_layers(tt.n_layer))
    head_cfg = Eagle3Config(target_layers=layers, n_embd_target=tt.n_embd, n_embd=tt.n_embd,
                            rms_eps=tt.rms_eps, n_ctx_train=tt.n_ctx_train, **cfg.head)  # fmt: skip
    init_w = None
    if init_head is not None:
        head_cfg, init_w = read_eagle3_gguf(init_head)
        if head_cfg.n_embd_target != tt.n_embd or max(head_cfg.target_layers) >= tt.n_layer:
            raise ValueError(f"{init_head} was made for another target (hidden size {head_cfg.n_embd_target}, "
                             f"layers {head_cfg.target_layers})")  # fmt: skip
        if target_layers is not None and tuple(target_layers) != head_cfg.target_layers:
            raise ValueError(f"the data holds layers {tuple(target_layers)}, {init_head} reads {head_cfg.target_layers}")
        d2t = init_w.d2t
    ckpt_path = work / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path.exists() else None
    if ckpt is not None:
        vocab = VocabChoice(ckpt["d2t"], ckpt["coverage"])
        scale = ckpt["feat_scale"]
        if ckpt["head_cfg"] != asdict(head_cfg):
            raise ValueError(f"{ckpt_path} was made with other head settings; use another work dir")
    else:
        if d2t is not None:
            d2t = np.unique(np.asarray(d2t, dtype=np.int64))
            top1 = np.concatenate([s.topk_ids[:, 0] for s in shards if not s.restricted] or [np.zeros(0, np.int32)])
            vocab = VocabChoice(d2t, float(np.isin(top1, d2t).mean()) if top1.size else 1.0)
        else:
            vocab = choose_draft_vocab(shards, cfg.vocab_size, tt.eog, prior=tokenizer_prior(tt.index))
        scale = feature_scale(shards, seed=cfg.seed)
    used = np.concatenate([np.unique(s.tokens) for s in shards])
    model = Eagle3Head(head_cfg, tt.embedding_table(used), vocab.d2t, scale)
    if ckpt is None and init_w is not None:
        load_weights(model, init_w)
    elif ckpt is None:
        init_from_target(model, tt)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"], strict=False)
        opt.load_state_dict(ckpt["opt"])
        step = int(ckpt["step"])
    t2d = np.full(tt.n_vocab, -1, np.int64)
    t2d[vocab.d2t] = np.arange(vocab.d2t.size)
    val, train = split_sequences(shards, cfg)
    sampler = WindowSampler(shards, train, t2d, cfg.seq_len, cfg.seed + step)
    n_train_tokens = int(sum(shards[s].starts[i + 1] - shards[s].starts[i] for s, i in train))
    log_f = open(work / "train_log.jsonl", "a")

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(dict(model={k: v for k, v in model.state_dict().items()}, opt=opt.state_dict(), step=step,
                        d2t=vocab.d2t, coverage=vocab.coverage, feat_scale=scale, head_cfg=asdict(head_cfg),
                        train_cfg=asdict(cfg)), tmp)  # fmt: skip
        os.replace(tmp, ckpt_path)

    acc_c = np.zeros(cfg.unroll)
    acc_n = np.zeros(cfg.unroll)
    loss_s = np.zeros(cfg.unroll)
    n_log = 0
    train_acc: list[float] = []
    bar = tqdm(total=cfg.steps, initial=step, desc="train eagle3", unit="step", disable=not progress)
    t_log = time.perf_counter()
    try:
        while step < cfg.steps:
            if deadline is not None and time.time() >= deadline:
                log_f.write(json.dumps(dict(step=step, stopped="deadline")) + "\n")
                break
            for gr in opt.param_groups:
                gr["lr"] = _lr(cfg, step)
            loss, m = ttt_loss(model, sampler.sample(cfg.batch, device), cfg.unroll, bf16, cfg.loss_frac)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            k = len(m.loss)
            acc_c[:k] += m.correct
            acc_n[:k] += m.count
            loss_s[:k] += m.loss
            n_log += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.steps:
                train_acc = (acc_c / np.maximum(acc_n, 1)).tolist()
                rec = dict(step=step, lr=_lr(cfg, step - 1), loss=(loss_s / n_log).round(4).tolist(),
                           acc=np.round(train_acc, 4).tolist(),
                           tokens_per_s=round(float(acc_n[0]) / (time.perf_counter() - t_log), 1))  # fmt: skip
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
                bar.set_postfix(loss=f"{rec['loss'][0]:.3f}", acc="/".join(f"{a:.2f}" for a in train_acc))
                acc_c[:] = acc_n[:] = loss_s[:] = 0
                n_log = 0
                t_log = time.perf_counter()
            if step % cfg.ckpt_every == 0:
                save()
    finally:
        bar.close()
    save()
    val_acc = evaluate(model, sampler, val, cfg, device)
    by_source = {}
    folders = [Path(p).parent.name for p in shard_files]
    parts = [(name, [(s, i) for s, i in val if shards[s].restricted == flag]) for name, flag in (("generated", False), ("text", True))]
    if len(set(folders)) > 1:
        parts += [(f"{f}/", [(s, i) for s, i in val if folders[s] == f]) for f in dict.fromkeys(folders)]
    for name, part in parts:
        if part and len(part) < len(val):
            by_source[name] = dict(n_seq=len(part), acc=np.round(evaluate(model, sampler, part, cfg, device), 4).tolist())
    log_f.write(json.dumps(dict(step=step, val_acc=np.round(val_acc, 4).tolist(), coverage=vocab.coverage,
                                val_by_source=by_source)) + "\n")  # fmt: skip
    log_f.close()
    gguf = write_eagle3_gguf(out, target, head_cfg, model.to_weights(), matrix_dtype=matrix_dtype,
                             name=f"EAGLE-3 head ({step} steps, {vocab.d2t.size} draft tokens)")  # fmt: skip
    return TrainResult(gguf, head_cfg, val_acc, train_acc, vocab.coverage, n_train_tokens,
                       time.perf_counter() - t_start, step, by_source)  # fmt: skip
