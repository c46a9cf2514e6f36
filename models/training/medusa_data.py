"""Training data for Medusa heads: the target's final hidden states over text, on disk.

A Medusa head (Cai et al. 2024, arXiv 2401.10774) reads one row per position: the target's
final hidden state, i.e. the output of its final norm (graph tensor ``result_norm``, the row
the lm_head multiplies). Everything a head learns from is derived from those rows:

* the input of every head at position ``i`` is ``h_i``;
* the target's next-token distribution at position ``j`` over the draft vocabulary is
  ``softmax(h_j @ W[d2t]^T)`` (``W`` the target's lm_head rows, dequantised from the GGUF;
  soft-capping applied when the target has it), computed by the trainer, so head ``k``'s soft
  label at ``i`` is the target's distribution at ``i + k`` -- what the target itself predicts
  ``k + 1`` places after ``i`` given the text up to ``i + k``.

So recording stores only ``h`` (640 floats per token on Gemma 3 270M) and the tokens, and the
draft vocabulary can be chosen after recording.

**How it is recorded** (``FinalNormRecorder``): teacher forcing, one prefill per chunk of the
plan (``eagle3_data.make_plan``'s text chunks, ``seq_len`` tokens, BOS first) with every row an
output, through a ``cb_eval`` tap that copies ``result_norm`` and then returns ``False``: ggml's
scheduler skips the rest of the graph, which after ``result_norm`` is only the 262k-row
lm_head. Every layer has run by then (the rows are exactly the ones a full decode computes:
``tests/test_medusa.py`` compares them with the runtime's tap on a real decode).

Shards (``medusa-00000.npz`` ...) mirror the plan's shards; a rerun skips finished ones and
``deadline`` bounds a run by wall-clock time. ``h`` is stored as float16 scaled per row
(``h_scale``), like the EAGLE-3 features.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHARD_GLOB = "medusa-[0-9][0-9][0-9][0-9][0-9].npz"


class _StopAtFinalNorm:
    """``cb_eval`` tap: copies ``result_norm`` rows and stops the graph there."""

    NAME = b"result_norm"

    def __init__(self, n_embd: int) -> None:
        from localspec.backend import _llama
        from localspec.backend.features import _NAME_OFFSET
        from localspec.backend.tensor import GgmlTensor

        self._name_offset, self._tensor, self._get = _NAME_OFFSET, GgmlTensor, _llama.ggml_tensor_get
        self.n_embd = int(n_embd)
        self.rows: list[np.ndarray] = []
        self.callback = _llama.lib.ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, t_ptr: int, ask: bool, _user_data) -> bool:
        try:
            if ctypes.string_at(t_ptr + self._name_offset) != self.NAME:
                return not ask  # not observed: a True here would split the graph at every node
            if ask:
                return True
            t = self._tensor.from_address(t_ptr)
            out = np.empty((int(t.ne[1]), self.n_embd), dtype=np.float32)
            self._get(t_ptr, out.ctypes.data, 0, out.nbytes)
            self.rows.append(out)
            return False  # stop: the lm_head is not computed
        except Exception:  # never raise into C
            return not ask

    def take(self) -> np.ndarray:
        h = np.concatenate(self.rows) if self.rows else np.zeros((0, self.n_embd), np.float32)
        self.rows = []
        return h


class FinalNormRecorder:
    """The target's final hidden states of given text (teacher forcing), fast.

    Args:
        target: the target GGUF path.
        n_batch: tokens per decode (the longest chunk).
        n_threads: llama.cpp threads (default: all).
    """

    def __init__(self, target, *, n_batch: int = 512, n_threads: int | None = None) -> None:
        from localspec.backend import Batch, Context, Model

        self.model = Model(target)
        self.n_embd = self.model.n_embd
        self.tap = _StopAtFinalNorm(self.n_embd)
        self.ctx = Context(self.model, n_ctx=max(n_batch, 256), n_batch=n_batch, n_seq_max=1, n_threads=n_threads,
                           cb_eval=self.tap.callback)  # fmt: skip
        self.batch = Batch(n_batch, 1)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def record(self, tokens: Sequence[int]) -> np.ndarray:
        """[len(tokens), n_embd] float32 final-norm rows of ``tokens`` (at most ``n_batch``).

        Raises:
            ValueError: more tokens than the batch holds.
            RuntimeError: llama.cpp returned another number of rows.
        """
        tokens = [int(t) for t in tokens]
        if len(tokens) > self.batch.capacity:
            raise ValueError(f"{len(tokens)} tokens exceed the batch capacity {self.batch.capacity}")
        self.ctx.clear()
        self.tap.take()
        self.batch.set_sequence(tokens, 0, seq_id=0, output="all")
        self.ctx.decode(self.batch)
        h = self.tap.take()
        if h.shape[0] != len(tokens):
            raise RuntimeError(f"captured {h.shape[0]} final-norm rows for {len(tokens)} tokens")
        return h


def write_shard(path: Path, tokens: Sequence[np.ndarray], hidden: Sequence[np.ndarray]) -> None:
    """Save sequences (``tokens[i]`` [n_i] int, ``hidden[i]`` [n_i, E] float32) as one ``.npz``
    (written to a temporary name, then renamed)."""
    h = np.concatenate(hidden).astype(np.float32)
    scale = np.maximum(np.abs(h).max(axis=1), 1e-30) / 32768.0
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        lengths=np.array([t.size for t in tokens], dtype=np.int64),
        tokens=np.concatenate(tokens).astype(np.int32),
        hidden=(h / scale[:, None]).astype(np.float16),
        hidden_scale=scale.astype(np.float32),
    )
    os.replace(tmp, path)


@dataclass
class MedusaData:
    """Every recorded sequence, loaded.

    Attributes:
        starts: [n_seq + 1] int64 offsets of the sequences.
        tokens: [N] int32.
        hidden: [N, E] float32 final hidden states.
    """

    starts: np.ndarray
    tokens: np.ndarray
    hidden: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_seq(self) -> int:
        return int(self.starts.size - 1)


def shard_paths(data_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(data_dir).glob(SHARD_GLOB))


def load_data(data_dir: str | os.PathLike, max_tokens: int | None = None) -> MedusaData:
    """Load the finished shards of ``data_dir`` (in order, up to about ``max_tokens``).

    Raises:
        FileNotFoundError: no shard.
    """
    paths = shard_paths(data_dir)
    if not paths:
        raise FileNotFoundError(f"no recorded Medusa shards ({SHARD_GLOB}) in {data_dir}")
    lens, toks, hid = [], [], []
    n = 0
    for p in paths:
        with np.load(p) as z:
            lens.append(z["lengths"])
            toks.append(z["tokens"])
            hid.append(z["hidden"].astype(np.float32) * z["hidden_scale"][:, None])
        n += toks[-1].size
        if max_tokens is not None and n >= max_tokens:
            break
    lengths = np.concatenate(lens)
    return MedusaData(np.concatenate([[0], np.cumsum(lengths)]), np.concatenate(toks), np.concatenate(hid))


def record_plan(
    target,
    data_dir: str | os.PathLike,
    plan,
    *,
    n_threads: int | None = None,
    progress: bool = True,
    deadline: float | None = None,
    max_shards: int | None = None,
    part: tuple[int, int] = (0, 1),
) -> list[Path]:
    """Record the text chunks of ``plan`` (an ``eagle3_data.DataPlan``; "gen" jobs are
    skipped) into ``data_dir/medusa-NNNNN.npz``, one shard per plan shard; resumable, and
    stopping between shards once ``time.time()`` passes ``deadline``. ``part = (j, n)``
    records only shards ``i`` with ``i % n == j`` (n processes side by side).

    Returns:
        The finished shards (old and new), in order.
    """
    from tqdm.auto import tqdm

    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_shards = len(plan.shards) if max_shards is None else min(max_shards, len(plan.shards))
    todo = [i for i in range(n_shards) if i % part[1] == part[0] and not (out / f"medusa-{i:05d}.npz").exists()]
    if todo and (deadline is None or time.time() < deadline):
        n_batch = max(len(t) for jobs in plan.shards for k, t in jobs if k == "text")
        rec = FinalNormRecorder(target, n_batch=n_batch, n_threads=n_threads)
        bar = tqdm(total=sum(len(t) for i in todo for k, t in plan.shards[i] if k == "text"), unit="tok",
                   desc="final hidden states", disable=not progress)  # fmt: skip
        try:
            for i in todo:
                if deadline is not None and time.time() >= deadline:
                    break
                toks, hid = [], []
                for kind, t in plan.shards[i]:
                    if kind != "text":
                        continue
                    hid.append(rec.record(t))
                    toks.append(np.asarray(t, dtype=np.int32))
                    bar.update(len(t))
                if toks:
                    write_shard(out / f"medusa-{i:05d}.npz", toks, hid)
        finally:
            bar.close()
            rec.close()
    return shard_paths(out)
