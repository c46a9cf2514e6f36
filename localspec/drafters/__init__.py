"""Drafters: objects that propose token trees for the target to verify.

``make_drafter(name)`` is the registry used by the CLI and the Python API; ``"none"`` means
plain decoding. See ``base.Drafter`` for the protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Drafter
from .ngram import NgramDrafter
from .ngram_index import NgramIndex

_REGISTRY: dict[str, Callable[..., Drafter]] = {
    "ngram": NgramDrafter,
}


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    """Make ``factory(**kwargs)`` available as ``--drafter name``."""
    _REGISTRY[name] = factory


def drafter_names() -> list[str]:
    return ["none", *_REGISTRY]


def make_drafter(name: str | None, **kwargs) -> Drafter | None:
    """A new drafter by name (``None`` / ``"none"`` -> no drafter).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name is None or name == "none":
        return None
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(drafter_names())}") from None
    return factory(**kwargs)


__all__ = ["Drafter", "NgramDrafter", "NgramIndex", "drafter_names", "make_drafter", "register_drafter"]
