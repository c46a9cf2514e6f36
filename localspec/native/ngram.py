"""The n-gram index in C (``ls_ngram``): a drop-in for ``drafters.ngram_index.NgramIndex``,
plus the n-gram drafter's trie of continuations (``draft_trie``)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import _lib, lib
from ..drafters.ngram_index import Match


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


def draft_trie(
    index: NativeNgramIndex,
    *,
    min_n: int,
    max_n: int,
    max_occurrences: int,
    depth_cap: int,
    node_cap: int,
    max_match: int,
    depth_by_match: Sequence[int],
    len_edges: Sequence[int],
    n_rank: int,
    estimates: np.ndarray,
) -> Trie:
    """Build the trie of ``NgramDrafter.propose`` in C (see ``ls_ngram_draft``).

    Args:
        node_cap: most nodes, root included (an occurrence stops where it would add more).
        depth_by_match: [k] how far an occurrence whose match length is m is continued
            (``depth_by_match[min(m, k - 1)]``, at most ``depth_cap``).
        estimates: [len(len_edges) * n_rank] float64 acceptance estimate per bucket.
    Raises:
        IndexError: the history is empty.
    """
    edges = np.ascontiguousarray(len_edges, dtype=np.int32)
    depths = np.ascontiguousarray(depth_by_match, dtype=np.int32)
    if depths.size < 1:
        raise ValueError("depth_by_match is empty")
    est = np.ascontiguousarray(estimates, dtype=np.float64)
    if est.size != edges.size * n_rank:
        raise ValueError(f"{est.size} estimates for {edges.size} x {n_rank} buckets")
    p = _lib.DraftParams()
    p.min_n, p.max_n = int(min_n), int(max_n)
    p.max_occurrences, p.depth_cap = max(0, int(max_occurrences)), max(0, int(depth_cap))
    p.max_match, p.node_cap = int(max_match), int(node_cap)
    p.n_len_edges, p.len_edges = int(edges.size), edges.ctypes.data
    p.n_depth_by_match, p.depth_by_match = int(depths.size), depths.ctypes.data
    p.n_rank, p.estimates = int(n_rank), est.ctypes.data
    cap = max(1, min(p.node_cap, 1 + p.max_occurrences * p.depth_cap))
    tok = np.empty(cap, dtype=np.int32)
    par = np.empty(cap, dtype=np.int32)
    dep = np.empty(cap, dtype=np.int32)
    score = np.empty(cap, dtype=np.float64)
    bucket = np.empty(cap, dtype=np.int32)
    mlen = np.empty(cap, dtype=np.int32)
    support = np.empty(cap, dtype=np.int32)
    n = lib.ls_ngram_draft(
        index._ptr, ctypes.byref(p), cap, tok.ctypes.data, par.ctypes.data, dep.ctypes.data, score.ctypes.data,
        bucket.ctypes.data, mlen.ctypes.data, support.ctypes.data,
    )  # fmt: skip
    if n == 0:
        raise IndexError("the history is empty")
    if n < 0:
        raise MemoryError("n-gram trie: out of memory") if n == _lib.ERR_NOMEM else ValueError(f"n-gram trie: error {n}")
    return Trie(tok[:n], par[:n], dep[:n], score[:n], bucket[:n], mlen[:n], support[:n])
