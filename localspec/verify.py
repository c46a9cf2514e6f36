"""Lossless verification of token trees (chains are trees with one leaf).

Words used here and everywhere else in localspec:

* **accepted** tokens: draft tokens the target agreed with, on one root-to-node path;
  ``accept_length`` counts them.
* after the accepted path the target always contributes one more token. It is a
  **recovered** token when the node it follows had drafts and all of them were rejected
  (it comes from the residual distribution), and a **bonus** token when that node had no
  drafts left to check. In a step with no drafts at all it is a plain **decode** token.
* mean acceptance length = emitted tokens / steps = ``accept_length + 1`` on average
  (bonus / recovered token included).

Two walks, both exactly the target's distribution:

``verify_greedy``
    At each node the target's token is ``cursor.target_token(row)``: the argmax at
    temperature 0, or the seeded Gumbel-max sample at temperature > 0 (so this is greedy
    verification on perturbed logits). Take the child with that token; the first node
    without one ends the walk, and the target's token there is the recovered/bonus token.
    Lossless for any tree, whatever the drafter.

``verify_rejection``
    Classic rejection sampling. Children of a node are tried in order against the current
    residual distribution ``residual`` (initially ``target_probs`` of the node):

    - a *stochastic* child x, drawn i.i.d. from the draft distribution ``draft_probs`` at the
      node, is accepted with probability ``min(1, residual(x) / draft_probs(x))``; on
      rejection ``residual <- norm(max(residual - draft_probs, 0))`` (Leviathan et al. 2023,
      Chen et al. 2023; multi-round for trees as in SpecInfer, Miao et al. 2024);
    - a *deterministic* child c (n-gram continuation, top-k expansion) is a point mass: it
      is accepted with probability ``residual(c)``; on rejection ``residual(c) <- 0`` and the
      residual is renormalised.

    If no child is accepted, the recovered token is drawn from the residual; a node without
    children yields a bonus token drawn from ``target_probs``.

    The rule assumes the j-th stochastic child tried is the j-th i.i.d. draw, whatever the
    sampled tokens (the sibling-order invariant, ``tree`` module docstring):
    ``check_sampled_siblings`` refuses trees that break it, before either walk.

``verify`` runs both walks in C (``localspec.native``) for requests without a grammar when
the library is available; ``verify_greedy`` and ``verify_rejection`` are the reference the
tests compare it with (same accepted path and tokens for the same seed).

``verify_thresholds`` (**LOSSY**, opt-in)
    SGLang's target-only tree speculative sampling with acceptance thresholds
    (``tree_speculative_sampling_target_only`` in sgl-kernel; SGLang's
    ``--speculative-accept-threshold-single`` / ``--speculative-accept-threshold-acc``). At a
    node the children are tried in order with ONE uniform ``coin`` per node; ``prob_acc``
    accumulates the target probabilities of the children tried so far (the current one
    included), and child k is accepted when ``target_prob(k) >= threshold_single`` or
    ``coin <= prob_acc / threshold_acc``. If none is, the recovered token is drawn from the
    target's distribution with the tried children removed (renormalised); a node without
    children yields a bonus token drawn from the target. Draft probabilities are not used.
    With both thresholds 1.0 this is inverse-CDF sampling of the target (child k is accepted
    iff the coin falls in its slice of the cumulative target probability) and lossless for
    any tree; below 1 it accepts more and the output drifts from the target's distribution.
    A child whose token was already tried at the node is skipped (its probability is counted
    once, so duplicates cannot inflate ``prob_acc``). ``verify`` runs it only when the request
    asks for a threshold < 1 at temperature > 0 (``SamplingParams.lossy``); otherwise nothing
    above changes. ``verify`` runs its C twin (``ls_verify_thresholds``) for requests without a
    grammar when the library is available; ``threshold_walk`` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .native import verify as native_verify
from .tree import SparseDist, TokenSource, TokenTree


@dataclass
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        path: accepted draft node indices, root excluded, top-down (``accept_length`` long).
        tokens: emitted tokens: the accepted drafts then the recovered/bonus token
            (``len(path) + 1`` long).
        rows: for each emitted token, the node whose logits row produced it
            (``[0] + path``).
        sources: ``TokenSource`` of each emitted token.
        depths: for each accepted draft, its depth (1-based).
    """

    path: list[int]
    tokens: list[int]
    rows: list[int]
    sources: list[TokenSource]
    depths: list[int] = field(default_factory=list)

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens (the recovered/bonus token excluded)."""
        return len(self.path)


def _final_source(tree: TokenTree, node: int, had_children: bool) -> TokenSource:
    if tree.n_nodes == 1:
        return TokenSource.DECODE
    return TokenSource.RECOVERED if had_children else TokenSource.BONUS


def _result(tree: TokenTree, path: list[int], tokens: list[int]) -> VerifyResult:
    """The ``VerifyResult`` of a walk that accepted ``path`` and emitted ``tokens``."""
    last = path[-1] if path else 0
    sources = [TokenSource(int(tree.source[c])) for c in path]
    sources.append(_final_source(tree, last, bool(tree.children(last))))
    return VerifyResult(path, tokens, [0, *path], sources, [int(tree.depth[c]) for c in path])


def _child_with_token(tree: TokenTree, node: int, token: int) -> int:
    for c in tree.children(node):
        if tree.token_ids[c] == token:
            return c
    return -1


def verify_greedy(tree: TokenTree, logits: np.ndarray, cursor) -> VerifyResult:
    """Walk ``tree`` taking the child equal to the target's token at each node.

    Args:
        tree: the verified tree (root = the token at position ``cursor.pos - 1``).
        logits: [n_nodes, n_vocab] float32, row i = logits after node i.
        cursor: a ``sampler.Cursor`` at the root's successor position; it is advanced
            past every accepted draft token (not past the final token).
    """
    node = 0
    path: list[int] = []
    tokens: list[int] = []
    while True:
        t = cursor.target_token(logits[node])
        tokens.append(t)
        child = _child_with_token(tree, node, t)
        if child < 0:
            return _result(tree, path, tokens)
        path.append(child)
        cursor.advance(t)
        node = child


def _normalise(v: np.ndarray) -> np.ndarray | None:
    s = v.sum()
    if not s > 0:
        return None
    return v / s


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from ``probs`` ([n] float64, sums to 1) with uniform ``u``."""
    c = np.cumsum(probs)
    i = int(np.searchsorted(c, u * c[-1], side="right"))
    i = min(i, probs.size - 1)
    while probs[i] <= 0 and i > 0:  # never land on a zero-probability token at the edge
        i -= 1
    return i


def check_sampled_siblings(tree: TokenTree) -> None:
    """Refuse a tree whose sampled (i.i.d.) siblings are not tried in draw order.

    Under every node with a draft distribution, the stochastic children, in the order the
    walk tries them (index order), must be draws 0, 1, ..., m - 1 of that distribution: an
    order or a choice of kept draws that depends on the sampled tokens (e.g. sorting them by
    draft probability) would bias rejection sampling.

    Raises:
        ValueError: the sampled children of some node are out of draw order or not a prefix
            of its draws.
    """
    if not tree.draft_dists:
        return
    draws = tree.draws()
    for node in tree.draft_dists:
        got = [int(draws[c]) for c in tree.children(int(node)) if draws[c] >= 0]
        if got != list(range(len(got))):
            raise ValueError(
                f"the sampled children of node {node} are draws {got} in the order they would be tried; "
                "rejection sampling needs draws 0, 1, ... in draw order (sibling-order invariant)"
            )


def verify_rejection(tree: TokenTree, logits: np.ndarray, cursor) -> VerifyResult:
    """Rejection-sampling walk (see module docstring). Arguments as ``verify_greedy``.

    Uses ``cursor.target_probs(row)`` for the target distribution and the cursor's seeded
    uniforms, so a given tree, logits and seed always give the same result.

    Raises:
        ValueError: a stochastic child with zero draft probability, or sampled siblings out
            of draw order (``check_sampled_siblings``).
    """
    check_sampled_siblings(tree)
    node = 0
    path: list[int] = []
    tokens: list[int] = []
    while True:
        target_probs = cursor.target_probs(logits[node])
        kids = tree.children(node)
        residual = target_probs
        accepted = -1
        for k, c in enumerate(kids):
            x = int(tree.token_ids[c])
            u = cursor.accept_uniform(k)
            if tree.is_stochastic(c):
                draft_probs = tree.draft_dists[node]
                if isinstance(draft_probs, SparseDist):
                    draft_probs = draft_probs.dense(residual.size)
                qx = float(draft_probs[x])
                if qx <= 0.0:
                    raise ValueError(f"draft node {c} has zero probability under its draft distribution")
                if u < min(1.0, residual[x] / qx):
                    accepted = c
                    break
                nxt = _normalise(np.maximum(residual - draft_probs, 0.0))
                if nxt is not None:  # all-zero residual: draft == target, rejection had prob 0
                    residual = nxt
            else:
                if u < residual[x]:
                    accepted = c
                    break
                residual = residual.copy()
                residual[x] = 0.0
                nxt = _normalise(residual)
                if nxt is None:  # cannot happen unless residual was a point mass on x
                    residual[x] = 1.0
                else:
                    residual = nxt
        if accepted >= 0:
            node = _descend(tree, accepted, path, tokens, cursor)
            continue
        tokens.append(sample_from(residual, cursor.residual_uniform()))
        return _result(tree, path, tokens)


def _descend(tree: TokenTree, child: int, path: list[int], tokens: list[int], cursor) -> int:
    """Accept draft node ``child`` in a walk: record it in ``path`` / ``tokens``, advance the
    cursor past its token and return it (the walk's next node)."""
    t = int(tree.token_ids[child])
    tokens.append(t)
    path.append(child)
    cursor.advance(t)
    return child


@dataclass
class ThresholdWalk:
    """The decisions of the threshold walk before its last draw.

    Attributes:
        path: accepted draft node indices, root excluded, top-down.
        tokens: their tokens (``len(path)`` long).
        final_ids: [m] int64 ascending token ids of the distribution the last (recovered /
            bonus) token is drawn from.
        final_probs: [m] float64 probabilities of ``final_ids`` (sum 1): the target's
            distribution at the last node with its tried children removed and renormalised
            (the target's own when the node has no children).
    """

    path: list[int]
    tokens: list[int]
    final_ids: np.ndarray
    final_probs: np.ndarray


def threshold_walk(tree: TokenTree, logits: np.ndarray, cursor, threshold_single: float, threshold_acc: float) -> ThresholdWalk:
    """SGLang's thresholded walk (module docstring), up to the distribution of the last token.

    Args:
        tree / logits / cursor: as ``verify_greedy``; the cursor supplies the processed target
            distribution (``target_candidates``), ONE coin per node (``accept_uniform(0)``,
            compared as ``coin <= bound``) and is advanced past every accepted token.
        threshold_single / threshold_acc: in (0, 1]; 1.0 / 1.0 is lossless.
    """
    node = 0
    path: list[int] = []
    tokens: list[int] = []
    while True:
        cand = cursor.target_candidates(logits[node])
        ids, probs = cand.ids, cand.probs()
        if ids.size > 1 and not bool((ids[1:] > ids[:-1]).all()):
            order = np.argsort(ids, kind="stable")
            ids, probs = ids[order], probs[order]
        kids = tree.children(node)
        accepted = -1
        tried: list[int] = []
        if kids:
            coin = cursor.accept_uniform(0)
            prob_acc = 0.0
            seen: set[int] = set()
            for c in kids:
                x = int(tree.token_ids[c])
                if x in seen:
                    continue
                seen.add(x)
                at = int(np.searchsorted(ids, x))
                p = float(probs[at]) if at < ids.size and ids[at] == x else 0.0
                prob_acc += p
                if p >= threshold_single or coin <= prob_acc / threshold_acc:
                    accepted = c
                    break
                if p > 0.0:
                    tried.append(at)
        if accepted >= 0:
            node = _descend(tree, accepted, path, tokens, cursor)
            continue
        if tried:
            residual = probs.copy()
            residual[tried] = 0.0
            z = residual.sum()
            if z > 0.0:  # else the tried children held all the mass (rounding): keep the target
                probs = residual / z
        return ThresholdWalk(path, tokens, ids, probs)


def verify_thresholds(tree: TokenTree, logits: np.ndarray, cursor) -> VerifyResult:
    """**LOSSY** (below 1.0) thresholded verification (module docstring), with the request's
    ``accept_threshold_single`` / ``accept_threshold_acc`` (None = 1.0). Arguments as
    ``verify_greedy``; the recovered / bonus token is an inverse-CDF draw with the cursor's
    ``residual_uniform``."""
    params = cursor.req.params
    w = threshold_walk(tree, logits, cursor, *params.acceptance_thresholds)
    i = sample_from(w.final_probs, cursor.residual_uniform())
    return _result(tree, w.path, [*w.tokens, int(w.final_ids[i])])


def verify(tree: TokenTree, logits: np.ndarray, cursor) -> VerifyResult:
    """Dispatch: greedy / Gumbel walk, or classic rejection sampling when the request asks
    for it at temperature > 0; the LOSSY thresholded walk when the request sets a threshold
    below 1 at temperature > 0 (``SamplingParams.lossy``). Each runs in C for a request
    without a grammar when the library is loaded, else the Python reference."""
    req = cursor.req
    lossy = req.params.lossy
    rejection = not (req.is_greedy or req.params.verify == "gumbel")
    if rejection and not lossy:
        check_sampled_siblings(tree)
    state = None if cursor.has_grammar else req.processor.native_state()
    if state is not None:
        thresholds = req.params.acceptance_thresholds if lossy else None
        walk = native_verify.walk(
            tree, logits, state, seed=req.seed, pos=cursor.pos, window=cursor.window, rejection=rejection,
            thresholds=thresholds,
        )
        for t in walk.tokens[:-1]:
            cursor.advance(t)
        return _result(tree, walk.path, walk.tokens)
    if lossy:
        return verify_thresholds(tree, logits, cursor)
    if rejection:
        return verify_rejection(tree, logits, cursor)
    return verify_greedy(tree, logits, cursor)
