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

Optional hooks, called by the engine when a drafter defines them:
    * ``attach(target: TargetHandle)`` once, when the drafter is set on an engine: drafters
      that run a model get the target model (vocabulary check), context (EAGLE-3 heads share
      its tensors), policy (tree shapes) and, when they list ``target_feature_layers``,
      the ``FeatureTap`` that captures those target layers.
    * ``set_sampling(sampler: RequestSampler)`` before ``begin`` of every request: model
      drafters draft with the request's sampling (greedy, seeded Gumbel, or their own
      distribution for classic rejection sampling).
    * ``target_feature_layers``: a tuple of target layer ids whose *inputs* the drafter reads
      after every target decode (EAGLE-3; see ``backend.features``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..tree import TokenSource, TokenTree

if TYPE_CHECKING:  # pragma: no cover
    from ..backend import Context, Model
    from ..backend.features import FeatureTap
    from ..policy import SpeculationPolicy


@runtime_checkable
class Drafter(Protocol):
    name: str
    source: TokenSource

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None: ...

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree: ...

    def accept(self, tokens: Sequence[int]) -> None: ...

    def observe(self, tree: TokenTree, emitted: Sequence[int]) -> None: ...

    def close(self) -> None: ...


@dataclass
class TargetHandle:
    """What the engine lends a drafter that needs the target (``attach``).

    Attributes:
        model: the target ``Model``.
        ctx: the target ``Context`` (valid until the drafter is replaced or the engine closed).
        policy: the engine's ``SpeculationPolicy`` (tree shapes, drafter choice).
        features: the ``FeatureTap`` on the target context, when the drafter asked for
            ``target_feature_layers``; else None.
    """

    model: "Model"
    ctx: "Context"
    policy: "SpeculationPolicy"
    features: "FeatureTap | None" = None
