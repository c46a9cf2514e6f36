"""Training Medusa heads (Cai et al. 2024, arXiv 2401.10774) on recorded final hidden states.

Data: ``medusa_data`` shards (the target's final-norm rows ``h`` over text, teacher forced).
For position ``i`` of a sequence, head ``k`` (1-based) learns the target's own next-token
distribution at position ``i + k`` -- ``softmax(h_{i+k} @ U0^T)`` over the draft vocabulary,
``U0`` the target's lm_head rows of ``d2t`` -- from ``h_i`` alone (self-distillation on the
text; Medusa-2's recipe of matching the target rather than the text), kept as its top 16
renormalised (``teacher_topk``, one pass over the data). Loss: the soft-label
cross-entropy of every head, weighted ``0.8^(k-1)`` (later heads are less accurate and their
drafts are verified less often).

Model (``MedusaHeadsTorch``), term for term the runtime's (``drafters.medusa``):
``r_k = h + SiLU(W_k h + b_k)``, ``logits_k = U_k r_k`` (soft-capped like the target when it
has a soft-cap). Initialisation: ``W_k = 0``, ``b_k = 0`` (so ``r_k = h``, as the paper's zero
init), ``U_k = U0``.

Draft vocabulary (``choose_vocab``): the ``V`` tokens that occur most often in the recorded
text, plus the target's end-of-generation tokens; a token outside it is never drafted.

Held-out accuracy per head: on sequences not trained on, the fraction of positions where the
head's argmax equals the target's top-1 over its **whole** vocabulary at ``i + k`` (computed
with the full lm_head for a sample of positions; a top-1 outside ``d2t`` counts as a miss),
and the same against the target's top-1 within ``d2t``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..medusa_gguf import TargetReadout, read_target_readout
from .medusa_data import MedusaData
from .schedule import warmup_cosine


@dataclass
class MedusaConfig:
    """Settings of ``train_medusa``.

    Attributes:
        n_heads: K. vocab_size: V (draft vocabulary).
        steps / batch: optimiser steps, positions per step.
        lr: AdamW peak rate (linear warm-up ``warmup`` steps, cosine to ``min_lr_frac``).
        readout_lr_frac: the readouts' rate relative to ``lr`` (they start from the lm_head);
            0 (default) keeps them the lm_head's rows: ~4x fewer parameters to fit on a few
            hundred thousand tokens, and a cheaper backward pass.
        teacher_k: the target distribution kept per position (top-k, renormalised).
        weight_decay: AdamW decay of the matrices.
        val_frac: sequences held out. n_val_full: held-out positions scored against the
            full-vocabulary top-1.
        deadline: stop training (and evaluate, export) once ``time.time()`` passes it.
    """

    n_heads: int = 4
    vocab_size: int = 2048
    steps: int = 1500
    batch: int = 256
    lr: float = 1e-3
    warmup: int = 30
    min_lr_frac: float = 0.1
    readout_lr_frac: float = 0.0
    teacher_k: int = 16
    weight_decay: float = 0.01
    head_decay: float = 0.8
    val_frac: float = 0.05
    n_val_full: int = 512
    seed: int = 0
    threads: int | None = None
    deadline: float | None = None
    log_every: int = 50


def choose_vocab(data: MedusaData, size: int, n_vocab: int, always: list[int]) -> np.ndarray:
    """[size] int64 sorted target ids: ``always`` plus the most frequent tokens of the data
    (BOS-first chunks: the first token of each sequence is left out)."""
    mask = np.ones(data.n_tokens, dtype=bool)
    mask[data.starts[:-1]] = False
    counts = np.bincount(data.tokens[mask].astype(np.int64), minlength=n_vocab).astype(np.float64)
    counts[list(always)] = np.inf
    top = np.argsort(-counts, kind="stable")[:size]
    return np.sort(top).astype(np.int64)


class MedusaHeadsTorch(torch.nn.Module):
    """K Medusa heads: ``r_k = h + SiLU(W_k h + b_k)``, ``logits_k = U_k r_k``."""

    def __init__(self, n_heads: int, n_embd: int, readout: np.ndarray, softcap: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n_heads, n_embd, n_embd))
        self.b = torch.nn.Parameter(torch.zeros(n_heads, n_embd))
        u0 = torch.from_numpy(np.ascontiguousarray(readout, dtype=np.float32))
        self.u = torch.nn.Parameter(u0[None].repeat(n_heads, 1, 1).contiguous())
        self.softcap = float(softcap)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """[B, E] -> [K, B, V] logits."""
        u = torch.einsum("bi,koi->kbo", h, self.w) + self.b[:, None, :]
        r = h[None] + F.silu(u)
        z = torch.einsum("kbi,kvi->kbv", r, self.u)
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def _teacher(h: torch.Tensor, u0: torch.Tensor, softcap: float) -> torch.Tensor:
    z = h @ u0.T
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z


def teacher_topk(hidden: np.ndarray, u0: torch.Tensor, softcap: float, k: int = 16, chunk: int = 4096):
    """The target's draft-vocabulary distribution at every position, kept as its top ``k``:
    (ids [N, k] int64 draft ids best first, probs [N, k] float32 renormalised over them).
    One pass over the data (``N * E * V`` multiply-adds), shared by every head and step."""
    n = hidden.shape[0]
    ids = np.empty((n, k), np.int64)
    probs = np.empty((n, k), np.float32)
    with torch.no_grad():
        for lo in range(0, n, chunk):
            z = _teacher(torch.from_numpy(hidden[lo : lo + chunk]), u0, softcap)
            v, i = torch.topk(z, k, dim=1)
            ids[lo : lo + chunk] = i.numpy()
            probs[lo : lo + chunk] = F.softmax(v, dim=1).numpy()
    return ids, probs


def _split(data: MedusaData, frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = data.n_seq
    perm = rng.permutation(n)
    n_val = max(1, int(round(n * frac))) if n > 1 else 0
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def _positions(data: MedusaData, seqs: np.ndarray, n_heads: int) -> np.ndarray:
    """Global indices i of positions with i + n_heads still inside their sequence."""
    out = [np.arange(data.starts[s], data.starts[s + 1] - n_heads) for s in seqs]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


@dataclass
class MedusaResult:
    steps: int
    seconds: float
    train_loss: list[float]
    val_acc_draft: list[float]
    val_acc_full: list[float]
    val_coverage: float
    n_train_tokens: int
    n_val_tokens: int
    log: list[dict] = field(default_factory=list)
    coverage_by_size: dict = field(default_factory=dict)


def _lr(cfg, step: int) -> float:
    return warmup_cosine(step, lr=cfg.lr, warmup=cfg.warmup, steps=cfg.steps, min_lr_frac=cfg.min_lr_frac)


def full_top1(tr: "TargetReadout", h: np.ndarray, chunk: int = 16384) -> np.ndarray:
    """[n] int64 the target's top-1 over its whole vocabulary for final-norm rows ``h``
    (the lm_head dequantised chunk by chunk; soft-capping keeps the order)."""
    ht = torch.from_numpy(np.ascontiguousarray(h, dtype=np.float32))
    best = torch.full((h.shape[0],), -np.inf)
    arg = torch.zeros(h.shape[0], dtype=torch.int64)
    for lo in range(0, tr.n_vocab, chunk):
        ids = np.arange(lo, min(lo + chunk, tr.n_vocab))
        z = ht @ torch.from_numpy(tr.rows(ids)).T
        v, i = z.max(dim=1)
        better = v > best
        best = torch.where(better, v, best)
        arg = torch.where(better, i + lo, arg)
    return arg.numpy()


def evaluate(model: MedusaHeadsTorch, data: MedusaData, pos: np.ndarray, top1_draft: np.ndarray, d2t: np.ndarray,
             full: np.ndarray | None) -> tuple[list[float], list[float]]:  # fmt: skip
    """Per head: accuracy against the target's top-1 within ``d2t`` (``top1_draft``: [N] draft
    ids), and (``full``: the
    full-vocabulary top-1 of every row, -1 where unknown) against its full top-1 at the
    positions where it is known."""
    k_heads = model.w.shape[0]
    acc_d = np.zeros(k_heads)
    acc_f = np.zeros(k_heads)
    n_f = np.zeros(k_heads)
    with torch.no_grad():
        for lo in range(0, pos.size, 1024):
            p = pos[lo : lo + 1024]
            z = model(torch.from_numpy(data.hidden[p]))  # [K, B, V]
            pred = z.argmax(-1).numpy()
            for k in range(k_heads):
                t = top1_draft[p + k + 1]
                acc_d[k] += float((pred[k] == t).sum())
                if full is not None:
                    f = full[p + k + 1]
                    known = f >= 0
                    acc_f[k] += float((d2t[pred[k][known]] == f[known]).sum())
                    n_f[k] += float(known.sum())
    n = max(1, pos.size)
    return (acc_d / n).tolist(), (acc_f / np.maximum(n_f, 1)).tolist() if full is not None else []


def train_medusa(data: MedusaData, target, cfg: MedusaConfig, *, d2t: np.ndarray | None = None, progress: bool = True,
                 log_path: str | os.PathLike | None = None):  # fmt: skip
    """Train K heads; returns (``MedusaWeights``, ``MedusaResult``).

    Args:
        data: recorded final hidden states (``medusa_data.load_data``).
        target: the target GGUF path (lm_head rows, soft-cap, EOG ids).
        d2t: a draft vocabulary (default: ``choose_vocab`` over the data).
    """
    from tqdm.auto import tqdm

    from ..medusa_gguf import MedusaWeights

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    tr = read_target_readout(target)
    if data.hidden.shape[1] != tr.n_embd:
        raise ValueError(f"the data holds hidden states of size {data.hidden.shape[1]}, the target has {tr.n_embd}")
    if d2t is None:
        d2t = choose_vocab(data, cfg.vocab_size, tr.n_vocab, tr.eog)
    d2t = np.asarray(d2t, dtype=np.int64)
    u0_np = tr.rows(d2t)
    u0 = torch.from_numpy(u0_np)
    train_seqs, val_seqs = _split(data, cfg.val_frac, cfg.seed)
    tr_pos = _positions(data, train_seqs, cfg.n_heads)
    va_pos = _positions(data, val_seqs, cfg.n_heads)
    if tr_pos.size == 0:
        raise ValueError("no training positions: record more text")
    model = MedusaHeadsTorch(cfg.n_heads, tr.n_embd, u0_np, tr.softcap)
    groups = [
        dict(params=[model.w], weight_decay=cfg.weight_decay, lr_frac=1.0),
        dict(params=[model.b], weight_decay=0.0, lr_frac=1.0),
    ]
    if cfg.readout_lr_frac > 0:
        groups.append(dict(params=[model.u], weight_decay=0.0, lr_frac=cfg.readout_lr_frac))
    else:  # readouts stay the lm_head's rows (and the backward pass skips their gradient)
        model.u.requires_grad_(False)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    t_ids, t_probs = teacher_topk(data.hidden, u0, tr.softcap, k=cfg.teacher_k)
    t_ids_t, t_probs_t = torch.from_numpy(t_ids), torch.from_numpy(t_probs)
    hid = torch.from_numpy(data.hidden)
    rng = np.random.default_rng(cfg.seed + 1)
    weights = torch.tensor([cfg.head_decay**k for k in range(cfg.n_heads)])
    losses: list[float] = []
    log: list[dict] = []
    bar = tqdm(total=cfg.steps, desc="medusa", disable=not progress)
    step = 0
    try:
        for step in range(cfg.steps):
            if cfg.deadline is not None and time.time() >= cfg.deadline:
                break
            lr = _lr(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr * g["lr_frac"]
            p = torch.from_numpy(rng.choice(tr_pos, size=min(cfg.batch, tr_pos.size), replace=False))
            z = model(hid[p])  # [K, B, V]
            logp = F.log_softmax(z, -1)
            ce = torch.stack([
                -(t_probs_t[p + k + 1] * logp[k].gather(1, t_ids_t[p + k + 1])).sum(-1).mean() for k in range(cfg.n_heads)
            ])  # fmt: skip
            loss = (ce * weights).sum() / weights.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if step % cfg.log_every == 0:
                entry = dict(step=step, loss=float(loss.detach()), ce=[float(c) for c in ce.detach()], lr=lr,
                             t=time.time() - t0)  # fmt: skip
                log.append(entry)
                if log_path is not None:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(entry) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        else:
            step = cfg.steps
    finally:
        bar.close()
    # -- held-out accuracy -------------------------------------------------------------------
    full = None
    if va_pos.size and cfg.n_val_full:
        sample = np.random.default_rng(cfg.seed + 2).choice(va_pos, size=min(cfg.n_val_full, va_pos.size), replace=False)
        va_eval = np.sort(sample)
        need = np.unique(np.concatenate([va_eval + k + 1 for k in range(cfg.n_heads)]))
        full = np.full(data.n_tokens, -1, dtype=np.int64)
        full[need] = full_top1(tr, data.hidden[need])
    else:
        va_eval = va_pos
    acc_d, acc_f = evaluate(model, data, va_eval, t_ids[:, 0], d2t, full) if va_eval.size else ([], [])
    coverage = float(np.isin(full[full >= 0], d2t).mean()) if full is not None and (full >= 0).any() else float("nan")
    by_size = {}  # how often the target's full top-1 lies in a draft vocabulary of each size
    if full is not None and (full >= 0).any():
        for size in (1024, 2048, 4096, 8192, 16384):
            by_size[size] = round(float(np.isin(full[full >= 0], choose_vocab(data, size, tr.n_vocab, tr.eog)).mean()), 4)
    res = MedusaResult(
        steps=step, seconds=time.time() - t0, train_loss=losses[-50:], val_acc_draft=acc_d, val_acc_full=acc_f,
        val_coverage=coverage, n_train_tokens=int(tr_pos.size), n_val_tokens=int(va_pos.size), log=log,
        coverage_by_size=by_size,
    )  # fmt: skip
    with torch.no_grad():
        wts = MedusaWeights(
            w=model.w.detach().numpy().copy(), b=model.b.detach().numpy().copy(),
            out=model.u.detach().numpy()[:1].copy() if cfg.readout_lr_frac <= 0 else model.u.detach().numpy().copy(),
            d2t=d2t, softcap=tr.softcap, target_vocab_size=tr.n_vocab,
            training=dict(config={k: v for k, v in asdict(cfg).items() if k != "deadline"}, steps=step,
                          seconds=round(res.seconds, 1), n_train_positions=res.n_train_tokens,
                          n_val_positions=res.n_val_tokens, val_acc_full_top1=[round(a, 4) for a in acc_f],
                          val_acc_draft_top1=[round(a, 4) for a in acc_d], val_top1_in_vocab=round(coverage, 4),
                          val_top1_in_vocab_by_size=by_size),
        )  # fmt: skip
    return wts, res
