"""Errors raised by localspec.

Every error says what is wrong and what to do about it. None of them leaves an engine
unusable: an engine that raised one of these can serve the next request.
"""

from __future__ import annotations


class LocalSpecError(Exception):
    """Base class of every error localspec raises on purpose."""


class ModelLoadError(LocalSpecError):
    """A GGUF file is missing, is not GGUF, is corrupt, or llama.cpp refused to load it."""


class ContextOverflowError(LocalSpecError):
    """A prompt (plus at least one generated token) does not fit in the context."""

    @classmethod
    def prompt(cls, n_prompt: int, n_ctx: int, *, max_tokens: int | None, settings: str) -> "ContextOverflowError":
        """The error for a prompt of ``n_prompt`` tokens that leaves a context of ``n_ctx`` no
        room: it names the context that holds the prompt and one token and, when
        ``max_tokens`` asks for more, the one that holds them all; ``settings`` says where the
        context is set (every entry point words it alike)."""
        fit = f"at least {n_prompt + 1} tokens"
        if max_tokens is not None and max_tokens > 1:
            fit += f" ({n_prompt + max_tokens} for all {max_tokens} tokens asked)"
        return cls(f"the prompt has {n_prompt} tokens but the context holds {n_ctx}; shorten it "
                   f"or give a context of {fit}: {settings}")  # fmt: skip


class AllocationError(LocalSpecError, MemoryError):
    """A store localspec sizes from a budget the caller gave (the drafting memory) could not be
    allocated: ask for less."""


class VocabMismatchError(LocalSpecError):
    """A draft model's vocabulary differs from the target's."""


class KVCacheError(LocalSpecError):
    """The KV cache is not in the state the engine expects (a rollback lost cells).

    This is the error that must never pass silently: after every commit the engine checks
    the cache's position range through ``llama_memory_seq_pos_min/max``.
    """


class DecodeError(LocalSpecError):
    """``llama_decode`` failed (no KV slot, aborted, or invalid batch)."""


class InvalidRequestError(LocalSpecError, ValueError):
    """A request's parameters are out of range or inconsistent."""


class GrammarError(InvalidRequestError):
    """A GBNF grammar failed to parse, or no token can continue it."""
