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
            t = int(tree.token_ids[accepted])
            tokens.append(t)
            path.append(accepted)
            cursor.advance(t)
            node = accepted
            continue
        tokens.append(sample_from(residual, cursor.residual_uniform()))
        return _result(tree, path, tokens)


def verify(tree: TokenTree, logits: np.ndarray, cursor) -> VerifyResult:
    """Dispatch: greedy / Gumbel walk, or classic rejection sampling when the request asks
    for it at temperature > 0."""
    req = cursor.req
    rejection = not (req.is_greedy or req.params.verify == "gumbel")
    if rejection:
        check_sampled_siblings(tree)
    state = None if cursor.has_grammar else req.processor.native_state()
    if state is not None:
        walk = native_verify.walk(
            tree, logits, state, seed=req.seed, pos=cursor.pos, window=cursor.window, rejection=rejection
        )
        for t in walk.tokens[:-1]:
            cursor.advance(t)
        return _result(tree, walk.path, walk.tokens)
    if rejection:
        return verify_rejection(tree, logits, cursor)
    return verify_greedy(tree, logits, cursor)
