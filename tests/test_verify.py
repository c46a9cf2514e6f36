"""Lossless verification: statistical tests that chain and tree rejection sampling and the
seeded Gumbel walk reproduce the target distribution, and greedy tests that cannot pass by
accident (adversarial trees still give the target argmax sequence)."""

import numpy as np
import pytest

from conftest import FakeModel, chisquare_pvalue
from localspec.sampler import RequestSampler
from localspec.sampling import SamplingParams
from localspec.tree import TokenSource, TreeBuilder
from localspec.verify import verify, verify_greedy, verify_rejection

V = 8
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def make_rows(rng, n):
    return (rng.standard_normal((n, V)) * 1.5).astype(np.float32)


def run(tree, rows, params, seed, fn=verify):
    req = RequestSampler(params.with_seed(seed), FakeModel(V, eog=()), [])
    cur = req.cursor(10)
    return fn(tree, rows, cur)


def sample_chain(rng, root, draft_dists, depth):
    """Root -> x1 -> x2 ... each drawn from the draft distribution of its depth."""
    b = TreeBuilder(root)
    node = 0
    for d in range(depth):
        q = draft_dists[d]
        x = int(rng.choice(V, p=q))
        b.set_draft_dist(node, q)
        node = b.add(node, x, source=TokenSource.DRAFT_MODEL, draft_prob=float(q[x]))
    return b.build()


@pytest.mark.parametrize("verify_mode", ["rejection", "gumbel"])
def test_chain_sampling_matches_target(rng, verify_mode):
    """First emitted token ~ target_probs(root); second token given an accepted first draft
    ~ target_probs(that node). Draft tokens are resampled every trial (rejection sampling is
    exact in expectation over the draft)."""
    rows = make_rows(rng, 3)
    # one row per depth: the node at depth d always uses rows[d] (a fixed "target" per depth)
    q = [softmax(rng.standard_normal(V)) for _ in range(2)]
    params = SamplingParams(**{**SAMPLED.__dict__, "verify": verify_mode})
    first = np.zeros(V)
    second_given = {}
    n = 6000
    for trial in range(n):
        tree = sample_chain(rng, 0, q, 2)
        res = run(tree, rows, params, seed=trial)
        first[res.tokens[0]] += 1
        if res.accept_length >= 1:
            x1 = res.tokens[0]
            second_given.setdefault(x1, np.zeros(V))[res.tokens[1]] += 1
    assert chisquare_pvalue(first, softmax(rows[0].astype(np.float64))) > 1e-3
    # the token after an accepted first draft follows the target row of depth 1
    pooled = sum(second_given.values())
    assert pooled.sum() > 250
    assert chisquare_pvalue(pooled, softmax(rows[1].astype(np.float64))) > 1e-3


def sample_tree(rng, root, q_root, q_child, k):
    """Root with k i.i.d. children from q_root, a deterministic child (token 0) after them,
    and each stochastic child with one i.i.d. grandchild from q_child."""
    b = TreeBuilder(root)
    b.set_draft_dist(0, q_root)
    kids = []
    for _ in range(k):
        x = int(rng.choice(V, p=q_root))
        kids.append(b.add(0, x, source=TokenSource.DRAFT_MODEL, draft_prob=float(q_root[x])))
    b.add(0, 0, source=TokenSource.NGRAM)  # point mass, tried after the stochastic ones
    for c in kids:
        b.set_draft_dist(c, q_child)
        y = int(rng.choice(V, p=q_child))
        b.add(c, y, source=TokenSource.DRAFT_MODEL, draft_prob=float(q_child[y]))
    return b.build()


@pytest.mark.parametrize("verify_mode", ["rejection", "gumbel"])
def test_tree_sampling_matches_target(rng, verify_mode):
    row0 = (rng.standard_normal(V) * 1.5).astype(np.float32)
    row1 = (rng.standard_normal(V) * 1.5).astype(np.float32)
    q_root = softmax(rng.standard_normal(V))
    q_child = softmax(rng.standard_normal(V))
    params = SamplingParams(**{**SAMPLED.__dict__, "verify": verify_mode})
    first = np.zeros(V)
    second = np.zeros(V)
    n = 6000
    for trial in range(n):
        tree = sample_tree(rng, 0, q_root, q_child, k=3)
        rows = np.stack([row0] + [row1] * (tree.n_nodes - 1))  # every non-root node shares row1
        res = run(tree, rows, params, seed=trial)
        first[res.tokens[0]] += 1
        if res.accept_length >= 1:
            second[res.tokens[1]] += 1
    assert chisquare_pvalue(first, softmax(row0.astype(np.float64))) > 1e-3
    assert second.sum() > 250
    assert chisquare_pvalue(second, softmax(row1.astype(np.float64))) > 1e-3


def test_deterministic_tree_rejection_matches_target(rng):
    """n-gram style trees (point masses only) with a fixed proposal."""
    row0 = (rng.standard_normal(V) * 1.5).astype(np.float32)
    rowc = (rng.standard_normal(V) * 1.5).astype(np.float32)
    b = TreeBuilder(0)
    for tok in (3, 1, 6):
        c = b.add(0, tok, source=TokenSource.NGRAM)
        b.add(c, (tok + 2) % V, source=TokenSource.NGRAM)
    tree = b.build()
    rows = np.stack([row0] + [rowc] * (tree.n_nodes - 1))
    params = SamplingParams(**{**SAMPLED.__dict__, "verify": "rejection"})
    first = np.zeros(V)
    second = np.zeros(V)
    for trial in range(6000):
        res = run(tree, rows, params, seed=trial)
        first[res.tokens[0]] += 1
        if res.accept_length >= 1:
            second[res.tokens[1]] += 1
    assert chisquare_pvalue(first, softmax(row0.astype(np.float64))) > 1e-3
    assert chisquare_pvalue(second, softmax(rowc.astype(np.float64))) > 1e-3


def test_gumbel_walk_equals_plain_sampling_for_any_tree(rng):
    """Seeded Gumbel: the emitted tokens do not depend on what was drafted."""
    params = SAMPLED
    for seed in range(200):
        rows_by_token = {t: (rng.standard_normal(V) * 2).astype(np.float32) for t in range(V)}
        root_row = (rng.standard_normal(V) * 2).astype(np.float32)
        # plain: one step at a time
        plain1 = run(TreeBuilder(0).build(), root_row[None], params, seed).tokens[0]
        # a random tree whose depth-1 node rows depend on the node's token
        b = TreeBuilder(0)
        for tok in rng.choice(V, size=3, replace=False):
            b.add(0, int(tok), source=TokenSource.NGRAM)
        tree = b.build()
        rows = np.stack([root_row] + [rows_by_token[int(t)] for t in tree.token_ids[1:]])
        res = run(tree, rows, params, seed)
        assert res.tokens[0] == plain1
        if res.accept_length:
            # the second token is what plain decoding would choose at the next position
            req = RequestSampler(params.with_seed(seed), FakeModel(V, eog=()), [])
            cur = req.cursor(11)
            assert res.tokens[1] == cur.target_token(rows_by_token[plain1])


def test_greedy_adversarial_trees_give_argmax(rng):
    """Random / wrong drafts: every emitted token is the argmax of the row that produced it,
    and accepted drafts are exactly the argmax path."""
    params = SamplingParams.greedy()
    for trial in range(300):
        n = int(rng.integers(1, 12))
        b = TreeBuilder(int(rng.integers(V)))
        for _ in range(n):
            p = int(rng.integers(0, len(b)))
            b.add(p, int(rng.integers(V)), source=TokenSource.NGRAM)
        tree = b.build()
        rows = make_rows(rng, tree.n_nodes)
        res = run(tree, rows, params, seed=trial, fn=verify_greedy)
        for tok, row in zip(res.tokens, res.rows):
            assert tok == int(np.argmax(rows[row]))
        # walk by hand
        node = 0
        for c in res.path:
            assert tree.parents[c] == node and tree.token_ids[c] == np.argmax(rows[node])
            node = c
        assert not any(tree.token_ids[c] == np.argmax(rows[node]) for c in tree.children(node))
        want = TokenSource.DECODE if tree.n_nodes == 1 else (
            TokenSource.RECOVERED if tree.children(node) else TokenSource.BONUS
        )
        assert res.sources[-1] == want


def test_rejection_is_reproducible_for_a_seed(rng):
    rows = make_rows(rng, 4)
    b = TreeBuilder(0)
    b.add(0, 1, source=TokenSource.NGRAM)
    b.add(1, 2, source=TokenSource.NGRAM)
    b.add(0, 3, source=TokenSource.NGRAM)
    tree = b.build()
    params = SamplingParams(**{**SAMPLED.__dict__, "verify": "rejection"})
    a = [run(tree, rows, params, s, fn=verify_rejection).tokens for s in range(50)]
    b2 = [run(tree, rows, params, s, fn=verify_rejection).tokens for s in range(50)]
    assert a == b2
    assert len({tuple(x) for x in a}) > 1
