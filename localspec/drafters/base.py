"""The drafter protocol.

A drafter proposes a token tree below the last emitted token; the engine verifies it and
tells the drafter what was emitted. Like llama.cpp's ``common_speculative`` a drafter is an
object with ``begin / propose / accept``; ``observe`` feeds it the verification outcome so it
can calibrate the acceptance estimates it puts in ``TokenTree.score``.

Contract:
    * ``begin(history, context=())`` is called once per request with every token before the
      first generated one; ``history[-1]`` is the root of the first tree. ``context`` holds
      extra token sequences the request offers to draft from (e.g. an editor's suffix and
      open files); it is passed only when non-empty, so simple drafters may omit it.
    * ``propose(max_depth, max_nodes)`` returns a ``TokenTree`` whose root is the last
      history token, with at most ``max_nodes`` nodes (root included) and depth at most
      ``max_depth``. A root-only tree means "nothing to draft": the step is a plain decode.
      ``score`` of each node estimates P(the target accepts the path down to it); scores
      never increase down a path.
    * ``accept(tokens)`` appends the tokens emitted by a step (accepted drafts and the final
      recovered/bonus token) to the history.
    * ``observe(tree, emitted)`` reports the tree as proposed (before the policy pruned it)
      and the tokens the step emitted, so the drafter can calibrate its estimates, also on
      the nodes that were not verified.

Drafters that run a model (``ModelDrafter``, ``AutoDrafter`` with a model) draft in two
phases so that the engine's policy decides each step once, before any model call; they
never ask the policy themselves:
    * ``propose`` returns only the cheap drafts (the n-gram tree; the root alone for a model
      drafter) and makes no model call;
    * ``model_stats``: the model's ``ModelDraftStats`` when it can draft this step, else None;
    * ``extend(shape)``, called at most once per step and only when the plan says so: draft
      with the model in that ``TreeShape`` and return this step's whole candidate tree (the
      model's tree merged with the cheap drafts).
    A step without ``extend`` costs the model nothing; it catches up on the next one.

Optional hooks, called by the engine when a drafter defines them:
    * ``attach(target: TargetHandle)`` once, when the drafter is set on an engine: drafters
      that run a model get what they need of the target (see ``TargetHandle``) and, when
      they list ``target_feature_layers``, the ``FeatureTap`` that captures those layers.
    * ``check_target(model)``: raise if the drafter cannot work with this target ``Model``;
      called before the engine changes anything (so a refused drafter loses nothing).
    * ``fixed_shape``: a ``TreeShape`` the plan always drafts with (tests, experiments).
    * ``set_sampling(sampler: RequestState)`` before ``begin`` of every request: model
      drafters draft with the request's sampling (greedy, seeded Gumbel, or their own
      distribution for classic rejection sampling).
    * ``target_feature_layers``: a tuple of target layer ids whose *inputs* the drafter reads
      after every target decode (EAGLE-3; see ``backend.features``).
    * ``spawn()``: a drafter for another request with the same options that shares what is
      loaded (a draft model, heads' weights) and, once attached, drafts together with this
      one (the batch scheduler gives one to each slot).
    * ``draft_group``: an object whose ``extend_many(drafters, shapes)`` runs the ``extend``
      of several requests' drafters sharing it together (one model call per tree level for
      all of them, or one head computation over all their hidden states); ``model_part``
      and ``extended(tree)``: a drafter wrapping a model drafter (``AutoDrafter``) names it
      and finishes its tree (``extend_together``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..tree import TokenSource, TokenTree

if TYPE_CHECKING:  # pragma: no cover
    from ..backend import Context, Model
    from ..backend.features import FeatureTap


@runtime_checkable
class Drafter(Protocol):
    name: str
    source: TokenSource

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None: ...

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree: ...

    def accept(self, tokens: Sequence[int]) -> None: ...

    def observe(self, tree: TokenTree, emitted: Sequence[int]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TargetHandle:
    """What the engine lends a drafter that needs the target (``attach``): facts about the
    target, not the engine's own objects (its policy decides steps and passes the decision
    in; the drafter never drives the target's context).

    Attributes:
        model: the target ``Model`` (vocabulary, embeddings size, suppressed tokens).
        n_ctx: the target's context size (tokens).
        n_threads: the CPU threads the target decodes with.
        tensor_source: the target ``Context`` whose tensors an EAGLE-3 head borrows
            (llama.cpp's ``ctx_other``: token embeddings, lm_head); only for creating the
            draft context, never for decoding. Valid until the drafter is replaced.
        features: the ``FeatureTap`` on the target context, when the drafter asked for
            ``target_feature_layers``; else None.
        n_requests: requests decoded together (the batch scheduler's slots): a drafter and
            its ``spawn``-ed siblings make one draft context for that many.
    """

    model: "Model"
    n_ctx: int
    n_threads: int
    tensor_source: "Context | None" = None
    features: "FeatureTap | None" = None
    n_requests: int = 1


def target_reads(drafter: object | None) -> str | None:
    """What ``drafter`` reads from every target decode, for messages: ``"the target's
    final-norm rows"`` (Medusa heads, ``target_final_norm``), ``"the target's nextn hidden
    states"`` (MTP) or ``"the target's layer features (EAGLE-3 feature tap)"``
    (``target_feature_layers``); None for a drafter that reads nothing (the target context
    then needs no tap)."""
    if getattr(drafter, "target_final_norm", False):
        return "the target's final-norm rows"
    layers = getattr(drafter, "target_feature_layers", None)
    if not layers:
        return None
    if any(isinstance(k, str) for k in layers):  # (NEXTN_FEATURES,)
        return "the target's nextn hidden states"
    return "the target's layer features (EAGLE-3 feature tap)"


def extend_together(drafters: Sequence, shapes: Sequence) -> list[TokenTree]:
    """``drafters[i].extend(shapes[i])`` for every ``i``, the model drafters that share a
    ``draft_group`` together (``extend_many``: one model call per tree level for all of them);
    each request's tree is what it would draft alone. A wrapping drafter (``model_part``)
    has its model part draft in the group and finishes the tree (``extended``).

    Requires: ``propose`` was called on each drafter for this step.
    """
    trees: list[TokenTree | None] = [None] * len(drafters)
    groups: dict[int, tuple[object, list[int]]] = {}
    for i, d in enumerate(drafters):
        part = getattr(d, "model_part", d)
        group = getattr(part, "draft_group", None)
        if group is None:
            trees[i] = d.extend(shapes[i])
        else:
            groups.setdefault(id(group), (group, []))[1].append(i)
    for group, idx in groups.values():
        parts = [getattr(drafters[i], "model_part", drafters[i]) for i in idx]
        for i, part, tree in zip(idx, parts, group.extend_many(parts, [shapes[i] for i in idx])):
            d = drafters[i]
            trees[i] = tree if part is d else d.extended(tree)
    return trees  # type: ignore[return-value]
