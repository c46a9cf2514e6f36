"""Per-request limits on what a drafter may have verified: llama.cpp's ``speculative.n_max``
and ``speculative.p_min`` mapped onto localspec's draft trees.

``DraftLimits.apply`` cuts a drafter's candidate tree (``TokenTree``) before the speculation
policy sizes it: the policy then chooses among the nodes the request allows. Cutting a
candidate never changes the output (every tree is verified losslessly), only how much is
drafted.

* ``min_score`` (llama.cpp's ``p_min``, the least draft probability a drafted token may have):
  nodes whose ``TokenTree.score`` (the drafter's estimate of the chance that the target
  accepts the path down to the node) is below it are dropped, with everything under them.
* ``max_nodes`` (llama.cpp's ``n_max``, the most draft tokens per step): at most this many draft
  nodes (the root not counted), the best-scoring ones (``TokenTree.best_subtree``); 0 = no
  drafting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import TokenTree


@dataclass(frozen=True)
class DraftLimits:
    """Limits on one request's draft trees.

    Attributes:
        max_nodes: most draft nodes per step (tree size - 1); None = no limit.
        min_score: least ``TokenTree.score`` a draft node may have, in [0, 1]; None = no limit.

    Raises:
        ValueError: ``max_nodes`` < 0, or ``min_score`` outside [0, 1].
    """

    max_nodes: int | None = None
    min_score: float | None = None

    def __post_init__(self) -> None:
        if self.max_nodes is not None and self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.min_score is not None and not 0.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be in [0, 1], got {self.min_score}")

    @property
    def is_unlimited(self) -> bool:
        return self.max_nodes is None and self.min_score is None

    def apply(self, cand: TokenTree) -> TokenTree:
        """``cand`` cut to these limits (the same object when nothing is cut).

        The nodes scoring at least ``min_score`` whose ancestors all do (for sampled siblings,
        only a prefix of the draws: the sibling-order invariant of ``localspec.tree``), then
        the best ``max_nodes`` of them.
        """
        tree = cand
        if self.min_score is not None and tree.n_nodes > 1:
            keep = np.asarray(tree.score, dtype=np.float64) >= self.min_score
            keep[0] = True
            draws = tree.draws() if tree.draft_dists else None
            cut_draw: dict[int, int] = {}  # parent -> first draw dropped
            order = range(1, tree.n_nodes)
            if draws is not None:  # visit each parent's sampled children in draw order
                order = sorted(order, key=lambda i: (int(tree.parents[i]), int(draws[i]), i))
                order = sorted(order, key=lambda i: int(tree.depth[i]))
            for i in order:
                p = int(tree.parents[i])
                ok = keep[i] and keep[p]
                if draws is not None and draws[i] >= 0:
                    ok = ok and p not in cut_draw
                    if not ok:
                        cut_draw.setdefault(p, int(draws[i]))
                keep[i] = ok
            if not keep.all():
                tree = tree.subtree(keep)
        if self.max_nodes is not None and tree.n_nodes > self.max_nodes + 1:
            tree = tree.best_subtree(self.max_nodes + 1)
        return tree
