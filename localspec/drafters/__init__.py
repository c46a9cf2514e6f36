"""Drafters: objects that propose token trees for the target to verify.

``make_drafter(name, **options)`` is the registry used by the CLI and the Python API;
``"none"`` means plain decoding. See ``base.Drafter`` for the protocol.

=========  ==============================================  ===========================
name       drafter                                         options
=========  ==============================================  ===========================
ngram      prompt-lookup n-gram trees (``NgramDrafter``)   ``memory``
draft      a standalone GGUF draft model                   ``draft_model``, ``draft_n_ctx``
eagle3     an EAGLE-3 head for the target (the shipped     ``eagle``, ``draft_shape``
           head for the default model when none given)
medusa     Medusa heads on the target's final hidden      ``medusa``, ``draft_shape``
           state (the shipped heads for the default
           model when none given)
auto       n-gram every step, plus a draft model, an       ``draft_model``, ``eagle``
           EAGLE-3 head, Medusa heads or the target's      or ``medusa`` (optional)
           MTP block when the policy expects it to pay
mtp        the target's own MTP / NextN block(s)           ``draft_shape``
           (targets with ``*.nextn_predict_layers > 0``)
=========  ==============================================  ===========================
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ..errors import InvalidRequestError
from .base import Drafter, TargetHandle
from .memory import DraftMemory
from .ngram import NgramDrafter
from .ngram_index import NgramIndex


def _draft(draft_model=None, draft_n_ctx: int | None = None) -> Drafter:
    from .draft_model import DraftModelDrafter

    if draft_model is None:
        raise InvalidRequestError(
            "the draft drafter needs a draft model: --draft-model PATH (Python: draft_model=PATH), "
            "a GGUF that shares the target's tokenizer"
        )
    return DraftModelDrafter(draft_model, n_ctx=draft_n_ctx)


def _eagle3(eagle=None, draft_shape=None) -> Drafter:
    from .eagle3 import Eagle3Drafter

    if eagle is None:
        raise InvalidRequestError(
            "the eagle3 drafter needs an EAGLE-3 head for this target: --eagle PATH (Python: eagle=PATH); "
            "one ships only for the default model. `localspec train-eagle3` trains one from your text "
            "(docs/eagle3-training.md)"
        )
    return Eagle3Drafter(eagle, shape=draft_shape)


def _medusa(medusa=None, draft_shape=None) -> Drafter:
    from .medusa import MedusaDrafter

    if medusa is None:
        raise InvalidRequestError(
            "the medusa drafter needs Medusa heads for this target: --medusa PATH (Python: medusa=PATH); "
            "heads ship only for the default model. `localspec train-medusa` trains them from your text "
            "(docs/drafters.md#medusa-heads)"
        )
    return MedusaDrafter(medusa, shape=draft_shape)


def _auto(draft_model=None, draft_n_ctx: int | None = None, eagle=None, medusa=None, mtp: bool = False, memory=None) -> Drafter:
    from .auto import AutoDrafter

    if sum(x is not None for x in (draft_model, eagle, medusa)) > 1:
        raise InvalidRequestError("the auto drafter takes one of a draft model, an EAGLE-3 head or Medusa heads, not several "
                                  "(--draft-model, --eagle, --medusa; Python: draft_model=, eagle=, medusa=)")
    model = None
    if draft_model is not None:
        model = _draft(draft_model, draft_n_ctx)
    elif eagle is not None:
        model = _eagle3(eagle)
    elif medusa is not None:
        model = _medusa(medusa)
    elif mtp:  # the engine sets it for targets with MTP blocks (and no other model given)
        model = _mtp()
    return AutoDrafter(model, NgramDrafter(memory=memory) if memory is not None else None)


def _mtp(draft_shape=None) -> Drafter:
    from .mtp import MtpDrafter

    return MtpDrafter(shape=draft_shape)


_REGISTRY: dict[str, Callable[..., Drafter]] = {
    "ngram": NgramDrafter,
    "draft": _draft,
    "eagle3": _eagle3,
    "medusa": _medusa,
    "auto": _auto,
    "mtp": _mtp,
}


def register_drafter(name: str, factory: Callable[..., Drafter]) -> None:
    """Make ``factory(**options)`` available as ``--drafter name``."""
    _REGISTRY[name] = factory


def drafter_names() -> list[str]:
    return ["none", *_REGISTRY]


def drafter_option_names(name: str) -> frozenset[str]:
    """The options drafter ``name`` takes (its factory's keyword parameters, e.g.
    ``{"eagle", "draft_shape"}`` for ``eagle3``; empty for ``none``).

    Raises:
        InvalidRequestError: unknown name (the message lists the known ones; a ValueError).
    """
    if name == "none":
        return frozenset()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise InvalidRequestError(f"unknown drafter {name!r}; choose one of {', '.join(drafter_names())}") from None
    return frozenset(inspect.signature(factory).parameters)


def _flags(names) -> str:
    """Drafter options as the command line and Python spell them: ``draft_shape`` ->
    ``--draft-shape (Python: draft_shape=)``."""
    names = sorted(names)
    return f"{', '.join('--' + k.replace('_', '-') for k in names)} (Python: {', '.join(k + '=' for k in names)})"


def make_drafter(name: str | None, *, memory=None, **options) -> Drafter | None:
    """A new drafter by name (``None`` / ``"none"`` -> no drafter).

    ``memory`` (a ``DraftMemory``) is the process's drafting memory: given to the drafters
    that take one (``ngram``, ``auto``: their n-gram part), ignored by the others.

    Raises:
        InvalidRequestError: unknown name (the message lists the known ones; a ValueError), an
            option the drafter does not take, or a missing one.
    """
    if name is None or name == "none":
        if options:
            raise InvalidRequestError(f"{_flags(options)} need{'s' if len(options) == 1 else ''} a drafter (not 'none'): choose one with --drafter (Python: drafter=)")
        return None
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise InvalidRequestError(f"unknown drafter {name!r}; choose one of {', '.join(drafter_names())}") from None
    sig = inspect.signature(factory)
    params = sig.parameters
    try:
        sig.bind(**options)
    except TypeError:
        rejected = [k for k in options if k not in params]  # only those, not every option given
        if rejected:
            raise InvalidRequestError(f"drafter {name!r} does not take {_flags(rejected)}; see `localspec generate --help`") from None
        raise InvalidRequestError(f"drafter {name!r}: options {_flags(options)} do not fit it; see `localspec generate --help`") from None
    if memory is not None and "memory" in params:
        options["memory"] = memory
    return factory(**options)


def resolve_drafter(name: str | None, target, *, memory=None, **options) -> Drafter | None:
    """``make_drafter`` for the target ``Model`` ``target``, as the engine and the batch
    scheduler make drafters: ``eagle3`` (and ``auto`` without a model) without a head gets the
    head shipped for the target, if any; ``auto`` on a target with MTP blocks and no other
    model drafts with them; ``medusa`` without heads gets the shipped ones. Options set to
    None are left out; ``memory`` is the process's ``DraftMemory`` (``make_drafter``). The
    drafter's ``check_target`` has passed (else it is closed and the error raised).

    Raises:
        ValueError / InvalidRequestError / ModelLoadError: see ``make_drafter``; a drafter
            that cannot work with ``target`` (e.g. MTP on a model without MTP blocks).
    """
    options = {k: v for k, v in options.items() if v is not None}
    models = {"eagle", "draft_model", "medusa"}
    if (name == "eagle3" and "eagle" not in options) or (name == "auto" and not models & set(options)):
        from ..models.eagle3_heads import shipped_head

        head = shipped_head(target.path)
        if head is not None:
            options["eagle"] = head
    if name == "auto" and not models & set(options):
        from .mtp import mtp_capable

        if mtp_capable(target):  # auto on a target with MTP blocks: n-gram + its MTP block
            options["mtp"] = True
    if name == "medusa" and "medusa" not in options:
        from ..models.eagle3_heads import shipped_head

        heads = shipped_head(target.path, kind="medusa")
        if heads is not None:
            options["medusa"] = heads
    new = make_drafter(name, memory=memory, **options)
    check = getattr(new, "check_target", None)  # e.g. MTP: refuse a target without MTP blocks
    if check is not None:  # before anything changes, so a refused drafter loses nothing
        try:
            check(target)
        except BaseException:
            new.close()
            raise
    return new


__all__ = [
    "DraftMemory",
    "Drafter",
    "NgramDrafter",
    "NgramIndex",
    "TargetHandle",
    "drafter_names",
    "drafter_option_names",
    "make_drafter",
    "register_drafter",
    "resolve_drafter",
]
