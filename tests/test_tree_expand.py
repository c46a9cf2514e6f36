"""Dynamic draft trees (EAGLE-2 style) with a synthetic draft model: shapes, scores, merging,
and lossless rejection sampling of sampled (stochastic) trees after pruning."""

import numpy as np
import pytest

from conftest import FakeModel, chisquare_pvalue, fixed_cost_model
from localspec.drafters.auto import merge_trees
from localspec.drafters.tree_expand import DraftCalibration, DraftMode, DraftChildSelector, expand_tree
from localspec.policy import SpeculationPolicy, TreeShape, accepted_length
from localspec.request_state import RequestState
from localspec.sampling import SamplingParams
from localspec.tree import SparseDist, TokenSource, TokenTree, TreeBuilder
from localspec.verify import sample_from, verify_greedy, verify_rejection

V = 8  # vocabulary of the synthetic models


def logits_after(path: tuple[int, ...], salt: int) -> np.ndarray:
    """A fixed pseudo-random logits row for each history path (a 'model')."""
    rng = np.random.default_rng(abs(hash((salt,) + path)) % (2**32))
    return (rng.normal(size=V) * 1.5).astype(np.float32)


class FakeDraft:
    """A LevelDecoder over the synthetic draft model; records the batches it decoded."""

    def __init__(self, salt=1):
        self.salt = salt
        self.levels: list[list[int]] = []

    def decode_level(self, tree: TreeBuilder, nodes):
        self.levels.append(list(nodes))
        rows = []
        for n in nodes:
            path = []
            while n > 0:
                path.append(tree.tokens[n])
                n = tree.parents[n]
            rows.append(logits_after(tuple(reversed(path)), self.salt))
        return np.stack(rows)


def sampler(**kw):
    params = SamplingParams(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5, **kw})
    return DraftChildSelector(params, V)


def test_greedy_tree_shape_and_scores():
    dec = FakeDraft()
    shape = TreeShape(depth=3, width=2, max_nodes=100, min_score=0.0)
    tree = expand_tree(0, 10, shape, dec, sampler(), DraftCalibration(), TokenSource.DRAFT_MODEL)
    # 3 levels of children, 2 per expanded node, 2 nodes expanded per level -> 2 + 4 + 4
    assert tree.n_nodes == 1 + 2 + 4 + 4
    assert [len(x) for x in dec.levels] == [1, 2, 2]
    assert tree.max_depth() == 3
    par = tree.parents[1:]
    assert np.all(tree.score[1:] <= tree.score[par] + 1e-12)  # never increase down a path
    # children are the top-2 of the draft logits, in order
    top = np.argsort(-logits_after((), 1), kind="stable")[:2]
    assert [int(tree.token_ids[c]) for c in tree.children(0)] == list(top)
    assert all(tree.source[1:] == TokenSource.DRAFT_MODEL)
    assert tree.feature is not None and tree.feature.size == tree.n_nodes


def test_node_budget_keeps_the_best_nodes_and_stays_a_tree():
    shape = TreeShape(depth=4, width=3, max_nodes=7, min_score=0.0)
    tree = expand_tree(0, 0, shape, FakeDraft(), sampler(), DraftCalibration(), TokenSource.DRAFT_MODEL)
    assert tree.n_nodes == 7
    full = expand_tree(0, 0, TreeShape(4, 3, 1000, 0.0), FakeDraft(), sampler(), DraftCalibration(), TokenSource.DRAFT_MODEL)
    assert sorted(tree.score[1:])[::-1] == pytest.approx(sorted(full.score[1:])[::-1][:6])


def test_expansion_stops_below_min_score():
    cal = DraftCalibration()
    for b in range(cal.tracker.prior.size):  # make every draft look hopeless
        for _ in range(200):
            cal.tracker.record(b, False)
    dec = FakeDraft()
    tree = expand_tree(0, 0, TreeShape(6, 2, 50, min_score=0.05), dec, sampler(), cal, TokenSource.DRAFT_MODEL)
    assert len(dec.levels) == 1 and tree.max_depth() == 1


def test_gumbel_children_are_the_targets_seeded_choice():
    """A draft equal to the target, perturbed with the same noise, proposes as its first child
    exactly the token the target's seeded Gumbel-max picks."""
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.0, seed=11)
    ds = DraftChildSelector(params, V)
    assert ds.mode == DraftMode.GUMBEL
    req = RequestState(params, FakeModel(V), [1, 2])
    for pos in range(40):
        row = logits_after((pos,), 3)
        ch = ds.children(row, pos, 3)
        assert int(ch.tokens[0]) == req.processor.choose(row, pos, params.seed)


def test_sampled_children_carry_their_distribution():
    ds = DraftChildSelector(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2, verify="rejection"), V)
    assert ds.mode == DraftMode.SAMPLE
    row = logits_after((), 9)
    ch = ds.children(row, 3, 4)
    q = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    assert isinstance(ch.dist, SparseDist)  # over its support only, never [n_vocab] per node
    assert np.allclose(ch.dist.dense(V), q) and np.allclose(ch.draft_probs, q[ch.tokens])


def test_merge_trees_unions_and_dedupes():
    a = TokenTree.chain(7, [1, 2, 3], source=TokenSource.DRAFT_MODEL, scores=[0.9, 0.8, 0.1])
    b = TokenTree.chain(7, [1, 2, 4], source=TokenSource.NGRAM, scores=[0.5, 0.6, 0.5])
    m = merge_trees(a, b)
    assert m.n_nodes == 5  # root, 1, 2, 3, 4
    n1 = m.children(0)[0]
    n2 = m.children(n1)[0]
    assert m.score[n2] == pytest.approx(0.8)  # the larger estimate
    assert sorted(int(m.token_ids[c]) for c in m.children(n2)) == [3, 4]
    assert TokenSource(int(m.source[n1])) == TokenSource.DRAFT_MODEL
    # a stochastic node is never merged with a deterministic sibling
    bb = TreeBuilder(7)
    bb.add(0, 1, source=TokenSource.DRAFT_MODEL, score=0.5, draft_prob=0.3)
    bb.set_draft_dist(0, np.full(V, 1 / V))
    m2 = merge_trees(bb.build(), b)
    assert sorted(int(m2.token_ids[c]) for c in m2.children(0)) == [1, 1]
    assert 0 in m2.draft_dists
    with pytest.raises(ValueError):
        merge_trees(bb.build(), bb.build())


def test_accepted_length_walks_the_tree():
    t = TokenTree.chain(7, [1, 2, 3])
    assert accepted_length(t, [1, 2, 9, 3]) == 2
    assert accepted_length(t, [5]) == 0


def test_policy_tree_shape_follows_machine_and_acceptance():
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    from localspec.policy import ModelDraftStats

    low = pol.tree_shape(ModelDraftStats(accept_length=0.2), max_depth=8, max_nodes=64, max_width=8)
    high = pol.tree_shape(ModelDraftStats(accept_length=5.0), max_depth=8, max_nodes=64, max_width=8)
    assert low.depth < high.depth <= 8
    assert 2 <= low.max_nodes <= 8  # on the CPU cost table a tree of a few nodes
    flat = SpeculationPolicy(type(fixed_cost_model())({b: 10000.0 for b in (1, 2, 4, 8, 16, 32, 64)}), max_nodes=64)
    wide = flat.tree_shape(ModelDraftStats(accept_length=2.0), max_depth=8, max_nodes=64, max_width=8)
    assert wide.max_nodes == 64 and wide.width > 1  # a GPU-like machine verifies wide trees


@pytest.mark.parametrize("shape", [TreeShape(2, 1, 3, 0.0), TreeShape(3, 2, 6, 0.0)], ids=["chain", "tree"])
def test_sampled_trees_pruned_by_score_stay_lossless(shape):
    """Classic rejection sampling of draft-model trees (i.i.d. sampled children with their
    draft probabilities), pruned to a node budget: the first two emitted tokens follow the
    target's joint distribution exactly (chi-square over many seeds)."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify="rejection")
    model = FakeModel(V, eog=())
    counts: dict[tuple[int, int], int] = {}
    n = 12000
    for seed in range(n):
        sp = params.with_seed(seed)
        ds = DraftChildSelector(sp, V)
        tree = expand_tree(0, 4, shape, FakeDraft(salt=1), ds, DraftCalibration(), TokenSource.DRAFT_MODEL)
        # target rows: the target model (salt 2) after each node's path
        rows = []
        for i in range(tree.n_nodes):
            path = [int(tree.token_ids[j]) for j in tree.path_to(i)]
            rows.append(logits_after(tuple(path), 2))
        req = RequestState(sp, model, [0])
        res = verify_rejection(tree, np.stack(rows), req.cursor(5))
        if len(res.tokens) < 2:  # nothing accepted: the next step decodes the second token
            c = RequestState(sp, model, [0, res.tokens[0]]).cursor(6)
            second = sample_from(c.target_probs(logits_after((res.tokens[0],), 2)), c.residual_uniform())
        else:
            second = res.tokens[1]
        key = (res.tokens[0], second)
        counts[key] = counts.get(key, 0) + 1
    p1 = np.exp(logits_after((), 2).astype(np.float64))
    p1 /= p1.sum()
    expected, observed = [], []
    for a in range(V):
        p2 = np.exp(logits_after((a,), 2).astype(np.float64))
        p2 /= p2.sum()
        for b in range(V):
            expected.append(p1[a] * p2[b])
            observed.append(counts.get((a, b), 0))
    assert chisquare_pvalue(observed, expected) > 1e-3


def test_greedy_verification_of_expanded_trees_gives_the_target_argmax():
    dec = FakeDraft(salt=1)
    tree = expand_tree(0, 0, TreeShape(3, 2, 10, 0.0), dec, sampler(), DraftCalibration(), TokenSource.DRAFT_MODEL)
    rows = np.stack([logits_after(tuple(int(tree.token_ids[j]) for j in tree.path_to(i)), 2) for i in range(tree.n_nodes)])
    req = RequestState(SamplingParams.greedy(seed=1), FakeModel(V, eog=()), [0])
    res = verify_greedy(tree, rows, req.cursor(1))
    for tok, row in zip(res.tokens, res.rows):
        assert tok == int(np.argmax(rows[row]))
