"""Detokenisation for streaming: UTF-8 across token boundaries, and stop strings.

``TextAssembler`` turns emitted tokens into text chunks such that

* the concatenation of every chunk it releases is exactly the final text (byte-identical),
  including characters whose UTF-8 bytes are split over several tokens (held back until
  complete) and text that might be the start of a stop string (held back until it is
  known not to be);
* a stop string completed anywhere, even in the middle of a multi-token block, cuts the
  text at its first character; ``stop_hit`` then says how many tokens lie entirely before
  the cut, so that token ids, logprobs, statistics and the KV cache can be cut at the same
  point.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class StopHit:
    """A stop string was completed.

    Attributes:
        stop: the stop string found.
        text_end: characters of generated text kept (the stop string starts here).
        n_tokens: tokens kept: those whose text ends at or before ``text_end``.
    """

    stop: str
    text_end: int
    n_tokens: int


class TextAssembler:
    """Incremental detokeniser with stop strings.

    Args:
        piece: token id -> bytes of its piece.
        stop: stop strings (empty strings are ignored).
    """

    def __init__(self, piece: Callable[[int], bytes], stop: Sequence[str] = ()) -> None:
        self._piece = piece
        self._stops = sorted({s for s in stop if s}, key=len)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._text = ""
        self._released = 0
        self.token_ends: list[int] = []  # char offset of the end of each token's text
        self.stop_hit: StopHit | None = None

    @property
    def text(self) -> str:
        """The text so far (cut at the stop string once one was found)."""
        return self._text if self.stop_hit is None else self._text[: self.stop_hit.text_end]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ends)

    def push(self, token: int) -> str:
        """Add one token; returns the text released by it (possibly empty).

        After a stop string is found, further pushes are ignored and return "".
        """
        if self.stop_hit is not None:
            return ""
        before = len(self._text)
        self._text += self._dec.decode(self._piece(int(token)))
        self.token_ends.append(len(self._text))
        if self._stops:
            hit = self._find_stop(max(0, before - self._max_stop + 1))
            if hit is not None:
                stop, k = hit
                n_keep = sum(1 for e in self.token_ends if e <= k)
                self.stop_hit = StopHit(stop, k, n_keep)
                out = self._text[self._released : k] if k > self._released else ""
                self._released = max(self._released, k)
                return out
            safe = len(self._text) - self._held_back()
        else:
            safe = len(self._text)
        out = self._text[self._released : safe]
        self._released = max(self._released, safe)
        return out

    def finish(self) -> str:
        """Flush: dangling UTF-8 bytes become U+FFFD, held-back text is released."""
        if self.stop_hit is not None:
            return ""
        self._text += self._dec.decode(b"", final=True)
        if self.token_ends:
            self.token_ends[-1] = len(self._text)
        out = self._text[self._released :]
        self._released = len(self._text)
        return out

    def _find_stop(self, start: int) -> tuple[str, int] | None:
        best = None
        for s in self._stops:
            k = self._text.find(s, start)
            if k >= 0 and (best is None or k < best[1]):
                best = (s, k)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0


def token_offsets(piece: Callable[[int], bytes], tokens: Sequence[int]) -> list[int]:
    """Character offset of each token in the text of ``tokens``: the number of characters
    completed by the tokens before it (a token that starts inside a multi-byte character
    gets the offset of that character). Offsets never exceed the text's length.

    Args:
        piece: token id -> bytes of its piece.
        tokens: token ids, in order.
    Returns:
        one int per token, non-decreasing, starting at 0.
    """
    asm = TextAssembler(piece)
    for t in tokens:
        asm.push(t)
    return [0, *asm.token_ends[:-1]] if tokens else []


class ReleaseTracker:
    """Holds back per-token items (token ids, logprobs) of a stream until their text is out.

    A ``TextAssembler`` releases text late (an incomplete UTF-8 character, a possible stop
    prefix) and may cut tokens at a stop string; a stream that sends each token's item with
    the chunk that carries the token would send items of text not yet sent, or never sent.
    Here an item goes out once all its token's text has been released, with the token's
    character offset (``token_offsets``), so that a streamed response carries exactly the
    items and offsets of the non-streamed one.

    Args:
        piece: token id -> bytes of its piece.
    """

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._asm = TextAssembler(piece)
        self._released = 0  # characters of text released so far
        self._pending: list[tuple[object, int, int]] = []  # (item, start, end) not yet out
        self.n_out = 0  # items given out

    def add(self, token: int, item: object) -> None:
        """Record the next emitted token (id >= 0) and its item."""
        start = self._asm.token_ends[-1] if self._asm.token_ends else 0
        self._asm.push(token)
        self._pending.append((item, start, self._asm.token_ends[-1]))

    def release(self, text: str) -> list[tuple[object, int]]:
        """``text`` was released (sent): the items whose text is now all out, each with its
        token's character offset."""
        self._released += len(text)
        n = 0
        while n < len(self._pending) and self._pending[n][2] <= self._released:
            n += 1
        return self._take(n)

    def flush(self, n_kept: int) -> list[tuple[object, int]]:
        """The stream ended with ``n_kept`` tokens kept (the result's token count): the items
        of kept tokens not yet out; the rest (cut by a stop string) are dropped."""
        out = self._take(max(0, min(len(self._pending), n_kept - self.n_out)))
        self._pending.clear()
        return out

    def _take(self, n: int) -> list[tuple[object, int]]:
        out = [(item, start) for item, start, _end in self._pending[:n]]
        del self._pending[:n]
        self.n_out += n
        return out
