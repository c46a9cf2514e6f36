"""The cheap EAGLE-3 head runtime: draft-vocabulary rows ranked in C, sparse draft
distributions verified exactly like dense ones, one llama.cpp call per tree level, no head
call on a step whose plan drafts nothing, and output identical to plain decoding."""

import math

import numpy as np
import pytest

from conftest import FakeModel, frozen_cost_model
from helpers import PROSE, assert_greedy_is_target_argmax, assert_same_as_plain
from localspec import Engine, SamplingParams, native
from localspec.costmodel import CostModel
from localspec.drafters.tree_expand import DraftChildSelector, _top_k_children
from localspec.request_state import RequestState
from localspec.tree import SparseDist, TokenSource, TreeBuilder
from localspec.verify import verify

needs_native = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels not built: {native.LOAD_ERROR}")
GREEDY = SamplingParams.greedy()


# -- ranking at the draft-vocabulary width -----------------------------------------------------


@needs_native
def test_top_k_kernel_matches_the_reference(rng):
    """``native.rows.top_k`` (+ logsumexp) gives ``_top_k_children``'s numpy answer: same ids
    in the same order (ties: lower id), same confidences; -inf never chosen."""
    for trial in range(60):
        n = int(rng.integers(1, 9000))
        row = (rng.standard_normal(n) * 3).astype(np.float32)
        row[rng.random(n) < rng.uniform(0, 0.9)] = -np.inf
        if n > 10:
            row[rng.integers(0, n, 5)] = np.float32(row[np.isfinite(row)].max(initial=0.0))  # ties
        for k in (1, 2, 4, 8, n + 3):
            with native.use(True):
                a = _top_k_children(row, k)
            with native.use(False):
                b = _top_k_children(row, k)
            assert a.tokens.tolist() == b.tokens.tolist()
            np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-6, atol=0)  # the reference exps in float32
            assert np.all(np.isfinite(row[a.tokens]))


SAMPLER_CASES = [
    SamplingParams.greedy(seed=3),
    SamplingParams.greedy(seed=3, logit_bias={11: 4.0, 12: -math.inf}),
    SamplingParams(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0, seed=4),  # seeded Gumbel
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, verify="rejection"),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=6, verify="rejection", logit_bias={11: 2.0}),
]


@pytest.mark.parametrize("params", SAMPLER_CASES, ids=lambda p: repr(p)[15:80])
def test_draft_vocabulary_rows_give_the_children_of_target_wide_rows(params, rng):
    """Ranking [n_draft] rows and mapping the ids back through ``d2t`` chooses exactly the
    children (tokens, confidences, draft probabilities, distribution) that ranking the
    target-wide row with -inf outside the draft vocabulary chooses - for greedy, seeded
    Gumbel and sampled children, with logit bias on ids inside and outside the draft vocab."""
    V, D = 3000, 400
    d2t = np.sort(rng.choice(np.arange(V), D, replace=False)).astype(np.int64)
    d2t[0], d2t[1] = 11, 12  # biased ids inside the draft vocabulary
    d2t = np.unique(d2t)
    suppress = [int(d2t[5]), 2999 if 2999 not in d2t else 2998]
    narrow = DraftChildSelector(params, V, suppress, d2t=d2t)
    wide = DraftChildSelector(params, V, suppress)
    for trial in range(20):
        rows = (rng.standard_normal(d2t.size) * 2.5).astype(np.float32)
        full = np.full(V, -np.inf, dtype=np.float32)
        full[d2t] = rows
        for k in (1, 3, 6):
            a = narrow.children(rows, pos=40 + trial, k=k, counter=trial)
            b = wide.children(full, pos=40 + trial, k=k, counter=trial)
            assert a.tokens.tolist() == b.tokens.tolist()
            np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-6)
            if b.draft_probs is not None:
                np.testing.assert_allclose(a.draft_probs, b.draft_probs, rtol=1e-6)
                np.testing.assert_allclose(a.dist.dense(V), b.dist.dense(V), rtol=1e-6, atol=1e-12)
                assert set(a.dist.ids.tolist()) <= set(d2t.tolist())


# -- sparse draft distributions ------------------------------------------------------------------


def random_sparse_tree(rng, V, n_nodes):
    """A random tree whose stochastic children come from sparse distributions (a random
    support, as a draft vocabulary or a top-k cut gives), plus deterministic children."""
    b = TreeBuilder(int(rng.integers(V)))
    while len(b) < n_nodes:
        p = int(rng.integers(0, len(b)))
        if p not in b.draft_dists and rng.random() < 0.5:
            support = np.sort(rng.choice(V, int(rng.integers(1, V + 1)), replace=False))
            q = rng.dirichlet(np.full(support.size, 0.4))
            b.set_draft_dist(p, SparseDist(support, q))
            for _ in range(int(rng.integers(1, 4))):
                j = int(rng.choice(support.size, p=q))
                b.add(p, int(support[j]), source=TokenSource.EAGLE3, draft_prob=float(q[j]))
        else:
            b.add(p, int(rng.integers(V)), source=TokenSource.NGRAM)
    return b.build()


def densified(tree, V):
    t = tree._take(np.arange(tree.n_nodes))
    t.draft_dists = {p: d.dense(V) for p, d in tree.draft_dists.items()}
    return t


@pytest.mark.parametrize("use_native", [False, True], ids=["numpy", "C"])
def test_sparse_draft_distributions_verify_exactly_like_dense_ones(rng, use_native):
    """Rejection sampling with ``SparseDist`` (numpy reference and C walk) takes the same
    path and emits the same tokens as with the same distributions stored dense, over many
    random trees where every branch is taken (ratio tests, residual updates, point masses)."""
    if use_native and not native.AVAILABLE:
        pytest.skip("native kernels not built")
    V = 10
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, verify="rejection")
    model = FakeModel(V, eog=())
    n_deep = 0
    for trial in range(300):
        tree = random_sparse_tree(rng, V, int(rng.integers(2, 14)))
        logits = (rng.standard_normal((tree.n_nodes, V)) * 2.0).astype(np.float32)
        for i in range(1, tree.n_nodes):
            logits[int(tree.parents[i]), int(tree.token_ids[i])] += rng.uniform(0, 3)
        out = []
        for t in (tree, densified(tree, V)):
            with native.use(use_native):
                res = verify(t, logits, RequestState(params.with_seed(trial), model, [1, 2]).cursor(7))
            out.append((res.path, res.tokens))
        assert out[0] == out[1]
        n_deep += len(out[0][0]) >= 2
    assert n_deep > 20  # the walks went deep enough to exercise residual updates


def test_sparse_dist_rejects_bad_input():
    with pytest.raises(ValueError, match="ascending"):
        SparseDist(np.array([3, 1]), np.array([0.5, 0.5]))
    d = SparseDist.from_unsorted([9, 2, 5], [0.2, 0.5, 0.3])
    assert d.ids.tolist() == [2, 5, 9] and d.prob(9) == pytest.approx(0.2) and d.prob(4) == 0.0


# -- one llama.cpp call per level, none when the plan drafts nothing -----------------------------


def count_head_calls(d):
    """Wrap the extend of ``d``'s draft context (``DraftHub.extend_many``, which the step
    calls): per drafted step, (head calls made, levels grown). Head calls: llama.cpp calls on
    the head's context, or (host runtime) ``run_level`` calls; ``log.calls()`` counts all."""
    log = HeadCalls()
    hub = d.hub
    inner = hub.extend_many
    if d.host:
        counter = [0]
        levels = hub.decode_levels

        def decode_levels(parts):
            counter[0] += 1
            return levels(parts)

        hub.decode_levels = decode_levels
        log.calls = lambda: counter[0]
    else:
        log.calls = lambda: d.ctx.n_calls

    def extend_many(drafters, shapes):
        c0 = log.calls()
        trees = inner(drafters, shapes)
        log.append((log.calls() - c0, len(d.stats.last_level_us)))
        return trees

    hub.extend_many = extend_many
    return log


class HeadCalls(list):
    calls = None


@pytest.mark.parametrize("runtime", ["llama", "host"])
def test_steps_that_draft_nothing_make_no_head_call(model, random_head_path, runtime):
    """With a cost table on which verifying drafts never pays, the plan skips the head on
    most steps: those steps make no llama.cpp call on the head's context at all (its entries
    are caught up in the next drafted step's level-0 call), every drafted step makes exactly
    one call per level (the catch-up folded into level 0), and the output stays the target's."""
    from localspec.drafters.eagle3 import Eagle3Drafter

    t1 = 12000.0
    steep = CostModel({b: t1 * b * 1.5 if b > 1 else t1 for b in (1, 2, 3, 4, 8, 16)})
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=steep)
    try:
        prompt = e.tokenize(PROSE * 2)
        ref = e.generate(prompt, max_tokens=40, sampling=GREEDY, speculative=False)
        d = Eagle3Drafter(random_head_path, runtime=runtime)
        e.set_drafter(d)
        assert d.runtime == runtime
        # retry the head after short gaps: probes may take 4x the measured step time (the budget
        # rule is tests/test_policy.py's; here a loaded machine must not starve the probes: with
        # a budget of 1x, a probe priced on the steep table (~1.5 t1 per node) waited ~25 steps,
        # and 40 tokens saw one probe when another test loaded the CPU)
        e.policy.explore_every, e.policy.explore_budget = 4, 4.0
        log = count_head_calls(d)
        e.reset()
        calls0 = log.calls()
        res = e.generate(prompt, max_tokens=40, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        n_steps = res.stats.n_steps
        assert 2 <= len(log) < n_steps // 2  # the head ran on a few steps only
        assert log.calls() - calls0 == sum(c for c, _ in log)  # no head call outside a drafted step
        # one call per level, the catch-up in level 0 -- after the prompt too: the head keeps
        # only the last CONTEXT_WINDOW (16) entries, which fit in the level-0 call
        assert all(c == levels for c, levels in log)
        # the head KV never runs ahead of the history, and every position it lacks is pending
        assert d.kv_len <= len(d.history) - 1 <= d.n_target_features
        d.check_cache()
    finally:
        e.close()


@pytest.mark.parametrize("runtime", ["llama", "host"])
@pytest.mark.parametrize("window", [16, 40, None], ids=["default", "40", "whole"])
def test_the_heads_catch_up_keeps_its_context_window(model, random_head_path, window, runtime):
    """After a long prompt the head writes entries for the last ``context_window`` positions
    only (each entry costs a full logits row in llama.cpp's eagle3 graph); ``None`` keeps
    every position (a long catch-up then needs a call without outputs first). The output is
    the target's either way, and the cache stays consistent when a later request shares
    only part of the history."""
    from localspec.drafters.eagle3 import CATCH_UP_OUTPUTS, CONTEXT_WINDOW, Eagle3Drafter
    from localspec.policy import TreeShape

    assert CONTEXT_WINDOW == 16
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    try:
        prompt = e.tokenize(PROSE * 2)
        assert len(prompt) > 41  # longer than every window below
        ref = e.generate(prompt, max_tokens=12, sampling=GREEDY, speculative=False)
        options = {} if window == 16 else {"context_window": window}  # 16: the default, not passed
        d = Eagle3Drafter(random_head_path, shape=TreeShape(3, 1, 4, 0.0), runtime=runtime, **options)
        e.set_drafter(d)
        e.adaptive = False
        log = count_head_calls(d)
        e.reset()
        res = e.generate(prompt, max_tokens=12, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        first_calls, first_levels = log[0]
        if runtime == "host":  # one call per level: the catch-up's entries only add keys and values
            assert d.kv_first == (0 if window is None else len(prompt) - 1 - window) and first_calls == first_levels
        elif window is None:
            assert d.kv_first == 0 and first_calls == first_levels + 1
        else:
            assert d.kv_first == len(prompt) - 1 - window and first_calls == first_levels + (window > CATCH_UP_OUTPUTS)
        assert d.kv_len <= len(d.history) - 1 <= d.n_target_features
        d.check_cache()
        # a request that shares only the first part of the prompt: the head's window is gone
        short = prompt[: len(prompt) // 2]
        ref2 = e.generate(short, max_tokens=8, sampling=GREEDY, speculative=False)
        res2 = e.generate(short, max_tokens=8, sampling=GREEDY)
        assert_same_as_plain(e, short, ref2.token_ids, res2.token_ids)
        d.check_cache()
    finally:
        e.close()
    with pytest.raises(ValueError, match="context_window"):
        Eagle3Drafter(random_head_path, context_window=0)


def test_head_cost_per_level_enters_the_cost_model(model, random_head_path):
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    try:
        from localspec.drafters.eagle3 import Eagle3Drafter
        from localspec.policy import TreeShape

        e.set_drafter(Eagle3Drafter(random_head_path, shape=TreeShape(3, 2, 7, 0.0)))
        assert e.cost_model.t_draft_us(3) is None  # nothing measured for this drafter yet
        e.generate(e.tokenize(PROSE), max_tokens=12, sampling=GREEDY)
        levels = e.cost_model.draft_level_us
        assert set(levels) == {0, 1, 2} and all(t > 0 for t in levels.values())
        assert e.cost_model.t_draft_us(3) == pytest.approx(sum(levels.values()))
        e.set_drafter(None)
        assert e.cost_model.t_draft_us(3) is None  # reset with the drafter
    finally:
        e.close()


# -- lossless over long generations ---------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["eagle3", "auto"])
def test_shipped_head_greedy_equals_plain_over_300_tokens_of_long_context(model, drafter):
    """Temperature 0, a prompt of 820 tokens (past Gemma 3's 512-token window), 300 generated
    tokens (to 1,120 of context): the eagle3 and auto drafters with the shipped head emit
    exactly plain decoding's tokens where the exact kernels are on (CPU backend), else the
    same up to near-ties (``assert_greedy_is_target_argmax``). The head keeps entries for the
    last ``CONTEXT_WINDOW`` positions only, so 300 tokens drop and re-fill its window many
    times over."""
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    try:
        prompt = e.tokenize(PROSE * 40)[:820]
        e.set_drafter(drafter, eagle=None) if drafter == "eagle3" else e.set_drafter(drafter, eagle=_shipped(model))
        e.reset()
        e.adaptive = drafter == "eagle3"  # auto: the policy would leave this text to the n-grams
        # the head rarely pays on this cost table: probe it often, so that its drafts are verified
        e.policy.explore_every, e.policy.explore_budget = 4, 0.25
        res = e.generate(prompt, max_tokens=300, sampling=GREEDY)
        assert res.stats.n_generated_tokens == 300
        if drafter == "eagle3":
            assert res.stats.token_sources.get("eagle3", 0) > 0
        else:  # this repetitive text is the n-gram drafter's; the head must still have drafted
            assert e.drafter.model.stats.n_steps > 0
        assert_greedy_is_target_argmax(e, prompt, res.token_ids)
    finally:
        e.close()


def _shipped(model):
    from localspec.models.eagle3_heads import shipped_head

    return shipped_head(model.path)
