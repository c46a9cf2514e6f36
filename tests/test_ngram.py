from localspec.drafters.ngram import NgramDrafter
from localspec.drafters.ngram_index import NgramIndex
from localspec.tree import TokenSource


def brute_starts(tokens, n):
    key = tokens[-n:]
    return [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == key][::-1]


def test_index_lookup_matches_brute_force(rng):
    toks = (rng.integers(0, 6, 400)).tolist()
    idx = NgramIndex(max_n=4)
    for i, t in enumerate(toks):
        idx.append(t)
        if i < 5:
            continue
        m = idx.lookup(min_n=1, max_occurrences=1000)
        hist = toks[: i + 1]
        want_n = next((n for n in range(4, 0, -1) if brute_starts(hist, n)), None)
        if want_n is None:
            assert m is None
        else:
            assert m.order == want_n
            assert m.starts == brute_starts(hist, want_n)


def test_truncate_and_reset_equal_fresh_index(rng):
    toks = rng.integers(0, 5, 300).tolist()
    a = NgramIndex(3)
    a.extend(toks)
    a.truncate(120)
    b = NgramIndex(3)
    b.extend(toks[:120])
    assert a.tokens == b.tokens and a._maps == b._maps
    other = toks[:80] + rng.integers(0, 5, 50).tolist()
    a.reset(other)
    c = NgramIndex(3)
    c.extend(other)
    assert a._maps == c._maps


def test_drafter_builds_a_trie_of_continuations():
    d = NgramDrafter(max_n=3, max_depth=4)
    # "1 2 3" followed by 4 5 and, later, by 7 8
    d.begin([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 9, 1, 2, 3])
    tree = d.propose(max_depth=3, max_nodes=16)
    assert tree.token_ids[0] == 3
    kids = {int(tree.token_ids[c]): c for c in tree.children(0)}
    assert set(kids) == {4, 7}
    assert [int(tree.token_ids[c]) for c in tree.children(kids[7])] == [8]
    assert all(tree.source[1:] == TokenSource.NGRAM)
    # scores decrease along paths
    for i in range(1, tree.n_nodes):
        assert tree.score[i] <= tree.score[tree.parents[i]] + 1e-12
    assert tree.max_depth() <= 3


def test_drafter_learns_from_verification():
    d = NgramDrafter(max_n=2, max_depth=4)
    hist = [5, 6, 7, 8] * 3
    d.begin(hist)
    before = d.propose(4, 16).score[1]
    for _ in range(20):
        t = d.propose(4, 16)
        d.observe(t, [1])  # the target emitted a token no draft proposed
    after = d.propose(4, 16).score[1]
    assert after < 0.5 * before


def test_empty_history_drafts_nothing():
    d = NgramDrafter()
    d.begin([42])
    assert d.propose(8, 16).n_nodes == 1
    d.accept([43, 44])
    assert d.propose(0, 16).n_nodes == 1
