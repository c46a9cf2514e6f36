"""Lossless verification.

* An exact-enumeration oracle (``tests/oracle.py``): on a 4-token vocabulary, the law of one
  step's emitted tokens is computed exactly - every draft draw, every accept / reject
  decision, every recovered / bonus token - from the implementation's own walk, and compared
  with the target's joint law to 1e-12, for chains, trees, sampled (i.i.d.) children,
  point-mass children and mixes. The C walk is compared with that reference seed by seed on
  every tree of the enumeration.
* Chi-square tests of the walk that runs in the engine (C when built) and of the reference,
  on flat target rows with point masses on the target's top tokens, with minimum-count guards.
* Mutations of the rule that these tests must catch (asserted below): no renormalisation
  after a rejected point mass, none after a rejected sampled child, sampled siblings tried
  by draft probability.
* Greedy tests that cannot pass by accident (adversarial trees still give the argmax)."""

import dataclasses
import functools

import numpy as np
import pytest

import oracle
from conftest import FakeModel, chisquare_pvalue
from localspec import native
from localspec.request_state import RequestState
from localspec.sampling import SamplingParams
from localspec.tree import TokenSource, TreeBuilder
from localspec.verify import check_sampled_siblings, verify, verify_greedy, verify_rejection

V = 8
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
REJECTION = SamplingParams(**{**SAMPLED.__dict__, "verify": "rejection"})
needs_native = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels not built: {native.LOAD_ERROR}")


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def make_rows(rng, n):
    return (rng.standard_normal((n, V)) * 1.5).astype(np.float32)


def run(tree, rows, params, seed, fn=verify):
    req = RequestState(params.with_seed(seed), FakeModel(V, eog=()), [])
    cur = req.cursor(10)
    return fn(tree, rows, cur)


# -- a small synthetic world: target and draft distributions that depend on the context -------

VS = 4  # vocabulary of the exact / chi-square tests


@functools.lru_cache(maxsize=None)
def target_logits(prefix: tuple) -> np.ndarray:
    """[VS] float32 target logits after the root + ``prefix``: flat rows (no token above ~0.6)."""
    g = np.random.default_rng([7, len(prefix), *prefix])
    return (g.standard_normal(VS) * 0.7).astype(np.float32)


def _cursor(params=REJECTION, seed=0, native_walk=False):
    req = RequestState(params.with_seed(seed), FakeModel(VS, eog=()), [])
    req.processor.use_native = bool(native_walk)
    return req.cursor(10)


@functools.lru_cache(maxsize=None)
def target_cond(prefix: tuple) -> np.ndarray:
    """The processed target distribution after ``prefix`` (what plain decoding samples)."""
    return _cursor().target_probs(target_logits(prefix))


@functools.lru_cache(maxsize=None)
def draft_dist(prefix: tuple, kind: str = "other") -> np.ndarray:
    """[VS] float64 draft distribution after ``prefix``: a different one ("other", one token
    impossible), or exactly the target's ("target": every rejection has probability 0)."""
    if kind == "target":
        return target_cond(prefix)
    g = np.random.default_rng([11, len(prefix), *prefix])
    q = softmax(g.standard_normal(VS) * 0.9)
    q[int(g.integers(VS))] = 0.0
    return q / q.sum()


@functools.lru_cache(maxsize=None)
def top_tokens(prefix: tuple, k: int) -> list[int]:
    return [int(t) for t in np.argsort(-target_cond(prefix), kind="stable")[:k]]


class RandomChooser:
    """The ``oracle.Chooser`` interface with real random draws (for sampled tests)."""

    def __init__(self, rng) -> None:
        self.rng = rng

    def categorical(self, probs) -> int:
        p = np.asarray(probs, dtype=np.float64)
        return int(self.rng.choice(p.size, p=p / p.sum()))


class Gen:
    """Builds a random draft tree through a chooser; nodes know their token path."""

    def __init__(self, chooser) -> None:
        self.ch = chooser
        self.b = TreeBuilder(0)
        self.path = {0: ()}

    def point(self, parent: int, token: int) -> int:
        c = self.b.add(parent, int(token), source=TokenSource.NGRAM)
        self.path[c] = self.path[parent] + (int(token),)
        return c

    def sampled(self, parent: int, k: int, kind: str = "other") -> list[int]:
        q = draft_dist(self.path[parent], kind)
        self.b.set_draft_dist(parent, q)
        out = []
        for _ in range(k):
            x = self.ch.categorical(q)
            c = self.b.add(parent, x, source=TokenSource.DRAFT_MODEL, draft_prob=float(q[x]))
            self.path[c] = self.path[parent] + (x,)
            out.append(c)
        return out

    def top(self, parent: int, rank: int = 0) -> int:
        return self.point(parent, top_tokens(self.path[parent], rank + 1)[rank])

    def done(self):
        tree = self.b.build()
        paths = [self.path[i] for i in range(tree.n_nodes)]
        return tree, np.stack([target_logits(p) for p in paths])


def chain_sampled(g):
    """Root -> x1 -> x2 -> x3, each drawn from the draft distribution after its path."""
    node = 0
    for _ in range(3):
        node = g.sampled(node, 1)[0]


def tree_sampled(g):
    """Three i.i.d. children of the root (three residual rounds); the first with two i.i.d.
    children, the second with one."""
    s = g.sampled(0, 3)
    g.sampled(s[0], 2)
    g.sampled(s[1], 1)


def chain_points(g):
    """n-gram chain on the target's top tokens, then its second-best token."""
    a = g.top(0)
    b = g.top(a, 1)
    g.top(b)


def tree_points(g):
    """Point masses on the target's top-3 tokens of the root, each with two point-mass
    children (the top-2 tokens after it)."""
    for r in range(3):
        c = g.top(0, r)
        g.top(c, 0)
        g.top(c, 1)


def mixed_points_first(g):
    """Point mass on the top token, then two i.i.d. children, then a point mass on the second
    token; below the first sampled child a point mass then a sampled child."""
    a = g.top(0)
    s = g.sampled(0, 2)
    g.top(0, 1)
    g.top(a)
    g.top(s[0])
    g.sampled(s[0], 1)


def mixed_sampled_first(g):
    """Two i.i.d. children, then point masses on the top-2 tokens (one may equal a sampled
    token); each sampled child with one sampled child and a point mass after it."""
    s = g.sampled(0, 2)
    g.top(0, 0)
    g.top(0, 1)
    for c in s:
        g.sampled(c, 1)
        g.top(c)


def draft_equals_target(g):
    """Drafts from exactly the target's distribution (rejections of probability 0), then a
    point mass: residuals that vanish must not break the walk."""
    s = g.sampled(0, 2, kind="target")
    g.top(0)
    g.sampled(s[0], 1, kind="target")


SCENARIOS = {
    "chain-sampled": chain_sampled,
    "tree-sampled": tree_sampled,
    "chain-points": chain_points,
    "tree-points": tree_points,
    "mixed-points-first": mixed_points_first,
    "mixed-sampled-first": mixed_sampled_first,
    "draft-equals-target": draft_equals_target,
}


def build(scenario, chooser):
    g = Gen(chooser)
    SCENARIOS[scenario](g)
    return g.done()


def exact_step_law(scenario, fn=verify_rejection):
    """Exact law of one step's emitted tokens: draft draws and verification enumerated."""

    def one(ch):
        tree, rows = build(scenario, ch)
        return tuple(fn(tree, rows, oracle.branching_cursor(_cursor(), ch)).tokens)

    with oracle.enumerated_draws():
        return oracle.enumerate_law(one)


def law_error(scenario, fn=verify_rejection) -> float:
    """max |law of the step's tokens extended by plain decoding - target law| (m = depth + 1)."""
    step = exact_step_law(scenario, fn)
    assert abs(sum(step.values()) - 1.0) < 1e-12  # every branch enumerated
    m = max(len(t) for t in step)
    return oracle.max_abs_diff(oracle.extended_law(step, target_cond, m), oracle.target_law(target_cond, m))


# -- exact enumeration ------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_exact_law_of_a_rejection_step_is_the_targets(scenario):
    assert law_error(scenario) < 1e-12


def test_the_oracle_sees_every_branch():
    """The enumeration is not vacuous: a depth-3 sampled chain has 3 * 3 * 3 draft outcomes
    (one impossible token per draft row), and the step's law puts mass on tokens of every
    depth (some steps accept the whole chain, some reject at once)."""
    trees = oracle.enumerate_law(lambda ch: tuple(build("chain-sampled", ch)[0].token_ids))
    assert len(trees) == 27 and abs(sum(trees.values()) - 1) < 1e-12
    step = exact_step_law("chain-sampled")
    assert {len(t) for t in step} == {1, 2, 3, 4}


NO_RENORM_POINT = oracle.mutant(verify_rejection, oracle.MUTATION_NO_RENORM_POINT_MASS)
NO_RENORM_SAMPLED = oracle.mutant(verify_rejection, oracle.MUTATION_NO_RENORM_STOCHASTIC)


@pytest.mark.parametrize(
    "mutated, scenarios",
    [
        (NO_RENORM_POINT, ["tree-points", "mixed-points-first"]),
        (NO_RENORM_SAMPLED, ["tree-sampled", "mixed-points-first", "mixed-sampled-first"]),
    ],
    ids=["no-renorm-after-point-mass", "no-renorm-after-sampled-rejection"],
)
def test_the_oracle_catches_the_mutations(mutated, scenarios):
    """Each mutation of the rule misses the target law by far more than rounding (~1e-16;
    measured misses 0.008-0.04). Where a mutation cannot matter (no sibling after the
    rejected node, or rejections of probability 0) it has the exact law, as it should."""
    for sc in scenarios:
        assert law_error(sc, mutated) > 1e-3, sc
    assert law_error("chain-sampled", mutated) < 1e-12


def sorted_by_draft_prob(tree, rows, cursor):
    """The walk trying sampled siblings in descending draft probability (a plausible
    "optimisation" that biases rejection sampling), bypassing the invariant check."""
    # parents first: a BFS over the sorted children keeps the topological order
    bfs, queue = [0], [0]
    while queue:
        node = queue.pop(0)
        ks = sorted(tree.children(node), key=lambda c: -float(tree.draft_probs[c]) if tree.is_stochastic(c) else 0.0)
        bfs.extend(ks)
        queue.extend(ks)
    t = tree.reordered(np.asarray(bfs))
    t = dataclasses.replace(t, draw_index=None)  # forget the draws: the check cannot see it
    return verify_rejection(t, rows[np.asarray(bfs)], cursor)


def test_sorting_sampled_siblings_by_draft_probability_is_caught():
    """The oracle sees the bias of trying the most probable draw first, and ``verify``
    refuses a tree whose sampled siblings were reordered (the draw order travels with it)."""
    assert law_error("tree-sampled", sorted_by_draft_prob) > 1e-3
    g = Gen(RandomChooser(np.random.default_rng(3)))
    kids = g.sampled(0, 3)
    tree, rows = g.done()
    order = [0] + sorted(kids, key=lambda c: (-float(tree.draft_probs[c]), c))
    if order == [0, *kids]:  # already in that order: reverse instead (still value-dependent)
        order = [0, *reversed(kids)]
    bad = tree.reordered(np.asarray(order))
    with pytest.raises(ValueError, match="sibling-order invariant"):
        check_sampled_siblings(bad)
    for native_walk in (False, True) if native.AVAILABLE else (False,):
        with pytest.raises(ValueError, match="sibling-order invariant"):
            verify(bad, rows[np.asarray(order)], _cursor(native_walk=native_walk))


@needs_native
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_c_walk_equals_the_reference_on_every_enumerated_tree(scenario):
    """Every draft tree of the enumeration (and its probability > 0), 12 seeds each: the C
    walk accepts the same path and emits the same tokens as the exactly checked reference."""
    trees = []
    oracle.enumerate_law(lambda ch: trees.append(build(scenario, ch)) or len(trees))
    n_diff_outcomes = 0
    for tree, rows in trees:
        outs = set()
        for seed in range(12):
            ref = verify_rejection(tree, rows, _cursor(seed=seed))
            c = verify(tree, rows, _cursor(seed=seed, native_walk=True))
            assert (c.path, c.tokens) == (ref.path, ref.tokens)
            outs.add(tuple(ref.tokens))
        n_diff_outcomes += len(outs) > 1
    assert n_diff_outcomes > len(trees) // 2  # the seeds exercise different branches


# -- chi-square on sampled steps --------------------------------------------------------------


def sampled_pairs(scenario, n, fn, seed0=0, native_walk=None, mode="rejection"):
    """Counts of the first two tokens of ``n`` sampled steps (trees and verification seeded
    per trial); a step that emitted one token is followed by a plain target draw."""
    rng = np.random.default_rng(seed0)
    params = SamplingParams(**{**SAMPLED.__dict__, "verify": mode})
    counts = np.zeros((VS, VS))
    depth_hits = np.zeros(8, dtype=int)
    for trial in range(n):
        tree, rows = build(scenario, RandomChooser(rng))
        cur = _cursor(params, seed=seed0 * 100003 + trial, native_walk=native_walk)
        toks = fn(tree, rows, cur).tokens
        depth_hits[len(toks) - 1] += 1
        if len(toks) == 1:
            toks = [toks[0], int(rng.choice(VS, p=target_cond((toks[0],))))]
        counts[toks[0], toks[1]] += 1
    return counts.ravel(), depth_hits


def expected_pairs():
    law = oracle.target_law(target_cond, 2)
    return np.array([law.get((a, b), 0.0) for a in range(VS) for b in range(VS)])


N_CHI = 3000


@pytest.mark.parametrize(
    "scenario, mode",
    [("tree-sampled", "rejection"), ("mixed-points-first", "rejection"), ("mixed-sampled-first", "rejection"),
     ("tree-points", "rejection"), ("chain-sampled", "gumbel"), ("mixed-sampled-first", "gumbel")],
)  # fmt: skip
def test_sampled_steps_follow_the_target_joint_law(scenario, mode):
    """The walk the engine runs (C when built): the first two tokens of sampled steps follow
    the target's joint law. Guards: every one of the 16 bins expects >= 30 counts, and at
    least a fifth of the steps accepted a draft (the second token then comes from the walk)."""
    exp = expected_pairs()
    assert exp.min() * N_CHI >= 30
    counts, hits = sampled_pairs(scenario, N_CHI, verify, seed0=1)
    assert hits[1:].sum() >= N_CHI // 5
    assert chisquare_pvalue(counts, exp) > 1e-3


@pytest.mark.parametrize(
    "mutated, scenario",
    [(NO_RENORM_POINT, "mixed-points-first"), (NO_RENORM_SAMPLED, "mixed-sampled-first")],
    ids=["no-renorm-after-point-mass", "no-renorm-after-sampled-rejection"],
)
def test_the_chi_square_test_catches_the_mutations(mutated, scenario):
    """Same samples size and threshold as above: each mutated rule fails it, and the correct
    reference on the same draws passes."""
    exp = expected_pairs()
    counts, _ = sampled_pairs(scenario, N_CHI, mutated, seed0=2, native_walk=False)
    assert chisquare_pvalue(counts, exp) < 1e-6
    counts, _ = sampled_pairs(scenario, N_CHI, verify_rejection, seed0=2, native_walk=False)
    assert chisquare_pvalue(counts, exp) > 1e-3


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
            req = RequestState(params.with_seed(seed), FakeModel(V, eog=()), [])
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
