"""Incremental n-gram index over a token history (prompt lookup decoding).

For every order n in ``[1, max_n]`` the index maps each n-gram to the positions that follow
its occurrences, in increasing order. Appending a token adds ``max_n`` entries (O(1) per
token for a fixed ``max_n``); a lookup reads at most ``max_occurrences`` most recent
positions of the longest matching suffix, so its cost does not grow with the history.
Truncation (a new request that shares only a prefix of the history) pops entries from the
end, O(removed tokens).

This is the pure-Python reference; ``localspec.native`` provides the same structure in C.
"""

from __future__ import annotations

from collections.abc import Sequence
from ..ngram_match import Match


class NgramIndex:
    """n-gram -> continuation positions, for n in ``[1, max_n]``.

    Args:
        max_n: longest n-gram indexed.
    """

    def __init__(self, max_n: int = 4) -> None:
        if max_n < 1:
            raise ValueError("max_n must be >= 1")
        self.max_n = max_n
        self.tokens: list[int] = []
        self._maps: list[dict[tuple[int, ...], list[int]]] = [dict() for _ in range(max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        toks = self.tokens
        toks.append(int(token))
        end = len(toks)
        for n in range(1, min(self.max_n, end) + 1):
            key = tuple(toks[end - n : end])
            lst = self._maps[n].get(key)
            if lst is None:
                self._maps[n][key] = [end]
            else:
                lst.append(end)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on."""
        toks = self.tokens
        while len(toks) > length:
            end = len(toks)
            for n in range(1, min(self.max_n, end) + 1):
                key = tuple(toks[end - n : end])
                lst = self._maps[n][key]
                lst.pop()
                if not lst:
                    del self._maps[n][key]
            toks.pop()

    def reset(self, tokens: Sequence[int]) -> None:
        """Make the history equal to ``tokens``, reusing the longest common prefix."""
        toks = self.tokens
        common = 0
        limit = min(len(toks), len(tokens))
        while common < limit and toks[common] == tokens[common]:
            common += 1
        self.truncate(common)
        self.extend(tokens[common:])

    def lookup(self, *, min_n: int = 1, max_occurrences: int = 16) -> Match | None:
        """Occurrences of the longest suffix (order >= ``min_n``) seen before, or None."""
        toks = self.tokens
        end = len(toks)
        for n in range(min(self.max_n, end - 1), min_n - 1, -1):
            lst = self._maps[n].get(tuple(toks[end - n : end]))
            if lst is None or len(lst) < 2:  # the last entry is the suffix itself
                continue
            lo = max(0, len(lst) - 1 - max_occurrences)
            starts = lst[lo : len(lst) - 1]
            starts.reverse()
            return Match(n, starts)
        return None

    def lookup_all(self, *, min_n: int = 1, max_occurrences: int = 16) -> list[Match]:
        """Matches of every order from the longest down to ``min_n`` (longest first)."""
        toks = self.tokens
        end = len(toks)
        out = []
        for n in range(min(self.max_n, end - 1), min_n - 1, -1):
            lst = self._maps[n].get(tuple(toks[end - n : end]))
            if lst is None or len(lst) < 2:
                continue
            lo = max(0, len(lst) - 1 - max_occurrences)
            starts = lst[lo : len(lst) - 1]
            starts.reverse()
            out.append(Match(n, starts))
        return out
