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
