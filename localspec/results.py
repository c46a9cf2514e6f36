"""What a generation hands back: per-token log-probabilities, stream chunks, the result.

These types sit below both the engine (one request) and the batch scheduler (many), which
produce them through the same step (``localspec.step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import native
from .native import rows as native_rows
from .sampling import top_k
from .stats import GenerationStats
from .tree import TokenSource


@dataclass
class TokenLogprob:
    """Log-probability of an emitted token under the raw model distribution (softmax of the
    logits, no sampling transforms), with the ``top`` most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class StreamChunk:
    """One emitted token and the text it released.

    ``text`` may be empty (a character or a possible stop string still incomplete) or hold
    text of earlier tokens; the concatenation of all chunks' text is the final text. The
    last chunk of a stream may carry only held-back text, with ``token == -1``.
    """

    text: str
    token: int
    source: TokenSource
    step: int
    logprob: TokenLogprob | None = None


@dataclass
class GenerationResult:
    """The outcome of a request.

    Attributes:
        text: generated text (cut before a stop string; no end-of-generation token).
        token_ids: generated token ids (the same cut).
        finish_reason: ``"stop"`` (end-of-generation token or stop string), ``"length"``
            (``max_tokens`` reached or the context is full), ``"time"`` (``max_time_ms``
            reached), ``"cancelled"``, or ``"error"`` (the generation raised; the exception went
            to the caller, e.g. ``WorkerLostError``, and this result holds what was emitted before).
        stop: the stop string matched, ``"<eog>"`` for an end-of-generation token, else None.
        sources: how each token was produced (``TokenSource``).
        logprobs: per-token log-probabilities when requested.
        stats: ``GenerationStats``.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stop: str | None
    sources: list[TokenSource]
    logprobs: list[TokenLogprob] | None
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop": self.stop,
            "sources": [TokenSource(s).name.lower() for s in self.sources],
            "logprobs": None
            if self.logprobs is None
            else [{"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in self.logprobs],
            "stats": self.stats.to_dict(),
        }


def token_logprobs(logits: np.ndarray, rows: Sequence[int], tokens: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """Log-probabilities of emitted tokens under the target's raw distribution
    (``log_softmax`` of the raw logits row, as llama.cpp's ``n_probs``), each with the
    ``top_n`` most likely tokens (value desc, id asc: ``sampling.top_k``).

    Args:
        logits: [n_rows, n_vocab] float32.
        rows: the row of each emitted token (``VerifyResult.rows``).
        tokens: the emitted tokens, one per row.
        top_n: alternatives per token (0: none).

    logsumexp is in float64; the C kernel (``ls_rows_logsumexp``) computes it when built
    (about 1 ms per 262k-wide row instead of ~7 ms in numpy)."""
    rows = [int(r) for r in rows]
    if not rows:
        return []
    if native.enabled():
        lse = native_rows.rows_logsumexp(logits, rows)
    else:
        lse = []
        for r in rows:
            x = logits[r].astype(np.float64)
            m = x.max()
            lse.append(float(m + np.log(np.exp(x - m).sum())))
    out = []
    for row, tok, z in zip(rows, tokens, lse):
        x = logits[row]
        top = [(int(i), float(np.float64(x[i]) - z)) for i in top_k(x, top_n)] if top_n else []
        out.append(TokenLogprob(int(tok), float(np.float64(x[tok]) - z), top))
    return out
