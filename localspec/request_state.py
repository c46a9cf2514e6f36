"""``RequestState``: the sampling state of one request, and cursors that walk a token tree.

The request keeps what the pipeline needs beyond the logits row: the penalty window
(prompt + emitted tokens), the grammar state, the seed. A ``Cursor`` starts at the root of a
tree (the next position to fill) and moves down the accepted path, so that every verified
position sees exactly the history it would see in plain decoding: penalties count the
earlier tokens of the same accepted block, the grammar has consumed them, and the random
stream is the one of that absolute position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .grammar import GrammarState
from .sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    LogitsProcessor,
    PenaltyWindow,
    SamplingParams,
    random_seed,
    stream_key,
    uniform,
)


class RequestState:
    """Sampling state of one generation request.

    Args:
        params: sampling parameters (``seed=None`` draws one; see ``self.seed``).
        model: the target ``Model`` (vocabulary, suppressed tokens, grammar).
        history: tokens before the first generated one (the prompt), for penalties.
    Raises:
        GrammarError: the grammar does not parse.
    """

    def __init__(self, params: SamplingParams, model, history: Sequence[int]) -> None:
        self.seed = int(params.seed) if params.seed is not None else random_seed()
        self.params = params.with_seed(self.seed)
        self.model = model
        self.n_vocab = model.n_vocab
        self.processor = LogitsProcessor(self.params, model.n_vocab, model.suppress_tokens)
        n_last = params.penalty_last_n
        self.penalties = PenaltyWindow(n_last, list(history)) if self.params.has_penalties else None
        self.grammar = GrammarState(model, params.grammar, params.grammar_root) if params.grammar else None

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy

    def cursor(self, pos: int) -> "Cursor":
        """A cursor at absolute position ``pos`` (the position of the next emitted token)."""
        return Cursor(self, pos)

    def commit(self, tokens: Sequence[int]) -> None:
        """Record emitted tokens (penalty window, grammar)."""
        for t in tokens:
            if self.penalties is not None:
                self.penalties.push(t)
            if self.grammar is not None:
                self.grammar.accept(int(t))

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()


class Cursor:
    """The sampling context of one position while walking down a tree.

    ``pos`` is the absolute position of the token to be chosen; ``advance(token)`` moves to
    the next position with ``token`` appended to the history.
    """

    def __init__(self, req: RequestState, pos: int) -> None:
        self.req = req
        self.pos = int(pos)
        self._pen = req.penalties.copy() if req.penalties is not None else None
        self._grammar = req.grammar.clone() if req.grammar is not None else None

    @property
    def counts(self):
        return self._pen.counts if self._pen is not None else None

    @property
    def window(self):
        """The penalty window before ``pos`` (oldest first), or None without penalties."""
        return self._pen.window if self._pen is not None else None

    @property
    def has_grammar(self) -> bool:
        return self._grammar is not None

    def target_token(self, row: np.ndarray) -> int:
        """The target's token here: greedy argmax, or the seeded Gumbel-max sample.

        Args:
            row: [n_vocab] float32 raw logits of the node whose successor is chosen.
        """
        return self.req.processor.choose(row, self.pos, self.req.seed, self.counts, self._grammar)

    def target_probs(self, row: np.ndarray) -> np.ndarray:
        """[n_vocab] float64 processed target distribution here (``target_probs``)."""
        return self.req.processor.candidates(row, self.counts, self._grammar).dense_probs(self.req.n_vocab)

    def target_candidates(self, row: np.ndarray):
        """The processed target distribution here as ``sampling.Candidates`` (sparse: the
        candidates' ids and processed logits), the same distribution as ``target_probs``."""
        return self.req.processor.candidates(row, self.counts, self._grammar)

    def accept_uniform(self, k: int) -> float:
        """k-th uniform of this position's ratio-test stream (classic rejection sampling)."""
        return uniform(stream_key(self.req.seed, self.pos, STREAM_ACCEPT), k)

    def residual_uniform(self) -> float:
        """Uniform for drawing a recovered / bonus token from a distribution here."""
        return uniform(stream_key(self.req.seed, self.pos, STREAM_RESIDUAL), 0)

    def advance(self, token: int) -> None:
        if self._pen is not None:
            self._pen.push(token)
        if self._grammar is not None:
            self._grammar.accept(int(token))
        self.pos += 1

    def close(self) -> None:
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None
