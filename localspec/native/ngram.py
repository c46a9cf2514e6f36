"""The n-gram index in C (``ls_ngram``): a drop-in for ``drafters.ngram_index.NgramIndex``,
plus the n-gram drafter's trie of continuations (``draft_trie``)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import _lib, lib
from ..ngram_match import Match


class NativeNgramIndex:
    """n-gram -> continuation positions, for n in ``[1, max_n]`` (same answers as
    ``NgramIndex``). Appending a token costs O(max_n^2) whatever the history length; a
    lookup reads at most ``max_occurrences`` positions per order.

    Args:
        max_n: longest n-gram indexed (1..64).
    Raises:
        ValueError: ``max_n`` out of range.
    """

    def __init__(self, max_n: int = 4) -> None:
        if not 1 <= max_n <= 64:
            raise ValueError("max_n must be in [1, 64]")
        self.max_n = int(max_n)
        self._ptr = lib.ls_ngram_new(self.max_n)
        if not self._ptr:
            raise MemoryError("cannot allocate the n-gram index")
        self._buf = np.empty(0, dtype=np.int64)

    def __del__(self) -> None:
        if getattr(self, "_ptr", None) and lib is not None:
            lib.ls_ngram_free(self._ptr)
            self._ptr = None

    def __len__(self) -> int:
        return int(lib.ls_ngram_len(self._ptr))

    @property
    def tokens(self) -> np.ndarray:
        """[len] int32 copy of the history."""
        n = len(self)
        out = np.empty(n, dtype=np.int32)
        if n:
            lib.ls_ngram_tokens(self._ptr, 0, n, out.ctypes.data)
        return out

    def last(self) -> int:
        """The last history token (IndexError when empty)."""
        n = len(self)
        if not n:
            raise IndexError("the history is empty")
        out = np.empty(1, dtype=np.int32)
        lib.ls_ngram_tokens(self._ptr, n - 1, 1, out.ctypes.data)
        return int(out[0])

    def tail(self, n: int) -> np.ndarray:
        """[min(n, len)] int32 copy of the last ``n`` history tokens."""
        size = int(lib.ls_ngram_len(self._ptr))
        k = min(max(0, int(n)), size)
        out = np.empty(k, dtype=np.int32)
        if k:
            lib.ls_ngram_tokens(self._ptr, size - k, k, out.ctypes.data)
        return out

    def append(self, token: int) -> None:
        self.extend([token])

    def extend(self, tokens: Sequence[int]) -> None:
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        if arr.size and lib.ls_ngram_extend(self._ptr, arr.ctypes.data, arr.size) != 0:
            raise MemoryError("n-gram index: out of memory (the history is unchanged)")

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on."""
        lib.ls_ngram_truncate(self._ptr, max(0, int(length)))

    def reset(self, tokens: Sequence[int]) -> None:
        """Make the history equal to ``tokens``, reusing the longest common prefix."""
        new = np.ascontiguousarray(tokens, dtype=np.int32)
        old = self.tokens
        limit = min(old.size, new.size)
        diff = np.flatnonzero(old[:limit] != new[:limit])
        common = int(diff[0]) if diff.size else limit
        self.truncate(common)
        self.extend(new[common:])

    def _lookup(self, min_n: int, max_occurrences: int, first_only: bool) -> list[Match]:
        k = self.max_n
        orders = np.empty(k, dtype=np.int32)
        counts = np.empty(k, dtype=np.int32)
        starts = np.empty(k * max(1, max_occurrences), dtype=np.int64)
        n = lib.ls_ngram_lookup(
            self._ptr, int(min_n), int(max_occurrences), 1 if first_only else 0,
            orders.ctypes.data, counts.ctypes.data, starts.ctypes.data,
        )  # fmt: skip
        return [
            Match(int(orders[j]), starts[j * max_occurrences : j * max_occurrences + counts[j]].tolist()) for j in range(n)
        ]

    def lookup(self, *, min_n: int = 1, max_occurrences: int = 16) -> Match | None:
        """Occurrences of the longest suffix (order >= ``min_n``) seen before, or None."""
        m = self._lookup(min_n, max(0, max_occurrences), True)
        return m[0] if m else None

    def lookup_all(self, *, min_n: int = 1, max_occurrences: int = 16) -> list[Match]:
        """Matches of every order from the longest down to ``min_n`` (longest first)."""
        return self._lookup(min_n, max(0, max_occurrences), False)


@dataclass
class Trie:
    """The drafter's trie of continuations (node 0 = the last history token).

    Attributes (all [n_nodes]):
        token_ids int32, parents int32 (root -1), depth int32,
        score float64 (P(accept) estimate of the path), bucket int32 (acceptance bucket),
        match_len int32 (longest match length through the node), support int32 (occurrences).
    """

    token_ids: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    score: np.ndarray
    bucket: np.ndarray
    match_len: np.ndarray
    support: np.ndarray


class TrieBuilder:
    """The n-gram drafter's trie of continuations, built in C (``ls_ngram_draft``): the
    same trie as ``NgramDrafter.propose`` builds in Python. Parameters that do not change
    between steps and the output buffers are kept here.

    Args:
        min_n / max_n: the drafter's orders (match lengths are measured at ``max_n``).
        max_occurrences: most occurrences merged.
        max_match: cap of the measured match length.
        len_edges: lower edges of the match-length buckets; n_rank: rank buckets per length.
    """

    def __init__(self, *, min_n: int, max_n: int, max_occurrences: int, max_match: int, len_edges: Sequence[int], n_rank: int) -> None:
        self._edges = np.ascontiguousarray(len_edges, dtype=np.int32)
        self.n_buckets = int(self._edges.size * n_rank)
        p = _lib.DraftParams()
        p.min_n, p.max_n = int(min_n), int(max_n)
        p.max_occurrences, p.max_match = max(0, int(max_occurrences)), int(max_match)
        p.n_len_edges, p.len_edges, p.n_rank = int(self._edges.size), self._edges.ctypes.data, int(n_rank)
        self._p = p
        self._pref = ctypes.byref(p)
        self._cap = 0

    def _buffers(self, cap: int) -> None:
        if cap <= self._cap:
            return
        self._ints = np.empty((6, cap), dtype=np.int32)  # token, parent, depth, bucket, match_len, support
        self._score = np.empty(cap, dtype=np.float64)
        self._addr = [self._ints[i].ctypes.data for i in range(6)] + [self._score.ctypes.data]
        self._cap = cap

    def build(self, index: NativeNgramIndex, *, depth_cap: int, node_cap: int, depth_by_match: np.ndarray, estimates) -> Trie:
        """The trie for the index's current history.

        Args:
            depth_cap: longest continuation.
            node_cap: most nodes, root included (an occurrence stops where it would add more).
            depth_by_match: [k] int32, how far an occurrence whose match length is m is
                continued (``depth_by_match[min(m, k - 1)]``, at most ``depth_cap``).
            estimates: [n_buckets] acceptance estimate per bucket.
        Raises:
            IndexError: the history is empty.
        """
        depths = np.ascontiguousarray(depth_by_match, dtype=np.int32)
        est = np.ascontiguousarray(estimates, dtype=np.float64)
        if depths.size < 1 or est.size != self.n_buckets:
            raise ValueError(f"need >= 1 depths and {self.n_buckets} estimates, got {depths.size} and {est.size}")
        p = self._p
        p.depth_cap, p.node_cap = max(0, int(depth_cap)), int(node_cap)
        p.n_depth_by_match, p.depth_by_match, p.estimates = int(depths.size), depths.ctypes.data, est.ctypes.data
        cap = max(1, min(p.node_cap, 1 + p.max_occurrences * p.depth_cap))
        self._buffers(cap)
        tok, par, dep, bucket, mlen, support, score = self._addr
        n = lib.ls_ngram_draft(index._ptr, self._pref, self._cap, tok, par, dep, score, bucket, mlen, support)
        if n == 0:
            raise IndexError("the history is empty")
        if n < 0:
            raise MemoryError("n-gram trie: out of memory") if n == _lib.ERR_NOMEM else ValueError(f"n-gram trie: error {n}")
        ints = self._ints[:, :n].copy()
        return Trie(ints[0], ints[1], ints[2], self._score[:n].copy(), ints[3], ints[4], ints[5])
