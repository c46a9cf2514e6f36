"""Dynamic draft trees from a draft model (EAGLE-2 style, Li et al. 2024).

A model drafter grows its tree one level per batched draft decode::

    frontier = [root]
    for each level (at most shape.depth):
        rows = decode(frontier)                   # one draft decode of the whole frontier
        for node, row in zip(frontier, rows):
            add the top-k children of node        # score = score(node) * P(accept child)
        frontier = the shape.width best new children by score
    tree = the shape.max_nodes best nodes of everything added (rerank)

Node ``score`` is the calibrated probability that the target accepts the path down to the
node: the product along the path of per-node acceptance estimates, each read from an
``AcceptanceTracker`` bucket of the node's *draft confidence* (its draft probability) and
learned online from what the target emitted (``observe``).

How children are chosen depends on the request's sampling, so that verification stays
lossless and drafts match what the target will pick (``DraftChildSelector``):

* temperature 0 (greedy): the top-k tokens of the draft logits (deterministic children;
  confidence = softmax probability).
* seeded Gumbel (``verify="gumbel"``): the top-k tokens of the draft's processed logits
  perturbed with the **same** per-position Gumbel noise the target uses
  (``sampling.gumbel_noise(seed, pos, ids)``), so the draft picks the token the target will
  pick whenever the two distributions are close (deterministic children).
* classic rejection sampling (``verify="rejection"``): k tokens drawn i.i.d. from the
  draft's processed distribution (stochastic children, with ``draft_probs`` and the
  distribution, sparse over its support, in ``draft_dists``). Their scores, and therefore every pruning decision,
  depend only on the tree's *shape* (depth bucket) and never on the sampled tokens:
  keeping or dropping a sampled child because of its value would bias the output.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..policy import AcceptanceTracker, TreeShape
from ..sampling import STREAM_DRAFT, LogitsProcessor, SamplingParams, gumbel_noise, stream_key, top_k, uniforms
from .. import native
from ..native import rows as native_rows
from ..tree import SparseDist, TokenSource, TokenTree, TreeBuilder


class DraftMode(enum.IntEnum):
    GREEDY = 0  # temperature 0: top-k of the draft logits
    GUMBEL = 1  # seeded Gumbel-max: top-k of the perturbed processed draft logits
    SAMPLE = 2  # classic rejection sampling: i.i.d. samples of the draft distribution


@dataclass
class Children:
    """The children chosen at one node.

    Attributes:
        tokens: [k] int64 target token ids, in the order they are tried.
        confidence: [k] float64 draft confidence of each (its bucket key).
        draft_probs: [k] float64 probability of each under ``dist`` (stochastic children), or None.
        dist: the draft distribution the children were drawn from (a ``SparseDist`` over its
            support, in target ids), or None.
    """

    tokens: np.ndarray
    confidence: np.ndarray
    draft_probs: np.ndarray | None = None
    dist: np.ndarray | None = None


# -- calibration ----------------------------------------------------------------------------------

CONF_EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
_N_CONF = CONF_EDGES.size
_N_STOCH_DEPTH = 8  # stochastic buckets: depth 1 .. 8+


def _conf_prior() -> np.ndarray:
    upper = np.append(CONF_EDGES[1:], 1.0)
    return (CONF_EDGES + upper) / 2


class DraftCalibration:
    """P(the target accepts a draft child | it reached the parent), learned online.

    Buckets: for deterministic children, (mode, confidence bucket) with the confidence's
    bucket midpoint as prior; for stochastic children, the depth only (prior 0.5).
    """

    def __init__(self) -> None:
        prior = np.concatenate([np.tile(_conf_prior(), 2), np.full(_N_STOCH_DEPTH, 0.5)])
        self.tracker = AcceptanceTracker(prior, prior_weight=4.0)

    @staticmethod
    def bucket(mode: DraftMode, confidence: float, depth: int) -> int:
        if mode == DraftMode.SAMPLE:
            return 2 * _N_CONF + min(depth, _N_STOCH_DEPTH) - 1
        b = int(np.searchsorted(CONF_EDGES, confidence, side="right")) - 1
        return int(mode) * _N_CONF + max(0, min(b, _N_CONF - 1))

    def estimate(self, bucket: int) -> float:
        return self.tracker.estimate(bucket)

    def observe(self, tree: TokenTree, emitted) -> None:
        self.tracker.learn(tree, emitted)

    def reset_request(self) -> None:
        self.tracker.reset_request()


# -- choosing children from draft logits ----------------------------------------------------------


class DraftChildSelector:
    """Chooses the children of nodes from draft logits rows, for one request's sampling.

    Applies the request's logit bias and the target's suppressed tokens, then (temperature >
    0) top-k / top-p / min-p and temperature, exactly like the target's pipeline; repetition
    penalties and grammars are not applied to drafts (any draft is verified losslessly; they
    only change how often drafts are accepted).

    **Draft-vocabulary rows.** With ``d2t`` (an EAGLE-3 head's reduced vocabulary: draft id
    -> target id) the rows given to ``children`` are ``[n_draft]`` wide, the logit bias and
    suppressed tokens are mapped into draft ids (target ids outside the draft vocabulary
    cannot be drafted anyway), everything is ranked at that width (top-k in C), and only the
    chosen ids are mapped back to target ids. Same children as ranking the ``[n_vocab]`` row
    with ``-inf`` outside the draft vocabulary, at a fraction of the work.

    Args:
        params: the request's sampling parameters (seed set).
        n_vocab: the target's vocabulary size.
        suppress_ids: the target's suppressed tokens.
        d2t: [n_draft] int64 target id of each draft id (distinct), or None: rows are
            ``[n_vocab]`` wide in target ids.
    """

    def __init__(self, params: SamplingParams, n_vocab: int, suppress_ids=(), d2t: np.ndarray | None = None) -> None:
        self.params = params
        self.seed = int(params.seed or 0)
        self.n_vocab = n_vocab
        self.d2t = None if d2t is None else np.ascontiguousarray(d2t, dtype=np.int64)
        if self.d2t is not None:
            t2d = {int(t): i for i, t in enumerate(self.d2t)}
            bias = {t2d[int(t)]: v for t, v in params.logit_bias.items() if int(t) in t2d}
            suppress_ids = [t2d[int(t)] for t in suppress_ids if int(t) in t2d]
            params = dataclasses.replace(params, logit_bias=bias)
            width = int(self.d2t.size)
        else:
            width = n_vocab
        self.width = width
        self.processor = LogitsProcessor(params, width, suppress_ids)
        if params.is_greedy:
            self.mode = DraftMode.GREEDY
        elif params.verify == "gumbel":
            self.mode = DraftMode.GUMBEL
        else:
            self.mode = DraftMode.SAMPLE

    def _target_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids if self.d2t is None else self.d2t[ids]

    def children(self, row: np.ndarray, pos: int, k: int, counter: int = 0) -> Children:
        """The ``k`` children of a node whose draft logits are ``row``.

        Args:
            row: [width] float32 draft logits after the node (``-inf`` = not proposable);
                ``width`` is ``len(d2t)`` with a draft vocabulary, else ``n_vocab``.
            pos: absolute position of the children (the target's position, for the noise).
            k: children wanted (fewer when fewer tokens are possible).
            counter: distinguishes nodes at the same position (stochastic draws).
        Returns:
            ``Children`` in target ids; stochastic children carry a ``SparseDist``.
        """
        x = self.processor.adjusted(row, None)
        if self.mode == DraftMode.GREEDY:
            ch = _top_k_children(x, k)
            ch.tokens = self._target_ids(ch.tokens)
            return ch
        cand = self.processor.candidates(row)
        tids = self._target_ids(cand.ids)
        if self.mode == DraftMode.GUMBEL:
            z = cand.logits.astype(np.float64) + gumbel_noise(self.seed, pos, tids)
            ch = _top_k_children(z, k)
            ch.tokens = tids[ch.tokens]
            return ch
        q = cand.probs()  # [m] float64
        u = uniforms(stream_key(self.seed, pos, STREAM_DRAFT), np.arange(counter * 256, counter * 256 + k))
        cdf = np.cumsum(q)
        picks = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), q.size - 1)
        return Children(tids[picks], q[picks], q[picks], SparseDist.from_unsorted(tids, q))


def _top_k_children(z: np.ndarray, k: int) -> Children:
    """Top-k of ``z`` ([m] float, ``-inf`` = impossible; ties: lower index, ``sampling.top_k``)
    with softmax(z) as confidence (logsumexp in float64, by the C kernel when it is built)."""
    top = top_k(z, k)
    if top.size == 0:
        return Children(np.zeros(0, dtype=np.int64), np.zeros(0))
    if native.enabled() and z.dtype == np.float32:
        lse = native_rows.logsumexp(z)
    else:
        m = float(z[top[0]])
        lse = m + float(np.log(np.sum(np.exp(z - m), dtype=np.float64)))  # exp(-inf) = 0
    return Children(top.astype(np.int64), np.exp(z[top].astype(np.float64) - lse))


# -- the expansion loop ---------------------------------------------------------------------------


class LevelDecoder(Protocol):
    """What a model drafter provides to ``expand_tree``."""

    def decode_level(self, tree: TreeBuilder, nodes: list[int]) -> np.ndarray:
        """Decode ``nodes`` of the tree under construction in one batch; return their draft
        logits: [len(nodes), n_vocab] float32 (row i = the distribution after nodes[i]).
        The first call of an expansion is ``nodes == [0]`` (the root)."""
        ...


def expand_tree(
    root_token: int,
    root_pos: int,
    shape: TreeShape,
    decoder: LevelDecoder,
    sampler: DraftChildSelector,
    calib: DraftCalibration,
    source: TokenSource,
) -> TokenTree:
    """Grow a dynamic draft tree (see the module docstring): ``expand_levels`` with
    ``decoder.decode_level`` answering each level.

    Args:
        root_token: the last emitted token (node 0).
        root_pos: its absolute position (children of a node at depth d sit at
            ``root_pos + d + 1``).
        shape: depth, width (top-k) and node budget.
        decoder: decodes a frontier and returns its draft logits.
        sampler: chooses children from logits for this request.
        calib: acceptance calibration; each node's bucket is stored in ``tree.feature``.
        source: ``TokenSource`` of the drafted nodes.
    Returns:
        a ``TokenTree`` of at most ``shape.max_nodes`` nodes, scores non-increasing along
        every path.
    """
    gen = expand_levels(root_token, root_pos, shape, sampler, calib, source)
    try:
        b, frontier = next(gen)
        while True:
            b, frontier = gen.send(decoder.decode_level(b, frontier))
    except StopIteration as stop:
        return stop.value


def expand_levels(root_token: int, root_pos: int, shape: TreeShape, sampler: DraftChildSelector,
                  calib: DraftCalibration, source: TokenSource):  # fmt: skip
    """``expand_tree`` as a generator, so that a caller can answer the levels of several
    requests' trees with one model call: it yields ``(builder, nodes)`` (the tree under
    construction and the frontier to decode, ``[0]`` first), is sent the frontier's draft
    logits rows ([len(nodes), width] float32, ``LevelDecoder.decode_level``), and returns the
    ``TokenTree`` (``StopIteration.value``). Arguments as ``expand_tree``'s."""
    b = TreeBuilder(root_token)
    b.feature = [0]
    frontier = [0]
    for level in range(shape.depth):
        rows = yield b, frontier
        new: list[int] = []
        for node, row in zip(frontier, rows):
            depth = b.depth[node] + 1
            ch = sampler.children(row, root_pos + depth, shape.width, counter=node)
            if ch.dist is not None:
                b.set_draft_dist(node, ch.dist)
            for j in range(ch.tokens.size):
                bucket = calib.bucket(sampler.mode, float(ch.confidence[j]), depth)
                score = b.score[node] * calib.estimate(bucket)
                prob = None if ch.draft_probs is None else float(ch.draft_probs[j])
                n_before = len(b)
                c = b.add(node, int(ch.tokens[j]), source=source, score=score, draft_prob=prob)
                if c == n_before:
                    b.feature.append(bucket)
                    new.append(c)
        if level == shape.depth - 1 or not new:
            break
        # scores of stochastic children depend on the shape only: ties -> sampling order
        new.sort(key=lambda c: (-b.score[c], c))
        frontier = [c for c in new[: shape.width] if b.score[c] >= shape.min_score]
        if not frontier:
            break
    tree = b.build()
    if tree.n_nodes > shape.max_nodes:
        tree = tree.best_subtree(shape.max_nodes)
    return tree
