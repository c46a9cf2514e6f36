"""Token trees: what a drafter proposes and the target verifies in one batched call.

Node 0 is the **root**: the last token already emitted, not yet in the target's KV cache
(the "pending" token). Every other node is a draft token; ``parents[i] < i`` (nodes are in
topological order), so a chain is the special case ``parents = [-1, 0, 1, 2, ...]``.

::

    root ── a ── b ── c          node:    0  1  2  3  4  5
       │    └─── d               token:   r  a  b  c  d  e
       └─── e                    parents: -1 0  1  2  1  0
                                 depth:   0  1  2  3  2  1

Each node carries where it came from (``source``), the drafter's estimate of the chance
that the target accepts the whole path down to it (``score``), and, for nodes sampled
i.i.d. from a draft distribution, that distribution (``draft_dists`` keyed by the parent) and
the node's own probability under it (``draft_probs``); a distribution is a dense
[n_vocab] array or a ``SparseDist`` over the draft's support. Nodes without a draft distribution are
**deterministic** (n-gram continuations, top-k expansions) and are verified with the
point-mass rule (see ``verify.py``).

**The sibling-order invariant.** Rejection sampling over i.i.d. siblings (Leviathan et al.
2023; SpecInfer, Miao et al. 2024) is lossless only if the order in which the sampled siblings
are tried, and which of them are kept, do not depend on the sampled tokens: the j-th sibling
tried must be the j-th draw. Every edit here (``best_first_dfs``, ``best_subtree``) keeps the
sampled children of a node in draw order (``draw_index``) and keeps a prefix of the draws;
``verify.check_sampled_siblings`` refuses a tree that breaks it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SparseDist:
    """A draft distribution over its support only (every other token has probability 0).

    A model drafter's distribution lives on its draft vocabulary (an EAGLE-3 head's ``d2t``,
    a few thousand ids) or on the candidates left by top-k / top-p, so storing it dense
    ([n_vocab] float64, 2 MiB on a 262k vocabulary) per sampled node costs for nothing:
    rejection sampling reads ``draft_probs`` only at the sampled tokens and over the
    target's residual support, where absent ids count as 0.

    Attributes:
        ids: [m] int64 token ids, strictly ascending.
        probs: [m] float64 their probabilities (sum to 1 up to rounding).
    Raises:
        ValueError: ids not strictly ascending, or shapes that differ.
    """

    ids: np.ndarray
    probs: np.ndarray

    def __post_init__(self) -> None:
        ids = np.ascontiguousarray(self.ids, dtype=np.int64)
        probs = np.ascontiguousarray(self.probs, dtype=np.float64)
        if ids.shape != probs.shape or ids.ndim != 1:
            raise ValueError(f"SparseDist: ids {ids.shape} and probs {probs.shape} must be equal 1-d shapes")
        if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
            raise ValueError("SparseDist: ids must be strictly ascending")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "probs", probs)

    @classmethod
    def from_unsorted(cls, ids, probs) -> "SparseDist":
        """From distinct ``ids`` in any order (sorted here)."""
        ids = np.asarray(ids, dtype=np.int64)
        order = np.argsort(ids, kind="stable")
        return cls(ids[order], np.asarray(probs, dtype=np.float64)[order])

    def prob(self, token: int) -> float:
        """Probability of ``token`` (0 outside the support)."""
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < self.ids.size and self.ids[i] == token else 0.0

    def dense(self, n_vocab: int) -> np.ndarray:
        """[n_vocab] float64."""
        out = np.zeros(n_vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out


class TokenSource(enum.IntEnum):
    """How an emitted token was produced (for statistics and provenance colouring)."""

    DECODE = 0  # plain decoding: nothing was drafted at this step
    NGRAM = 1  # accepted draft from the n-gram drafter
    DRAFT_MODEL = 2  # accepted draft from a standalone draft model
    EAGLE3 = 3  # accepted draft from an EAGLE-3 head
    RECOVERED = 4  # target token after the drafts below the last accepted node were rejected
    BONUS = 5  # target token after a node whose drafts were all accepted (or that had none)
    MEDUSA = 6  # accepted draft from Medusa heads

    @property
    def is_draft(self) -> bool:
        return self in (TokenSource.NGRAM, TokenSource.DRAFT_MODEL, TokenSource.EAGLE3, TokenSource.MEDUSA)


@dataclass
class TokenTree:
    """A rooted token tree in topological order.

    Attributes:
        token_ids: [n] int32 token of each node; ``token_ids[0]`` is the root.
        parents:   [n] int32 parent index, ``-1`` for the root, ``parents[i] < i``.
        depth:     [n] int32 distance from the root.
        source:    [n] int8 ``TokenSource`` of each node (root: ``DECODE``).
        score:     [n] float64 estimated P(target accepts the path root..node); root = 1.
        draft_probs: [n] float32 draft probability of the node's token at its parent, or NaN
            for deterministic nodes.
        draft_dists: parent node -> [n_vocab] float32 draft distribution its stochastic
            children were sampled from.
        feature: [n] int32 drafter-defined feature of each node (e.g. the bucket of its
            acceptance estimate), carried through ``subtree`` so the drafter can learn from
            the verification of a pruned tree.
        draw_index: [n] int32 for a stochastic node, which i.i.d. draw of its parent's draft
            distribution it is (0 = the first); -1 for deterministic nodes. None: the
            stochastic children of each node were drawn in index order.
        base_score: [m] float64 (m <= n) or None. Set when a second source merged nodes into
            a drafter's tree (the drafting memory into the n-gram tree): nodes ``0..m-1`` are
            the first tree's, with these scores before the merge, and nodes ``m..`` were added.
            The policy lets the added nodes in only after what the first tree alone would
            have had verified (``SpeculationPolicy.keep_base_plan``). Not carried by
            ``subtree`` and the other copies.
    """

    token_ids: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    source: np.ndarray
    score: np.ndarray
    draft_probs: np.ndarray
    draft_dists: dict[int, np.ndarray] = field(default_factory=dict)
    feature: np.ndarray | None = None
    draw_index: np.ndarray | None = None
    base_score: np.ndarray | None = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def root_only(cls, root_token: int) -> "TokenTree":
        """The tree of a plain decoding step (no drafts)."""
        return TreeBuilder(root_token).build()

    @classmethod
    def chain(cls, root_token: int, draft_token_ids, source: TokenSource = TokenSource.NGRAM, scores=None) -> "TokenTree":
        """Root followed by a chain of deterministic drafts."""
        b = TreeBuilder(root_token)
        parent = 0
        for i, t in enumerate(draft_token_ids):
            parent = b.add(parent, int(t), source=source, score=1.0 if scores is None else float(scores[i]))
        return b.build()

    # -- queries ------------------------------------------------------------------------------

    @property
    def n_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_draft_tokens(self) -> int:
        """Draft nodes (the root excluded)."""
        return self.n_nodes - 1

    def __len__(self) -> int:
        return self.n_nodes

    def children(self, node: int) -> list[int]:
        """Child node indices of ``node`` in insertion (rank) order."""
        kids = self._children
        return kids[node]

    @property
    def _children(self) -> list[list[int]]:
        cached = self.__dict__.get("_kids")
        if cached is None:
            cached = [[] for _ in range(self.n_nodes)]
            for i in range(1, self.n_nodes):
                cached[int(self.parents[i])].append(i)
            self.__dict__["_kids"] = cached
        return cached

    def is_stochastic(self, node: int) -> bool:
        return not np.isnan(self.draft_probs[node])

    def stochastic_nodes(self) -> np.ndarray:
        """[k] int64 indices of the sampled nodes (``is_stochastic``), in index order."""
        return np.flatnonzero(~np.isnan(self.draft_probs))

    def draws(self) -> np.ndarray:
        """[n] int32 ``draw_index``, computed from index order when the tree has none."""
        if self.draw_index is not None:
            return self.draw_index
        out = np.full(self.n_nodes, -1, dtype=np.int32)
        count: dict[int, int] = {}
        for i in self.stochastic_nodes():
            p = int(self.parents[i])
            out[i] = count.get(p, 0)
            count[p] = out[i] + 1
        return out

    def leaves(self) -> np.ndarray:
        """[n_leaves] int node indices with no children, in index order."""
        has_child = np.zeros(self.n_nodes, dtype=bool)
        has_child[self.parents[1:]] = True
        return np.flatnonzero(~has_child)

    def is_chain(self) -> bool:
        return bool(np.all(self.parents[1:] == np.arange(self.n_nodes - 1)))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the first draft below the root down to ``node`` (root excluded)."""
        out = []
        while node > 0:
            out.append(node)
            node = int(self.parents[node])
        out.reverse()
        return out

    def max_depth(self) -> int:
        return int(self.depth.max()) if self.n_nodes else 0

    def ancestors_matrix(self) -> np.ndarray:
        """[n, n] bool, ``A[i, j]`` = node j is node i or one of its ancestors (tree mask)."""
        n = self.n_nodes
        a = np.eye(n, dtype=bool)
        cur = np.arange(n)
        rows = np.arange(n)
        for _ in range(self.max_depth()):
            cur = np.where(cur > 0, self.parents[np.maximum(cur, 0)], -1)
            ok = cur >= 0
            a[rows[ok], cur[ok]] = True
        return a

    # -- editing ------------------------------------------------------------------------------

    def _take(self, idx: np.ndarray) -> "TokenTree":
        """The nodes ``idx`` (parents listed before children) as a new tree; node ``i`` of the
        result is node ``idx[i]`` of this one. Every kept node's parent must be kept."""
        remap = np.full(self.n_nodes, -1, dtype=np.int32)
        remap[idx] = np.arange(idx.size, dtype=np.int32)
        par = self.parents[idx]
        parents = np.where(par >= 0, remap[np.maximum(par, 0)], -1).astype(np.int32)
        if np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, idx.size)):
            raise ValueError("a kept node's parent is missing or comes after it")
        return TokenTree(
            token_ids=self.token_ids[idx].copy(),
            parents=parents,
            depth=self.depth[idx].copy(),
            source=self.source[idx].copy(),
            score=self.score[idx].copy(),
            draft_probs=self.draft_probs[idx].copy(),
            draft_dists={int(remap[p]): d for p, d in self.draft_dists.items() if remap[p] >= 0},
            feature=None if self.feature is None else self.feature[idx].copy(),
            draw_index=self.draws()[idx].copy() if self.draft_dists else None,
        )

    def subtree(self, keep: np.ndarray) -> "TokenTree":
        """A new tree of the nodes where ``keep`` is True (must be closed under parents).

        Args:
            keep: [n] bool; ``keep[0]`` must be True.
        Raises:
            ValueError: a kept node's parent is not kept.
        """
        keep = np.asarray(keep, dtype=bool).copy()
        keep[0] = True
        return self._take(np.flatnonzero(keep))

    def reordered(self, order: np.ndarray) -> "TokenTree":
        """The same tree with nodes renumbered: new node i is old node ``order[i]``.

        Raises:
            ValueError: ``order`` does not list parents before children.
        """
        order = np.asarray(order, dtype=np.int64)
        if order.size != self.n_nodes or order[0] != 0:
            raise ValueError("reordered: order must be a permutation starting at the root")
        return self._take(order)

    def best_first_dfs(self) -> "TokenTree":
        """The tree renumbered in depth-first order, the highest-scoring child first.

        The most likely path then occupies nodes 1, 2, ..., d: when the target accepts it,
        its KV cells directly follow the committed prefix, in position order (see
        ``backend.kv.SequenceCache.commit``). Sampled (i.i.d.) siblings stay in draw order
        (the sibling-order invariant, module docstring): the places the sort gives to a
        node's sampled children are filled with them in draw order.
        """
        if self.n_nodes <= 2 or self.is_chain():
            return self
        kids = self._children
        draws = self.draws() if self.draft_dists else None
        order: list[int] = []
        stack = [0]
        while stack:
            node = stack.pop()
            order.append(node)
            ks = sorted(kids[node], key=lambda c: (-self.score[c], c))
            if draws is not None and node in self.draft_dists:
                sampled = sorted((c for c in ks if draws[c] >= 0), key=lambda c: draws[c])
                if len(sampled) > 1:
                    it = iter(sampled)
                    ks = [next(it) if draws[c] >= 0 else c for c in ks]
            stack.extend(reversed(ks))
        if order == list(range(self.n_nodes)):
            return self
        return self.reordered(np.asarray(order))

    def best_subtree(self, n_nodes: int) -> "TokenTree":
        """The ``n_nodes`` nodes (root included) with the highest scores, parents first.

        Nodes are taken best first (ties: lower index) among the *eligible* ones: children of
        kept nodes, and for sampled (i.i.d.) children only the next draw of their parent, so
        that the kept draws of a node are always its first ones (the sibling-order
        invariant, module docstring). A node's score never exceeds its parent's (it is a
        path probability); with the equal scores drafters give sampled siblings this is
        the top ``n_nodes`` by score.
        """
        if n_nodes >= self.n_nodes:
            return self
        import heapq

        kids = self._children
        draws = self.draws() if self.draft_dists else None
        keep = np.zeros(self.n_nodes, dtype=bool)
        keep[0] = True
        heap: list[tuple[float, int]] = []
        pending: dict[int, list[int]] = {}  # node -> its sampled children not yet eligible, by draw

        def open_node(node: int) -> None:
            sampled = []
            for c in kids[node]:
                if draws is not None and draws[c] >= 0:
                    sampled.append(c)
                else:
                    heapq.heappush(heap, (-float(self.score[c]), c))
            if sampled:
                sampled.sort(key=lambda c: draws[c])
                heapq.heappush(heap, (-float(self.score[sampled[0]]), sampled[0]))
                pending[node] = sampled[1:]

        open_node(0)
        count = 1
        while count < n_nodes and heap:
            _, i = heapq.heappop(heap)
            keep[i] = True
            count += 1
            open_node(i)
            rest = pending.get(int(self.parents[i])) if draws is not None and draws[i] >= 0 else None
            if rest:
                nxt = rest.pop(0)
                heapq.heappush(heap, (-float(self.score[nxt]), nxt))
        return self.subtree(keep)


class TreeBuilder:
    """Incremental construction of a ``TokenTree`` (parents before children).

    ``add`` merges a deterministic child into an existing sibling with the same token (the
    sibling keeps the larger score), so a trie of continuations never holds duplicates.
    """

    def __init__(self, root_token: int) -> None:
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.depth = [0]
        self.source = [int(TokenSource.DECODE)]
        self.score = [1.0]
        self.draft_probs = [np.nan]
        self.draft_dists: dict[int, np.ndarray] = {}
        self.feature: list[int] | None = None
        self.draw_index = [-1]
        self._child_of: dict[tuple[int, int], int] = {}
        self._n_draws: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, parent: int, token: int) -> int:
        """Index of ``parent``'s deterministic child with ``token``, or -1."""
        return self._child_of.get((parent, int(token)), -1)

    def add(
        self,
        parent: int,
        token: int,
        *,
        source: TokenSource,
        score: float = 1.0,
        draft_prob: float | None = None,
        draw_index: int | None = None,
    ) -> int:
        """Add a child of ``parent``; returns its node index.

        Args:
            draft_prob: the child's probability under the draft distribution it was sampled
                from (stochastic child). ``None`` makes a deterministic child, merged with an
                existing deterministic sibling of the same token.
            draw_index: (stochastic child) which draw of the parent's distribution it is;
                default: the parent's draws in the order they are added.
        """
        token = int(token)
        if draft_prob is None:
            existing = self._child_of.get((parent, token))
            if existing is not None:
                if score > self.score[existing]:
                    self.score[existing] = score
                return existing
        idx = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(int(parent))
        self.depth.append(self.depth[parent] + 1)
        self.source.append(int(source))
        self.score.append(float(score))
        self.draft_probs.append(np.nan if draft_prob is None else float(draft_prob))
        if draft_prob is None:
            self._child_of[(parent, token)] = idx
            self.draw_index.append(-1)
        else:
            k = self._n_draws.get(parent, 0) if draw_index is None else int(draw_index)
            self.draw_index.append(k)
            self._n_draws[parent] = max(self._n_draws.get(parent, 0), k + 1)
        return idx

    def set_draft_dist(self, parent: int, dist: np.ndarray) -> None:
        """Record the draft distribution (dense [n_vocab] or ``SparseDist``) the children of
        ``parent`` came from."""
        self.draft_dists[int(parent)] = dist

    def build(self) -> TokenTree:
        return TokenTree(
            token_ids=np.asarray(self.tokens, dtype=np.int32),
            parents=np.asarray(self.parents, dtype=np.int32),
            depth=np.asarray(self.depth, dtype=np.int32),
            source=np.asarray(self.source, dtype=np.int8),
            score=np.asarray(self.score, dtype=np.float64),
            draft_probs=np.asarray(self.draft_probs, dtype=np.float32),
            draft_dists=dict(self.draft_dists),
            feature=None if self.feature is None else np.asarray(self.feature, dtype=np.int32),
            draw_index=np.asarray(self.draw_index, dtype=np.int32) if self.draft_dists else None,
        )
