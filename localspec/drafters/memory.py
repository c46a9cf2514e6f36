"""Drafting memory: a bounded store of earlier requests' prompts and outputs that every
request of a process drafts from (issue 29).

Desktop workloads are streams of related requests (a chat, an editor's completions, an
agent's calls, a batch with one instruction): what one request wrote the next often writes
again, and the request's own history cannot propose it. ``DraftMemory`` keeps the token
sequences of finished requests (and of a corpus: ``localspec memory build``) in a ring of a
fixed number of tokens, sized from a budget in MiB; once it is full, the oldest tokens that
no draft read are evicted first (tokens a draft used are written again: second chance, see
``native/ls_memory.c``). It is indexed by n-grams (orders ``min_n..max_n``) in C (``native/ls_memory.c``);
a lookup reads at most ``max_occurrences`` occurrences of the longest stored suffix of the
request's history, so its cost does not depend on how much is stored.

The continuations of those occurrences are merged into a trie that counts the occurrences
through each node, as SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) scores its
global suffix tree: a node's share is its count over its parent's, nodes whose share is
below ``min_share`` (0.1) are dropped, and the more a continuation recurred, the higher its
acceptance estimate. The n-gram drafter merges these nodes into its own tree
(``NgramDrafter(memory=...)``), so one verify call holds both; each memory node's score is
the parent's score times the estimate of its bucket (match length x share rank), learned
online from the verifications like the n-gram buckets (an ``AcceptanceTracker`` of its own,
so that a request whose memory drafts fail does not lower its own n-grams'). The learned
counts are folded back into the memory (``fold``) so later requests (and saved files) start
from them.

Outputs never depend on the memory: it only proposes drafts, which the target verifies.

Files (``save`` / ``load``): a versioned header, the vocabulary fingerprint of the model the
tokens belong to (``vocab_fingerprint``), the bucket counts and the stored tokens, with a
SHA-256 of everything; written to a temporary file and renamed over the target.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import native
from ..errors import AllocationError, LocalSpecError

DEFAULT_BUDGET_MIB = 64.0
MIN_SHARE = 0.1
# match-length buckets (lower edges): the match length of a node is how far back the
# request's history agrees with the text before the occurrence, plus the node's depth
LEN_EDGES = (2, 3, 4, 6, 9, 16, 32)
N_RANK = 5  # share ranks, see ls_memory_draft: >=0.8 & >=3 occ., >=0.8 & 2, one occurrence, [0.4, 0.8), < 0.4
N_BUCKETS = len(LEN_EDGES) * N_RANK
MAX_MATCH = 64
# Heuristic priors (not fitted offline): a continuation that recurred and a long match are
# accepted more often. The tracker refines them online and ``fold`` keeps what it learned.
_RANK_BASE = np.array([0.45, 0.35, 0.2, 0.15, 0.05])
_LEN_SHRINK = np.array([1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2])
PRIOR = (1.0 - np.outer(_LEN_SHRINK, 1.0 - _RANK_BASE)).ravel()

_MAGIC = b"LSDRAFTMEM\n"
_VERSION = 1
_HEADER = struct.Struct("<11sI32sQ")  # magic, version, SHA-256 of the rest, length of the rest


class MemoryFileError(LocalSpecError):
    """A drafting-memory file that cannot be used (corrupt, truncated, another model's, or
    another version): the message is one line."""


def vocab_fingerprint(model) -> str:
    """Hex SHA-256 of ``model``'s vocabulary (every token's text, in id order): a memory's
    tokens mean the same text only under the same fingerprint."""
    from .vocab_check import _texts

    h = hashlib.sha256()
    for t in _texts(model, model.n_vocab):
        h.update(len(t).to_bytes(4, "little"))
        h.update(t)
    return h.hexdigest()


def _lib():
    if not native.AVAILABLE:
        raise LocalSpecError(f"the drafting memory needs the native library ({native.LOAD_ERROR})")
    from ..native import lib

    return lib


def capacity_for(budget_mib: float, n_orders: int) -> int:
    """Most tokens a memory of ``n_orders`` orders holds within ``budget_mib`` MiB."""
    lib = _lib()
    budget = int(budget_mib * 2**20)
    lo, hi = 16, 2**31
    if lib.ls_memory_bytes(lo, n_orders) > budget:
        return lo
    while lo < hi:  # largest cap whose allocation fits
        mid = (lo + hi + 1) // 2
        if lib.ls_memory_bytes(mid, n_orders) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class MemoryInfo:
    """What a memory holds (``DraftMemory.info``)."""

    tokens: int  # stored tokens (separators excluded)
    documents: int
    capacity: int  # ring slots (tokens and separators)
    bytes: int  # allocated by the store
    written: int  # tokens ever written (separators included)
    min_n: int
    max_n: int
    vocab: str | None
    observations: int  # verification outcomes behind the bucket estimates

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DraftMemory:
    """A bounded, thread-safe store of token sequences to draft from.

    Args:
        budget_mib: memory budget of the store in MiB (ring, links and table; the capacity in
            tokens follows: ~100 bytes per token with the default orders).
        min_n / max_n: n-gram orders indexed (a suffix shorter than ``min_n`` is not looked up).
        max_occurrences: most occurrences read per lookup (bounds the cost of a draft).
        vocab: the vocabulary fingerprint of the tokens (``vocab_fingerprint``), or None
            (unknown: ``save`` then refuses).
    Raises:
        LocalSpecError: the native library is not available.
        ValueError: orders out of range.
        AllocationError: the store cannot be allocated (a ``MemoryError`` and a ``LocalSpecError``).
    """

    def __init__(
        self,
        budget_mib: float = DEFAULT_BUDGET_MIB,
        *,
        min_n: int = 2,
        max_n: int = 6,
        max_occurrences: int = 32,
        vocab: str | None = None,
    ) -> None:
        if not 1 <= min_n <= max_n <= 32:
            raise ValueError(f"need 1 <= min_n <= max_n <= 32, got {min_n}, {max_n}")
        if not (budget_mib > 0 and math.isfinite(budget_mib)):
            raise ValueError(f"the memory budget must be a finite number of MiB > 0, got {budget_mib}")
        self._lib = _lib()
        self.budget_mib = float(budget_mib)
        self.min_n, self.max_n = int(min_n), int(max_n)
        self.max_occurrences = int(max_occurrences)
        self.vocab = vocab
        self.capacity = capacity_for(budget_mib, self.max_n - self.min_n + 1)
        self._ptr = self._lib.ls_memory_new(self.capacity, self.min_n, self.max_n)
        if not self._ptr:
            raise AllocationError(f"cannot allocate a drafting memory of {budget_mib:g} MiB: give a smaller budget")
        self._lock = threading.Lock()
        self.n_written = 0  # documents written (a draft skips an empty memory without a call)
        self.acc = np.zeros(N_BUCKETS)  # accepted / tried nodes per bucket, over the memory's life
        self.n = np.zeros(N_BUCKETS)
        self._info = np.zeros(3, dtype=np.int32)  # of the last draft: order matched, occurrences, nodes added
        self._info_addr = self._info.ctypes.data
        self._stats = np.zeros(6, dtype=np.int64)
        # set by ``load``: tokens of the file that this memory's budget could not hold (the
        # oldest), and the budget the file was saved with
        self.dropped_on_load = 0
        self.saved_budget_mib: float | None = None

    def __del__(self) -> None:
        ptr = getattr(self, "_ptr", None)
        if ptr and getattr(self, "_lib", None) is not None:
            self._lib.ls_memory_free(ptr)
            self._ptr = None

    # -- writing and reading ------------------------------------------------------------------

    def write(self, tokens: Sequence[int]) -> None:
        """Store one document (a request's prompt and output, a file of a corpus).

        Raises:
            ValueError: a negative token id (nothing is written).
        """
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        if arr.size == 0:
            return
        with self._lock:
            if self._lib.ls_memory_write(self._ptr, arr.ctypes.data, arr.size) != 0:
                raise ValueError("drafting memory: token ids must be >= 0")
            self.n_written += 1

    def stored(self) -> np.ndarray:
        """[capacity or less] int32: the stored positions, oldest first (-1 = a separator
        between documents)."""
        with self._lock:
            self._lib.ls_memory_stats(self._ptr, self._stats.ctypes.data)
            total, base = int(self._stats[0]), int(self._stats[1])
            out = np.empty(total - base, dtype=np.int32)
            if out.size:
                self._lib.ls_memory_tokens(self._ptr, base, out.size, out.ctypes.data)
            return out

    def documents(self) -> list[np.ndarray]:
        """The stored documents, oldest first (the oldest may have lost its beginning)."""
        toks = self.stored()
        cuts = np.flatnonzero(toks < 0)
        parts = np.split(toks, cuts)
        return [p[p >= 0] for p in parts if np.any(p >= 0)]

    def usage(self) -> dict:
        """The store's counters, without copying what it holds: ``written`` (positions ever
        written, separators included), ``stored`` (positions held now), ``capacity``,
        ``entries`` / ``slots`` of its n-gram table, ``bytes`` allocated."""
        with self._lock:
            self._lib.ls_memory_stats(self._ptr, self._stats.ctypes.data)
            total, base, cap, used, slots, nbytes = (int(x) for x in self._stats)
        return dict(written=total, stored=total - base, capacity=cap, entries=used, slots=slots, bytes=nbytes)

    def info(self) -> MemoryInfo:
        toks = self.stored()
        with self._lock:
            self._lib.ls_memory_stats(self._ptr, self._stats.ctypes.data)
            written, nbytes = int(self._stats[0]), int(self._stats[5])
        n_docs = len(self.documents())
        return MemoryInfo(
            tokens=int(np.count_nonzero(toks >= 0)),
            documents=n_docs,
            capacity=self.capacity,
            bytes=nbytes,
            written=written,
            min_n=self.min_n,
            max_n=self.max_n,
            vocab=self.vocab,
            observations=int(self.n.sum()),
        )

    def draft_into(self, query: np.ndarray, trie, *, params, n_in: int, bucket_offset: int, cap: int) -> int:
        """Merge the continuations of ``query`` into the first ``n_in`` nodes of ``trie``'s
        buffers (see ``ls_memory_draft``); returns the new node count.

        Args:
            query: [k] int32 the request's last tokens (its last one is the root).
            trie: an object with int32 buffers ``tok``, ``par``, ``dep``, ``bucket`` and the
                float64 buffer ``score``, each of at least ``cap`` entries, and ``addr``: their
                addresses in that order.
            params: ``native._lib.DraftParams`` (``n_rank`` = 5; ``estimates`` = this
                memory's buckets).
        Raises:
            ValueError / MemoryError: the C call failed.
        """
        q = np.ascontiguousarray(query, dtype=np.int32)
        tok, par, dep, score, bucket = trie.addr
        with self._lock:
            n = self._lib.ls_memory_draft(
                self._ptr, q.ctypes.data, q.size, params, MIN_SHARE, bucket_offset, n_in, cap,
                tok, par, dep, score, bucket, self._info_addr,
            )  # fmt: skip
        if n < 0:
            from ..native import _lib as raw

            raise MemoryError("drafting memory: out of memory") if n == raw.ERR_NOMEM else ValueError(f"drafting memory: error {n}")
        return int(n)

    def absorb(self, other: "DraftMemory") -> None:
        """Write ``other``'s documents (oldest first) into this memory and add its bucket
        counts (loading a saved memory into one already shared with drafters)."""
        for doc in other.documents():
            self.write(doc)
        self.fold(other.acc, other.n)

    # -- calibration --------------------------------------------------------------------------

    def rates(self) -> np.ndarray:
        """[N_BUCKETS] float64 long-run acceptance rate per bucket (the prior with 8
        pseudo-observations, plus every outcome folded in)."""
        with self._lock:
            return (self.acc + 8.0 * PRIOR) / (self.n + 8.0)

    def fold(self, acc: np.ndarray, n: np.ndarray) -> None:
        """Add verification outcomes (accepted and tried nodes per bucket) learned by a drafter."""
        with self._lock:
            self.acc += np.asarray(acc, dtype=np.float64)
            self.n += np.asarray(n, dtype=np.float64)

    # -- files --------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the memory to ``path`` atomically (a temporary file in the same folder,
        renamed over it).

        Raises:
            ValueError: the memory has no vocabulary fingerprint.
            OSError: the file cannot be written (``path`` is unchanged).
        """
        if not self.vocab:
            raise ValueError("a drafting memory is saved only with its vocabulary fingerprint (vocab=...)")
        toks = self.stored()
        meta = dict(vocab=self.vocab, min_n=self.min_n, max_n=self.max_n, budget_mib=self.budget_mib,
                    max_occurrences=self.max_occurrences, n_tokens=int(toks.size))  # fmt: skip
        with self._lock:
            calib = np.concatenate([self.acc, self.n]).astype("<f8")
        meta_b = json.dumps(meta).encode()
        body = b"".join([struct.pack("<I", len(meta_b)), meta_b, calib.tobytes(), toks.astype("<i4").tobytes()])
        head = _HEADER.pack(_MAGIC, _VERSION, hashlib.sha256(body).digest(), len(body))
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".draftmem-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, *, vocab: str | None = None, budget_mib: float | None = None) -> "DraftMemory":
        """Read a memory written by ``save``.

        Args:
            vocab: the fingerprint of the model it will draft for; None accepts any (``info``).
            budget_mib: the budget of the new memory (default: the saved one); a smaller one
                keeps the most recent tokens (``dropped_on_load`` counts the others).
        Raises:
            MemoryFileError: missing, unreadable, corrupt, truncated, another version, or
                another model's file (one-line message).
        """
        name = os.fspath(path)
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError as e:
            raise MemoryFileError(f"cannot read the drafting memory {name}: {e.strerror or e}") from None
        if len(data) < _HEADER.size or not data.startswith(_MAGIC):
            raise MemoryFileError(f"{name} is not a localspec drafting memory")
        magic, version, digest, size = _HEADER.unpack_from(data)
        if version != _VERSION:
            raise MemoryFileError(f"{name} is a drafting memory of format version {version}; this localspec reads {_VERSION}")
        body = data[_HEADER.size :]
        if len(body) != size:
            raise MemoryFileError(f"{name} is truncated ({len(body)} of {size} bytes after the header)")
        if hashlib.sha256(body).digest() != digest:
            raise MemoryFileError(f"{name} is corrupt (checksum mismatch)")
        try:
            (n_meta,) = struct.unpack_from("<I", body)
            meta = json.loads(body[4 : 4 + n_meta])
            off = 4 + n_meta
            calib = np.frombuffer(body, dtype="<f8", count=2 * N_BUCKETS, offset=off)
            off += calib.nbytes
            toks = np.frombuffer(body, dtype="<i4", count=int(meta["n_tokens"]), offset=off)
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise MemoryFileError(f"{name} is corrupt ({e})") from None
        if vocab is not None and meta.get("vocab") != vocab:
            raise MemoryFileError(f"{name} belongs to another model's vocabulary (a memory is tied to its tokenizer)")
        mem = cls(
            budget_mib if budget_mib is not None else float(meta["budget_mib"]),
            min_n=int(meta["min_n"]),
            max_n=int(meta["max_n"]),
            max_occurrences=int(meta.get("max_occurrences", 32)),
            vocab=meta.get("vocab"),
        )
        cuts = np.flatnonzero(toks < 0)
        for part in np.split(toks, cuts):
            part = part[part >= 0]
            if part.size:
                mem.write(part)
        mem.acc[:] = calib[:N_BUCKETS]
        mem.n[:] = calib[N_BUCKETS:]
        mem.dropped_on_load = int((toks >= 0).sum()) - int((mem.stored() >= 0).sum())
        mem.saved_budget_mib = float(meta["budget_mib"])
        return mem


__all__ = ["DEFAULT_BUDGET_MIB", "DraftMemory", "MemoryFileError", "MemoryInfo", "capacity_for", "vocab_fingerprint"]
