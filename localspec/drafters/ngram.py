"""Prompt-lookup n-gram drafter that proposes token *trees*.

The history (prompt + generated tokens) is indexed incrementally (``NgramIndex``). At each
step the longest suffix of the history that occurred before is looked up; the continuations
that followed its most recent occurrences (and, when those are few, the occurrences of
shorter suffixes) are merged into a trie. Where the occurrences disagree the trie branches,
so the target can accept whichever continuation it agrees with in the same batched call.

Node scores estimate P(the target accepts the path to the node) as a product, along the
path, of per-node acceptance rates from an ``AcceptanceTracker`` bucketed by the match
order and by how many occurrences agree on the node (their share among its siblings). The
tracker learns from every verification, so the policy drafts long trees when the text is
being copied and nothing when it is not.

References: prompt lookup decoding (Saxena 2023), llama.cpp's ``ngram`` speculative modes;
trees of continuations as in REST (He et al. 2024) and Lookahead decoding (Fu et al. 2024).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..policy import AcceptanceTracker
from ..tree import TokenSource, TokenTree, TreeBuilder
from ..verify import VerifyResult
from .ngram_index import NgramIndex

# bucket = order_bucket * 4 + agreement_bucket
_ORDER_BUCKETS = (0, 0, 1, 2, 3, 3, 4, 4, 4)  # n = 0..8 -> 0..4 (n >= 6 share a bucket)
_N_ORDER = 5
_N_AGREE = 4  # 0: single occurrence, 1: >= 2 occurrences all agree, 2: majority, 3: minority
_PRIOR = np.array(
    [
        # single, all-agree, majority, minority
        [0.12, 0.20, 0.10, 0.03],  # n = 1
        [0.30, 0.40, 0.25, 0.08],  # n = 2
        [0.45, 0.55, 0.35, 0.10],  # n = 3
        [0.55, 0.65, 0.45, 0.12],  # n = 4, 5
        [0.65, 0.75, 0.50, 0.15],  # n >= 6
    ]
).ravel()


def _bucket(order: int, count: int, parent_count: int) -> int:
    ob = _ORDER_BUCKETS[min(order, len(_ORDER_BUCKETS) - 1)]
    if parent_count <= 1:
        ab = 0
    elif count == parent_count:
        ab = 1
    elif 2 * count > parent_count:
        ab = 2
    else:
        ab = 3
    return ob * _N_AGREE + ab


class NgramDrafter:
    """Drafts token trees from earlier occurrences of the history's suffix.

    Args:
        max_n: longest suffix matched (and indexed).
        min_n: shortest suffix matched.
        max_occurrences: most recent occurrences read per suffix order (bounds the cost).
        max_depth: longest continuation drafted.
        index: an ``NgramIndex``-compatible object (the native one when available).
    """

    name = "ngram"
    source = TokenSource.NGRAM

    def __init__(
        self,
        *,
        max_n: int = 8,
        min_n: int = 1,
        max_occurrences: int = 12,
        max_depth: int = 32,
        index=None,
    ) -> None:
        self.max_n = max_n
        self.min_n = min_n
        self.max_occurrences = max_occurrences
        self.max_depth = max_depth
        self.index = index if index is not None else NgramIndex(max_n)
        self.tracker = AcceptanceTracker(_PRIOR)

    # -- protocol -----------------------------------------------------------------------------

    def begin(self, history: Sequence[int]) -> None:
        self.index.reset(list(history))
        self.tracker.reset_request()

    def accept(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def propose(self, max_depth: int, max_nodes: int) -> TokenTree:
        toks = self.index.tokens
        builder = TreeBuilder(toks[-1])
        depth_cap = min(max_depth, self.max_depth)
        if depth_cap <= 0 or max_nodes <= 1 or len(toks) < 2:
            return builder.build()
        matches = self.index.lookup_all(min_n=self.min_n, max_occurrences=self.max_occurrences)
        # trie of continuations: counts of occurrences through each node, best order
        counts = [0]
        orders = [0]
        seen: set[int] = set()
        n_hist = len(toks)
        n_occ = 0
        for m in matches:
            if n_occ >= self.max_occurrences:
                break
            for s in m.starts:
                if s in seen or n_occ >= self.max_occurrences:
                    continue
                seen.add(s)
                n_occ += 1
                counts[0] += 1
                node = 0
                for t in toks[s : min(s + depth_cap, n_hist)]:
                    child = builder.find(node, t)
                    if child < 0:
                        child = builder.add(node, t, source=TokenSource.NGRAM, score=0.0)
                        counts.append(0)
                        orders.append(m.order)
                    counts[child] += 1
                    orders[child] = max(orders[child], m.order)
                    node = child
        n = len(builder)
        score = builder.score
        parents = builder.parents
        buckets = [0] * n
        for i in range(1, n):
            p = parents[i]
            b = _bucket(orders[i], counts[i], counts[p])
            buckets[i] = b
            score[i] = score[p] * self.tracker.estimate(b)
        builder.feature = buckets
        tree = builder.build()
        if tree.n_nodes > 4 * max_nodes:
            tree = tree.best_subtree(4 * max_nodes)
        return tree

    def observe(self, tree: TokenTree, result: VerifyResult) -> None:
        """Learn from the verification of a tree this drafter proposed (possibly pruned by the
        policy). Every child of the root and of each accepted node was "tried"."""
        if tree.n_nodes > 1 and tree.feature is not None:
            accepted = set(result.path)
            for node in [0, *result.path]:
                for c in tree.children(node):
                    if tree.source[c] == TokenSource.NGRAM:
                        self.tracker.record(int(tree.feature[c]), c in accepted)
        self.tracker.end_step()

    def close(self) -> None:
        pass
