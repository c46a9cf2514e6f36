"""localspec: lossless speculative decoding of GGUF models on llama.cpp.

Quick start::

    import localspec
    engine = localspec.Engine()                 # embedded Gemma 3 270M, n-gram drafter
    result = engine.generate("The capital of France is", max_tokens=32,
                             sampling=localspec.SamplingParams.greedy())
    print(result.text, result.stats.mean_acceptance_length)

See ``Engine`` for the options, ``SamplingParams`` for sampling, ``GenerationResult`` and
``GenerationStats`` for what comes back.
"""

from .engine import Engine, GenerationResult, GenerationStream, StreamChunk, TokenLogprob
from .errors import (
    ContextOverflowError,
    DecodeError,
    GrammarError,
    InvalidRequestError,
    KVCacheError,
    LocalSpecError,
    ModelLoadError,
    VocabMismatchError,
)
from .sampling import SamplingParams
from .stats import GenerationStats
from .tree import TokenSource, TokenTree

__version__ = "0.1.0"


def load(model=None, *, drafter: str | None = "ngram", **kwargs) -> Engine:
    """An ``Engine`` for ``model`` (a GGUF path, or None for the default model)."""
    return Engine(model, drafter=drafter, **kwargs)


__all__ = [
    "ContextOverflowError",
    "DecodeError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "GrammarError",
    "InvalidRequestError",
    "KVCacheError",
    "LocalSpecError",
    "ModelLoadError",
    "SamplingParams",
    "StreamChunk",
    "TokenLogprob",
    "TokenSource",
    "TokenTree",
    "VocabMismatchError",
    "load",
]
