import numpy as np
import pytest

from localspec.backend.tree_layout import layout_tree
from localspec.tree import TokenSource, TokenTree, TreeBuilder


def build_example():
    #  root ── a ── b ── c
    #     │    └─── d
    #     └─── e
    b = TreeBuilder(100)
    a = b.add(0, 1, source=TokenSource.NGRAM, score=0.9)
    bb = b.add(a, 2, source=TokenSource.NGRAM, score=0.8)
    b.add(bb, 3, source=TokenSource.NGRAM, score=0.5)
    b.add(a, 4, source=TokenSource.NGRAM, score=0.3)
    b.add(0, 5, source=TokenSource.NGRAM, score=0.2)
    return b.build()


def test_builder_structure():
    t = build_example()
    assert t.token_ids.tolist() == [100, 1, 2, 3, 4, 5]
    assert t.parents.tolist() == [-1, 0, 1, 2, 1, 0]
    assert t.depth.tolist() == [0, 1, 2, 3, 2, 1]
    assert t.children(0) == [1, 5]
    assert t.children(1) == [2, 4]
    assert t.leaves().tolist() == [3, 4, 5]
    assert not t.is_chain()
    assert t.path_to(3) == [1, 2, 3]


def test_builder_merges_deterministic_duplicates_but_not_stochastic():
    b = TreeBuilder(7)
    x = b.add(0, 9, source=TokenSource.NGRAM, score=0.2)
    y = b.add(0, 9, source=TokenSource.NGRAM, score=0.6)
    assert x == y and b.score[x] == pytest.approx(0.6)
    s1 = b.add(0, 9, source=TokenSource.DRAFT_MODEL, draft_prob=0.5)
    s2 = b.add(0, 9, source=TokenSource.DRAFT_MODEL, draft_prob=0.5)
    assert s1 != s2 != x


def test_ancestors_matrix():
    t = build_example()
    a = t.ancestors_matrix()
    assert a[3].tolist() == [True, True, True, True, False, False]
    assert a[5].tolist() == [True, False, False, False, False, True]
    assert a.diagonal().all()


def test_layout_tree_seq_sets():
    t = build_example()
    lay = layout_tree(t, n_past=10)
    assert lay.pos.tolist() == [10, 11, 12, 13, 12, 11]
    assert not lay.uses_seq0
    # leaves 3, 4, 5 -> seqs 1, 2, 3
    assert lay.leaf_nodes.tolist() == [3, 4, 5]
    sets = [sorted(lay.seq_sets[i, : lay.n_seq[i]].tolist()) for i in range(t.n_nodes)]
    assert sets == [[1, 2, 3], [1, 2], [1], [1], [2], [3]]
    # node_leaf_seq is a leaf under the node
    for i in range(t.n_nodes):
        assert lay.node_leaf_seq[i] in sets[i]


def test_layout_chain_uses_seq0():
    t = TokenTree.chain(5, [6, 7, 8])
    lay = layout_tree(t, 3)
    assert lay.uses_seq0 and lay.seq_sets.ravel().tolist() == [0, 0, 0, 0]
    assert lay.pos.tolist() == [3, 4, 5, 6]


def test_subtree_and_best_subtree():
    t = build_example()
    with pytest.raises(ValueError):
        t.subtree(np.array([True, False, True, False, False, False]))
    s = t.best_subtree(3)
    assert s.token_ids.tolist() == [100, 1, 2]
    assert s.parents.tolist() == [-1, 0, 1]
    s4 = t.best_subtree(5)
    assert sorted(s4.token_ids.tolist()) == [1, 2, 3, 4, 100]
    # parents always precede children
    assert all(s4.parents[i] < i for i in range(1, s4.n_nodes))


def test_best_subtree_is_closed_under_parents_for_random_trees(rng):
    for _ in range(50):
        b = TreeBuilder(0)
        for i in range(1, 40):
            p = int(rng.integers(0, len(b)))
            b.add(p, 1000 + i, source=TokenSource.NGRAM, score=b.score[p] * float(rng.uniform(0.1, 1.0)))
        t = b.build()
        for n in (1, 2, 5, 17, 39, 40):
            s = t.best_subtree(n)
            assert s.n_nodes == min(n, t.n_nodes)
            assert all(0 <= s.parents[i] < i for i in range(1, s.n_nodes))
            # it holds the n best scores
            assert np.isclose(np.sort(s.score)[::-1], np.sort(t.score)[::-1][: s.n_nodes]).all()


# -- the sibling-order invariant (sampled siblings stay in draw order) ----------------------------


def _sampled_tree(scores):
    """Root with sampled children of the given scores (draws 0, 1, ...), a deterministic child
    of score 0.45, and a sampled grandchild under each sampled child."""
    from localspec.tree import TreeBuilder

    b = TreeBuilder(0)
    b.set_draft_dist(0, np.full(8, 0.125))
    kids = [b.add(0, 1 + i, source=TokenSource.DRAFT_MODEL, score=s, draft_prob=0.125) for i, s in enumerate(scores)]
    b.add(0, 7, source=TokenSource.NGRAM, score=0.45)
    for c, s in zip(kids, scores):
        b.set_draft_dist(c, np.full(8, 0.125))
        b.add(c, 5, source=TokenSource.DRAFT_MODEL, score=s * 0.5, draft_prob=0.125)
    return b.build()


def test_best_first_dfs_keeps_sampled_siblings_in_draw_order():
    """Even when a drafter gave sampled siblings value-dependent scores, the renumbered tree
    tries them in draw order (the deterministic child keeps its best-first place)."""
    from localspec.verify import check_sampled_siblings

    t = _sampled_tree([0.2, 0.9, 0.5])
    r = t.best_first_dfs()
    kids = r.children(0)
    draws = r.draws()
    assert [int(draws[c]) for c in kids if r.is_stochastic(c)] == [0, 1, 2]
    assert [bool(r.is_stochastic(c)) for c in kids] == [True, True, False, True]  # slots of the sort
    check_sampled_siblings(r)
    # each sampled child keeps its own subtree
    for c in kids:
        if r.is_stochastic(c):
            (g,) = r.children(c)
            assert r.score[g] == r.score[c] * 0.5


def test_best_subtree_keeps_a_prefix_of_the_draws():
    from localspec.verify import check_sampled_siblings

    t = _sampled_tree([0.2, 0.9, 0.5])
    s = t.best_subtree(4)  # root + 3 nodes: the best eligible ones
    draws = s.draws()
    got = [int(draws[c]) for c in s.children(0) if s.is_stochastic(c)]
    assert got == [0, 1]  # draw 1 (score 0.9) only once draw 0 (score 0.2) is kept
    assert sorted(s.token_ids[1:].tolist()) == [1, 2, 7]
    check_sampled_siblings(s)
    # with the equal scores drafters give sampled siblings, it is the plain top-n by score
    eq = _sampled_tree([0.5, 0.5, 0.5])
    s2 = eq.best_subtree(5)
    assert sorted(s2.token_ids[1:].tolist()) == [1, 2, 3, 7] and s2.n_nodes == 5


def test_reordering_sampled_siblings_is_refused():
    from localspec.verify import check_sampled_siblings

    t = _sampled_tree([0.5, 0.5, 0.5])
    bad = t.reordered(np.array([0, 3, 2, 1, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="draws \\[2, 1, 0\\]"):
        check_sampled_siblings(bad)
    dropped = t.subtree(np.array([True, False, True, True, True, False, True, True]))
    with pytest.raises(ValueError, match="sibling-order invariant"):
        check_sampled_siblings(dropped)


def test_merge_trees_carries_the_draw_order():
    from localspec.drafters.auto import merge_trees
    from localspec.verify import check_sampled_siblings

    t = _sampled_tree([0.5, 0.5, 0.5])
    bad = t.reordered(np.array([0, 3, 2, 1, 4, 5, 6, 7]))
    ngram = TokenTree.chain(0, [7, 6])
    with pytest.raises(ValueError, match="sibling-order invariant"):
        check_sampled_siblings(merge_trees(bad, ngram))  # not laundered by re-adding in index order
    good = merge_trees(t, ngram)
    check_sampled_siblings(good)
    assert [int(good.draws()[c]) for c in good.children(0) if good.is_stochastic(c)] == [0, 1, 2]
