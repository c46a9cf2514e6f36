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

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine, GenerationResult, GenerationStream, StreamChunk, TokenLogprob
    from .errors import (ContextOverflowError, DecodeError, GrammarError, InvalidRequestError, KVCacheError,
                         LocalSpecError, ModelLoadError, VocabMismatchError)  # fmt: skip
    from .sampling import SamplingParams
    from .stats import GenerationStats
    from .tree import TokenSource, TokenTree

# name -> module: imported on first use (PEP 562), so that ``import localspec.cli.main`` (the
# ``localspec`` command) does not load llama.cpp and numpy before it can handle Ctrl-C
_EXPORTS = {
    **dict.fromkeys(("Engine", "GenerationResult", "GenerationStream", "StreamChunk", "TokenLogprob"), ".engine"),
    **dict.fromkeys(("ContextOverflowError", "DecodeError", "GrammarError", "InvalidRequestError", "KVCacheError",
                     "LocalSpecError", "ModelLoadError", "VocabMismatchError"), ".errors"),  # fmt: skip
    "SamplingParams": ".sampling",
    "GenerationStats": ".stats",
    **dict.fromkeys(("TokenSource", "TokenTree"), ".tree"),
}

__version__ = "0.1.0"


def load(model=None, *, drafter: str | None = "ngram", **kwargs) -> "Engine":
    """An ``Engine`` for ``model`` (a GGUF path, or None for the default model)."""
    return import_module(".engine", __name__).Engine(model, drafter=drafter, **kwargs)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
