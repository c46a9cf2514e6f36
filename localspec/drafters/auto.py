"""``--drafter auto``: the n-gram drafter every step, a model drafter when the policy expects it
to pay, both merged into one tree.

Each step the n-gram drafter proposes first (it costs ~0.1 ms): that is ``propose``, the
cheap phase. The engine's policy then plans the step once, comparing the best expected rate
of that tree with the expected rate of a model-drafted step, whose drafting time (the cost
model's measured time per draft level) is paid whatever is accepted
(``SpeculationPolicy.plan`` / ``prefer_model``). When the plan runs the model (``extend``),
its tree and the n-gram tree are merged (``merge_trees``): a continuation found by both
appears once, with the larger acceptance estimate, and the step verifies the best nodes of
the union. Both drafters' node scores are on one scale: each is the calibrated probability
that the target accepts the path (``AcceptanceTracker``, learned online from what the target
emitted), so the union's best nodes by score are the best of both. Each drafter learns from
its own tree (``observe``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..policy import accepted_length
from ..tree import TokenSource, TokenTree, TreeBuilder
from .base import Drafter, TargetHandle
from .ngram import NgramDrafter


def merge_trees(first: TokenTree, second: TokenTree) -> TokenTree:
    """The union of two trees with the same root.

    Deterministic nodes with the same token under the same parent are merged (the larger
    score wins; the first tree's source is kept); stochastic nodes (sampled from a draft
    distribution) are never merged, and their distributions follow their parents and their
    ``draw_index`` (sibling-order invariant) follows them. At most one of the trees may have
    stochastic children under a given node.

    Raises:
        ValueError: different roots, or both trees sample children of the same node.
    """
    if int(first.token_ids[0]) != int(second.token_ids[0]):
        raise ValueError("merge_trees: the trees have different roots")
    if second.n_nodes <= 1:
        return first
    if first.n_nodes <= 1:
        return second
    b = TreeBuilder(int(first.token_ids[0]))
    for tree in (first, second):
        remap = [0] * tree.n_nodes
        draws = tree.draws()
        for i in range(1, tree.n_nodes):
            prob = float(tree.draft_probs[i]) if tree.is_stochastic(i) else None
            remap[i] = b.add(
                remap[int(tree.parents[i])],
                int(tree.token_ids[i]),
                source=TokenSource(int(tree.source[i])),
                score=float(tree.score[i]),
                draft_prob=prob,
                draw_index=int(draws[i]) if prob is not None else None,
            )
        for parent, dist in tree.draft_dists.items():
            if remap[parent] in b.draft_dists:
                raise ValueError("merge_trees: both trees sample children of the same node")
            b.set_draft_dist(remap[parent], dist)
    return b.build()


class AutoDrafter:
    """The n-gram drafter plus, when the policy expects it to pay, a model drafter.

    Args:
        model: a model drafter (``DraftModelDrafter``, ``Eagle3Drafter``, ``MedusaDrafter``,
            ``MtpDrafter``) or None (n-gram only).
        ngram: the n-gram drafter (default: a new ``NgramDrafter``).
    """

    name = "auto"
    source = TokenSource.NGRAM

    def __init__(self, model: Drafter | None = None, ngram: NgramDrafter | None = None) -> None:
        self.ngram = ngram or NgramDrafter()
        self.model = model
        self.target_feature_layers = getattr(model, "target_feature_layers", None)
        self.target_final_norm = bool(getattr(model, "target_final_norm", False))  # Medusa heads
        self._ngram_tree: TokenTree | None = None
        self._cheap_tree: TokenTree | None = None
        self._model_tree: TokenTree | None = None
        self._cheap_unverified = False

    @property
    def n_target_features(self) -> int:
        """(EAGLE-3 heads) positions whose target features the model drafter has."""
        return self.model.n_target_features

    @property
    def model_stats(self):
        """The model drafter's ``ModelDraftStats`` when it can draft this step, else None."""
        return None if self.model is None else self.model.model_stats

    @property
    def feature_gate(self):
        """The model drafter's ``ModelDraftStats`` when it drafts on after positions whose
        target features it never received (``feature_gaps``: EAGLE-3 heads), so that the step
        may pause the tap while the policy expects no model step
        (``SpeculationPolicy.needs_features``); None: it needs every row."""
        if self.model is None or not getattr(self.model, "feature_gaps", False):
            return None
        return self.model.stats

    def add_target_features(self, first_pos: int, rows) -> None:
        self.model.add_target_features(first_pos, rows)

    def set_final_hidden(self, pos: int, row) -> None:
        """(Medusa heads) the target's final hidden state at ``pos`` (``MedusaDrafter.set_final_hidden``)."""
        self.model.set_final_hidden(pos, row)

    def check_target(self, model) -> None:
        """The model drafter's ``check_target`` (MTP), if it has one."""
        check = getattr(self.model, "check_target", None)
        if check is not None:
            check(model)

    def attach(self, target: TargetHandle) -> None:
        if self.model is not None and hasattr(self.model, "attach"):
            self.model.attach(target)

    def set_sampling(self, sampler) -> None:
        self.ngram.set_sampling(sampler)
        if self.model is not None and hasattr(self.model, "set_sampling"):
            self.model.set_sampling(sampler)

    def begin(self, history: Sequence[int], context: Sequence[Sequence[int]] = ()) -> None:
        self.ngram.begin(history, context)
        if self.model is not None:
            self.model.begin(history)

    def accept(self, tokens: Sequence[int]) -> None:
        self.ngram.accept(tokens)
        if self.model is not None:
            self.model.accept(tokens)

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree:
        """The cheap phase: the n-gram tree (no model call)."""
        self._ngram_tree = self._cheap_tree = self.ngram.propose(max_depth, max_nodes)
        self._model_tree = None
        self._cheap_unverified = False
        if self.model is not None:
            self.model.propose(max_depth, max_nodes)  # the model's (empty) cheap phase
        return self._ngram_tree

    @property
    def model_part(self) -> Drafter | None:
        """The model drafter (``extend_together`` drafts it with other requests' models)."""
        return self.model

    def use_cheap_tree(self, tree: TokenTree) -> None:
        """This step's n-gram tree as the policy rescored it (``keep_base_plan``): what the
        model's tree is merged with (the n-grams still learn from the tree they proposed)."""
        self._cheap_tree = tree

    def extend(self, shape) -> TokenTree:
        """The model's tree of ``shape`` merged with this step's n-gram tree."""
        return self.extended(self.model.extend(shape))

    @property
    def model_tree(self) -> TokenTree | None:
        """This step's tree from the model alone (before the merge), or None: the model did
        not draft this step."""
        return self._model_tree

    def verify_model_only(self) -> None:
        """This step verifies none of the n-gram drafts (``SpeculationPolicy.select_model_nodes``):
        the model's gain is all it gets accepted (the n-grams' unverified matches are no
        baseline)."""
        self._cheap_unverified = True

    def extended(self, model_tree: TokenTree) -> TokenTree:
        """This step's tree from the model's (``model_part``'s ``extend``): merged with the n-gram tree."""
        self._model_tree = model_tree
        return merge_trees(model_tree, self._cheap_tree)

    def spawn(self) -> "AutoDrafter":
        """An auto drafter for another request: its own n-gram drafter (on the same memory),
        and the model drafter's ``spawn`` (sharing what it loaded)."""
        model = self.model.spawn() if self.model is not None else None
        return AutoDrafter(model, NgramDrafter(memory=self.ngram.memory))

    def observe(self, tree: TokenTree, emitted: Sequence[int]) -> None:
        if self._ngram_tree is not None:
            self.ngram.observe(self._ngram_tree, emitted)
        if self.model is not None:
            if self._model_tree is None:  # the plan did not run the model this step
                self.model.observe(tree, emitted)
            else:  # its gain is what it got accepted beyond the n-gram tree
                base = 0
                if self._ngram_tree is not None and not self._cheap_unverified:
                    base = accepted_length(self._ngram_tree, emitted)
                self.model.observe(self._model_tree, emitted, baseline=base)

    def close(self) -> None:
        self.ngram.close()
        if self.model is not None:
            self.model.close()
