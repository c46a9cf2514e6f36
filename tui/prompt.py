"""Prompt token ids for a conversation, extending the previous turn's tokens exactly.

The engine reuses the KV cache of the longest common *token* prefix between requests. If
every turn re-tokenised the whole conversation, the model's own answers could come back as
different token ids (a tokenizer does not always reproduce the ids a model generated), and
the cache would be reused only up to that point. ``PromptBuilder`` keeps the ids it sent and
the ids the model answered with, and tokenises only the text that the new prompt adds::

    turn 1:  [prompt 1 ids                ]
    answer:  [prompt 1 ids][answer 1 ids  ]                        (as generated)
    turn 2:  [prompt 1 ids][answer 1 ids  ][ids of the new text  ]  -> only these prefilled

It falls back to tokenising the whole text whenever that would change the text: the
template rewrote earlier turns (e.g. trimmed an answer), the answer's ids do not spell its
text exactly (a stop string cut inside a token), or the new text does not tokenise to
itself on its own (a tokenizer that adds a leading space).
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptBuilder:
    """Token ids of successive prompts of one conversation with one model.

    Args:
        model: a ``localspec.backend.Model`` (tokenizer, BOS).
    """

    def __init__(self, model) -> None:
        self.model = model
        self._text: str | None = None  # text that ``_tokens`` spell exactly
        self._tokens: list[int] = []
        self.n_reused_tokens = 0  # ids carried over by the last build (for tests and stats)

    def reset(self) -> None:
        self._text, self._tokens, self.n_reused_tokens = None, [], 0

    @property
    def tokens(self) -> list[int]:
        """The ids of the last committed prompt and the answer recorded after it."""
        return list(self._tokens)

    def build(self, text: str) -> list[int]:
        """Token ids of the prompt ``text`` (special-token text parsed, BOS as the model asks).

        Does not change the builder: ``commit(text, ids)`` once the prompt was accepted.
        """
        self.n_reused_tokens = 0
        if self._text is not None and text.startswith(self._text):
            delta = self._tokenize_exact(text[len(self._text) :])
            if delta is not None:
                self.n_reused_tokens = len(self._tokens)
                return self._tokens + delta
        return self._tokenize_full(text)

    def snapshot(self) -> tuple[str | None, list[int]]:
        """The builder's state, for ``restore`` when a turn is undone."""
        return self._text, list(self._tokens)

    def restore(self, state: tuple[str | None, list[int]]) -> None:
        self._text, self._tokens = state[0], list(state[1])

    def commit(self, text: str, tokens: Sequence[int]) -> None:
        """``tokens`` (from ``build(text)``) were sent to the model."""
        self._text, self._tokens = text, [int(t) for t in tokens]

    def record_answer(self, text: str, token_ids: Sequence[int]) -> None:
        """The model answered the last built prompt with ``token_ids`` spelling ``text``.

        Ids that do not spell ``text`` exactly are not kept: the next prompt then tokenises
        the answer's text again (correct, only less KV reuse).
        """
        if self._text is None or not token_ids:
            return
        if self.model.detokenize(token_ids, special=True) == text:
            self._text += text
            self._tokens += [int(t) for t in token_ids]

    def _tokenize_exact(self, text: str) -> list[int] | None:
        if not text:
            return []
        ids = self.model.tokenize(text, add_special=False, parse_special=True)
        return ids if self.model.detokenize(ids, special=True) == text else None

    def _tokenize_full(self, text: str) -> list[int]:
        ids = self.model.tokenize(text, add_special=False, parse_special=True)
        bos = self.model.bos
        if self.model.add_bos and bos >= 0 and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids
