"""Learning from use (opt-in): the token sequences of finished requests, kept in a bounded
local folder for ``localspec train-eagle3 --from-usage DIR`` (docs/eagle3-training.md).

``chat --record-usage DIR`` and ``serve --record-usage DIR`` give their engine (and serve's
batch scheduler) a ``UsageLog``; each finished request's tokens (prompt and output) are added
to it, unless the request opted out of the drafting memory (``SamplingParams.draft_memory``
False: the OpenAI field ``draft_memory: false``, or ``--no-draft-memory``), which keeps it out
of this log too. A chat turn's prompt holds the earlier turns (an editor's next completion
the text before), so a request whose prompt starts with the previous request's prompt
replaces it while it is pending (not yet written).

Storage: ``shard-NNNNN.npz`` files in the shard format of ``models.training.eagle3_data``
(``lengths``, ``n_prompt``, ``tokens``) with no features (``feats`` of width 0) and a
``greedy`` flag per sequence: the training side records the target's features and
draft-vocabulary targets over the tokens (``TeacherForcedRecorder``) before training.
Shards are written when ``flush_tokens`` tokens are pending and at ``close`` (also at exit);
after each write the oldest shards are removed until the folder's shards fit ``max_mib``.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger("localspec.usage")
SHARD_RE = re.compile(r"shard-(\d{5,})\.npz$")


def usage_shards(folder: str | os.PathLike) -> list[Path]:
    """The usage shards of ``folder``, oldest first."""
    d = Path(folder)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := SHARD_RE.match(p.name))]
    return [p for _, p in sorted(found)]


class UsageLog:
    """A bounded folder of finished requests' token sequences.

    Args:
        folder: where the shards go (created).
        max_mib: the most the folder's shards may take, in MiB (> 0); oldest shards go first.
        flush_tokens: pending tokens that trigger a shard write.
    Raises:
        ValueError: ``max_mib`` <= 0 or ``flush_tokens`` < 1.
        OSError: the folder cannot be created.
    """

    def __init__(self, folder: str | os.PathLike, max_mib: float = 64.0, flush_tokens: int = 8192) -> None:
        if not max_mib > 0:
            raise ValueError(f"the usage log's bound must be > 0 MiB, got {max_mib}")
        if flush_tokens < 1:
            raise ValueError(f"flush_tokens must be >= 1, got {flush_tokens}")
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_mib * 2**20)
        self.flush_tokens = int(flush_tokens)
        self._lock = threading.Lock()
        self._pending: list[tuple[np.ndarray, int, bool]] = []  # (tokens, n_prompt, greedy)
        self.n_recorded = 0  # sequences added (replacements included)
        self.n_skipped = 0  # requests that opted out
        self._closed = False
        atexit.register(self.close)

    def add(self, tokens: Sequence[int], n_prompt: int, *, greedy: bool, allowed: bool = True) -> None:
        """Record one finished request: ``tokens`` = prompt + output (int ids), the first
        ``n_prompt`` of them given. ``allowed`` False (the request opted out) records nothing."""
        if not allowed:
            with self._lock:
                self.n_skipped += 1
            return
        toks = np.asarray(tokens, dtype=np.int32)
        if toks.size < 2 or self._closed:
            return
        with self._lock:
            if self._pending:
                last, last_prompt, _ = self._pending[-1]
                if last_prompt <= n_prompt and np.array_equal(toks[:last_prompt], last[:last_prompt]):
                    self._pending.pop()  # the next turn of the same conversation (or keystroke of an edit)
            self._pending.append((toks, int(n_prompt), bool(greedy)))
            self.n_recorded += 1
            if sum(t.size for t, _, _ in self._pending) >= self.flush_tokens:
                self._flush_locked()

    def add_generation(self, gen) -> None:
        """``add`` for a finished ``generation.Generation`` (engine and scheduler hook); a
        request that failed (``finish_reason == "error"``) is not recorded."""
        if gen.finish_reason == "error" or not gen.out_tokens:
            return
        params = gen.state.params
        self.add(gen.prompt + gen.out_tokens, len(gen.prompt), greedy=params.is_greedy,
                 allowed=bool(getattr(params, "draft_memory", True)))  # fmt: skip

    def flush(self) -> Path | None:
        """Write the pending sequences as one shard now (None when nothing is pending)."""
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> Path | None:
        if not self._pending:
            return None
        seqs, self._pending = self._pending, []
        have = usage_shards(self.folder)
        nxt = int(SHARD_RE.match(have[-1].name).group(1)) + 1 if have else 0
        path = self.folder / f"shard-{nxt:05d}.npz"
        try:
            write_usage_shard(path, [t for t, _, _ in seqs], [n for _, n, _ in seqs], [g for _, _, g in seqs])
            self._enforce_bound()
        except OSError as e:  # a full or read-only disk must not fail the requests: one line, data dropped
            log.warning("usage log: %d sequences not written to %s: %s", len(seqs), self.folder, e.strerror or e)
            return None
        return path

    def _enforce_bound(self) -> None:
        shards = usage_shards(self.folder)
        sizes = [p.stat().st_size for p in shards]
        total = sum(sizes)
        for p, n in zip(shards, sizes):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= n

    def close(self) -> None:
        """Write what is pending; later ``add`` calls record nothing. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            atexit.unregister(self.close)


def write_usage_shard(path: Path, seqs: Sequence[np.ndarray], n_prompt: Sequence[int], greedy: Sequence[bool]) -> None:
    """One shard of token sequences without features or targets (see the module doc)."""
    tokens = np.concatenate(seqs).astype(np.int32)
    n = tokens.size
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        lengths=np.array([s.size for s in seqs], dtype=np.int64),
        n_prompt=np.asarray(n_prompt, dtype=np.int64),
        tokens=tokens,
        feats=np.zeros((n, 0), np.float16),
        feats_scale=np.zeros((n, 0), np.float32),
        topk_ids=np.zeros((n, 0), np.int32),
        topk_logits=np.zeros((n, 0), np.float16),
        restricted=np.array(False),
        greedy=np.asarray(greedy, dtype=bool),
        usage=np.array(True),
    )
    os.replace(tmp, path)
