"""``Match``: what an n-gram index lookup returns (the longest matching suffix and where its
continuations start). Shared by the Python reference index (``drafters.ngram_index``) and the
C index (``native.ngram``), so that neither package imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Match:
    """Occurrences of the longest matching suffix.

    Attributes:
        order: n, the length of the matched suffix.
        starts: positions where a continuation starts, most recent first.
    """

    order: int
    starts: list[int]
