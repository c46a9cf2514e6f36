import math
from dataclasses import replace

import numpy as np
import pytest

from conftest import fixed_cost_model
from localspec.policy import AcceptanceTracker, Choice, ModelDraftStats, ScoreCalibration, SpeculationPolicy, TreeShape
from localspec.tree import TokenSource, TokenTree


def chain_with(p_each, n):
    scores = [p_each ** (i + 1) for i in range(n)]
    return TokenTree.chain(1, list(range(10, 10 + n)), TokenSource.NGRAM, scores)


def test_confident_long_chain_is_verified_whole():
    """A confident chain is verified at the trust region's size first (8 nodes), which grows
    with every fully accepted tree until the chain is verified whole."""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    tree = chain_with(0.999, 40)
    sizes = []
    for _ in range(4):
        c = pol.choose(tree)
        sizes.append(c.n_nodes)
        pol.observe_outcome(tree.best_subtree(c.n_nodes), c.n_nodes - 1)  # all accepted
    assert sizes[0] == 8 and sizes == sorted(sizes) and sizes[-1] >= 24, sizes
    assert c.expected_tokens > 20


def test_weak_drafts_are_not_verified():
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    assert pol.choose(chain_with(0.3, 10)).n_nodes == 1
    assert pol.choose(TokenTree.root_only(5)).n_nodes == 1


def test_choice_maximises_expected_rate_over_the_cost_table():
    cm = fixed_cost_model()
    pol = SpeculationPolicy(cm, max_nodes=64, min_gain=0.0)
    pol.calibration = ScoreCalibration(first_nodes=64)  # no trust region: the table alone
    tree = chain_with(0.9, 30)
    c = pol.choose(tree)
    rates = {}
    for b in cm.sizes:
        e = 1 + sum(0.9 ** (i + 1) for i in range(b - 1))
        rates[b] = e / (cm.t_decode_us(b) + pol.host_us(b))
    assert c.n_nodes == max(rates, key=rates.get)


def test_min_gain_guards_marginal_choices():
    cm = fixed_cost_model()
    tight = SpeculationPolicy(cm, max_nodes=64, min_gain=0.5)
    loose = SpeculationPolicy(cm, max_nodes=64, min_gain=0.0)
    tree = chain_with(0.8, 8)
    assert loose.choose(tree).n_nodes > 1
    assert tight.choose(tree).n_nodes == 1


def test_online_costs_replace_the_table():
    cm = fixed_cost_model()
    pol = SpeculationPolicy(cm, max_nodes=64)
    for _ in range(5):
        pol.observe_step(8, 200000.0, 1000.0)  # a suddenly slow machine for b = 8
    assert cm.t_decode_us(8) > 150000


def test_tracker_learns_per_request_and_long_run():
    t = AcceptanceTracker(np.array([0.5, 0.5]))
    for _ in range(20):
        t.record(0, True)
        t.record(1, False)
        t.end_step()
    assert t.estimate(0) > 0.9 and t.estimate(1) < 0.2
    t.reset_request()
    # the long-run rate keeps what was learned, less strongly than the request did
    assert 0.5 < t.estimate(0) < 0.99 and t.estimate(1) < 0.5
    assert np.allclose(t.estimates(), [t.estimate(0), t.estimate(1)])


# -- issue 15: back off as fast as the evidence says; cope with a busy-machine cost table ------

from localspec.costmodel import CostModel  # noqa: E402
from localspec.drafters.ngram import NgramDrafter  # noqa: E402


def quiet_table():
    """A cost table of a quiet 2-core CPU (the tests' fixed table, µs)."""
    return fixed_cost_model().table_us


def test_cost_ratios_are_sane_on_a_noisy_table():
    # calibrated while bursts of load hit b = 1 and b = 8: t(2) < t(1), t(8) < t(4)
    cm = CostModel({1: 30000.0, 2: 22900.0, 4: 29300.0, 8: 21000.0, 16: 68700.0})
    ts = [cm.t_decode_us(b) for b in cm.sizes]
    assert all(t >= cm.t_decode_us(1) for t in ts)  # no batch is cheaper than one token


# Measured 2026-12-01 on the 2-core CPU (Gemma 3 270M Q4_K_M, exact kernels, quiet): odd
# batches cost 25-40% more than the next even one.
PARITY_COSTS_US = {
    1: 32956.0, 2: 60379.0, 3: 107120.0, 4: 75332.0, 5: 115000.0, 6: 90299.0, 7: 127174.0,
    8: 102949.0, 9: 140143.0, 10: 119696.0, 11: 165039.0, 12: 146876.0, 13: 190468.0,
    14: 168447.0, 15: 212066.0, 16: 179841.0, 20: 219351.0, 24: 252607.0, 28: 281682.0,
    32: 322176.0, 40: 379045.0, 48: 367119.0, 56: 517063.0, 64: 629428.0,
}  # fmt: skip


def test_a_genuinely_cheaper_larger_batch_is_priced_as_measured():
    """Where odd batches cost more than the next even one, each size keeps its own price (a
    running maximum priced t(4) like t(3), 42% too high), so the policy verifies 4 nodes
    where it would otherwise verify 3 or nothing, and sizes the model drafter's budget by
    the real cost."""
    cm = CostModel(dict(PARITY_COSTS_US))
    assert not cm.outliers
    for b in (2, 4, 6, 8):
        assert abs(cm.t_decode_us(b) - PARITY_COSTS_US[b]) < 1.0, b
    assert cm.t_decode_us(3) > cm.t_decode_us(4)
    pol = SpeculationPolicy(cm, max_nodes=64)
    pol.calibration = ScoreCalibration(first_nodes=64)  # no trust region: the table alone
    c = pol.choose(chain_with(0.93, 8))
    assert c.n_nodes % 2 == 0 and c.n_nodes >= 4, c  # never a dominated odd size
    shape = pol.tree_shape(ModelDraftStats(), max_depth=6, max_nodes=16, max_width=4)
    assert shape.max_nodes == 4, shape  # t(4) = 2.29 t1 <= 2.5 t1 (t(3) would say 3.25)
    assert cm.min_ratio(3, 5) == cm.ratio(4)


def test_stale_batch_timings_follow_the_load():
    """A batch measured on a quiet machine must not look cheap once single-token decodes
    slow down (the old model kept the raw online time of b = 8)."""
    cm = CostModel(quiet_table())
    for _ in range(5):
        cm.observe(1, 11900.0)
        cm.observe(8, 45900.0)
    before = cm.t_decode_us(8)
    for _ in range(20):
        cm.observe(1, 23800.0)  # the machine is now twice as slow
    assert cm.t_decode_us(1) > 20000.0
    assert cm.t_decode_us(8) / before > 1.7


def test_one_burst_moves_the_estimate_a_bounded_step():
    cm = CostModel(quiet_table())
    for _ in range(5):
        cm.observe(4, 29300.0)
    r0 = cm.ratio(4)
    cm.observe(4, 10 * 29300.0)
    assert cm.ratio(4) <= r0 * 1.25


def test_a_table_calibrated_in_a_burst_is_corrected_by_the_first_trees():
    """Calibration ran while a burst slowed the single-token decodes: the table says a batch
    of 4 costs 1.1 plain decodes (it costs 2.5). After a few verified batches of 4 the policy
    stops speculating on a chain it would verify under the wrong table, and the correction
    carries over to sizes it has not verified yet."""
    busy = {b: t for b, t in quiet_table().items()}
    busy[1] = 26000.0
    cm = CostModel(busy)
    pol = SpeculationPolicy(cm, max_nodes=64)
    chain = chain_with(0.55, 8)
    assert pol.choose(chain).n_nodes > 1  # fooled by the table
    t8_before = cm.t_decode_us(8)
    for _ in range(8):
        pol.observe_step(1, 11900.0, 1500.0)
        pol.observe_step(4, 29300.0, 1800.0)
    assert pol.choose(chain).n_nodes == 1
    assert cm.t_decode_us(8) < t8_before  # t1 fell ...
    assert cm.ratio(8) > busy[8] / busy[1] * 1.5  # ... and the unobserved ratio rose


def test_request_factor_lowers_untried_buckets():
    t = AcceptanceTracker(np.full(4, 0.8))
    for _ in range(6):
        t.record(0, False)
        t.record(1, False)
    t.end_step()
    e = t.estimates()
    assert e[0] < 0.5 and e[1] < 0.5
    assert e[2] < 0.5 and e[3] < 0.5  # never tried in this request, lowered by the factor
    t.reset_request()
    assert t.estimates()[2] > 0.6  # a new request starts from the long-run rates again


def test_request_factor_raises_buckets_when_drafts_are_accepted():
    t = AcceptanceTracker(np.full(3, 0.3))
    for _ in range(8):
        t.record(0, True)
    t.end_step()
    assert t.estimates()[1] > 0.45


def _simulate(drafter, policy, prompt, text, n_steps, true_costs=None):
    """Greedy speculative decoding of ``text`` after ``prompt`` with a simulated target that
    emits ``text`` (the verified path while it agrees, then the target's own token), costed
    with ``true_costs`` (a ``CostModel``: the machine's real decode times, fed back to the
    policy every step) or else with ``policy.cost``. Returns (simulated speed ratio over
    plain decoding, verified draft tokens, accepted draft tokens)."""
    truth = true_costs or policy.cost
    drafter.begin(prompt)
    pos, t_spec, drafted, accepted = 0, 0.0, 0, 0
    steps = 0
    while pos < len(text) - 1 and steps < n_steps:
        cand = drafter.propose(48, 64)
        b = policy.choose(cand).n_nodes
        tree = cand.best_subtree(b) if b < cand.n_nodes else cand
        node, emitted = 0, []
        while True:  # walk the verified tree along the target's text
            nxt = next((c for c in tree.children(node) if int(tree.token_ids[c]) == text[pos + len(emitted)]), -1)
            if nxt < 0 or pos + len(emitted) + 1 >= len(text):
                break
            emitted.append(text[pos + len(emitted)])
            node = nxt
        accepted += len(emitted)
        emitted.append(text[pos + len(emitted)])
        drafted += b - 1
        policy.observe_outcome(tree, len(emitted) - 1)
        drafter.observe(cand, emitted)
        drafter.accept(emitted)
        t_spec += truth.t_decode_us(b)
        if true_costs is not None:
            policy.observe_step(b, truth.t_decode_us(b), 1500.0)
        pos += len(emitted)
        steps += 1
    plain = pos * truth.t_decode_us(1)
    return plain / t_spec, drafted, accepted


def _coincidental_text(seed=0, n_prompt=400, n_gen=200, vocab=40):
    """Zipf-distributed random tokens: many short n-gram matches, none of which continue."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1)
    toks = rng.choice(vocab, n_prompt + n_gen, p=p / p.sum()).tolist()
    return toks[:n_prompt], toks[n_prompt:]


def _copy_text(seed=1, n_prompt=400, n_gen=200, vocab=1000):
    """The generation copies stretches of the prompt, with an edit every ~25 tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, n_prompt).tolist()
    gen, src = [], 50
    while len(gen) < n_gen:
        gen.extend(prompt[src : src + 25])
        gen.append(int(rng.integers(0, vocab)))
        src += 40
    return prompt, gen[:n_gen]


def test_policy_backs_off_on_coincidental_matches():
    """Issue 15: a prompt whose matches never continue (one accepted 0 of 50 drafted tokens)
    must cost at most a few failed trees, not one per few steps: simulated speed >= 0.97x of
    plain decoding. With the request factor switched off (factor_weight huge: each bucket
    learns alone, the old tracker) the same run verifies more and is slower; checked here so
    that the test shows what it defends."""
    prompt, text = _coincidental_text()
    ratio, drafted, accepted = _simulate(NgramDrafter(), SpeculationPolicy(fixed_cost_model()), prompt, text, 96)
    assert ratio >= 0.97, (ratio, drafted, accepted)
    old = NgramDrafter()
    old.tracker.factor_weight = 1e12
    ratio_old, drafted_old, _ = _simulate(old, SpeculationPolicy(fixed_cost_model()), prompt, text, 96)
    assert drafted_old > drafted and ratio_old < ratio, (ratio_old, drafted_old, ratio, drafted)


def test_policy_still_speculates_when_the_text_is_copied():
    prompt, text = _copy_text()
    ratio, drafted, accepted = _simulate(NgramDrafter(), SpeculationPolicy(fixed_cost_model()), prompt, text, 200)
    assert ratio > 1.5, (ratio, drafted, accepted)
    assert accepted > 0.5 * drafted


# A table calibrated in this session at load ~20 (another process's burst hit b = 1, 8, 9)
BURST_TABLE = {
    1: 4812485.0, 2: 459912.0, 3: 439786.0, 4: 380455.0, 5: 754520.0, 6: 612791.0, 7: 764581.0,
    8: 2100045.0, 9: 2500310.0, 10: 944673.0, 11: 1169592.0, 12: 2171893.0,
}  # fmt: skip


def test_sanitize_keeps_a_quiet_table_and_replaces_bursts():
    from localspec.costmodel import sanitize_table

    clean, bad = sanitize_table(quiet_table())
    assert bad == [] and clean == quiet_table()
    clean, bad = sanitize_table(BURST_TABLE)
    assert 1 in bad and 2 not in bad
    assert clean[1] < BURST_TABLE[2]  # one token no longer costs 10 batches of 2
    assert CostModel(BURST_TABLE).outliers == bad


def test_a_burst_table_does_not_make_speculation_look_free():
    """With the raw burst table (t(1) = 10 x t(2)) the old model verified trees whose
    expected gain was ~0 (E = 1.01 at b = 2). Now a near-hopeless tree is not verified, even
    before any online observation."""
    pol = SpeculationPolicy(CostModel(BURST_TABLE), max_nodes=12)
    assert pol.choose(chain_with(0.05, 6)).n_nodes == 1
    assert pol.choose(chain_with(0.3, 6)).n_nodes == 1
    assert pol.choose(chain_with(0.999, 11)).n_nodes > 1


def test_a_busy_calibration_does_not_make_prompts_slower_than_plain():
    """The table was calibrated while a burst inflated t(1) 2.2x (so every batch looked 2.2x
    cheaper than it is); the machine's real costs are the quiet table. Fed back the real
    decode times, the policy must stay at >= 0.97x of plain decoding on text with
    coincidental matches. The old model (table ratios kept, only scaled by the drift of t(1))
    over-speculated here (a replay of real code continuations: 4 of 30 below 0.97x, down to
    0.78x); checked on the same text with the correction switched off."""
    busy = dict(quiet_table())
    busy[1] *= 2.2
    prompt, text = _coincidental_text(seed=5, vocab=25)
    ratio, drafted, _ = _simulate(NgramDrafter(), SpeculationPolicy(CostModel(busy)), prompt, text, 150, fixed_cost_model())
    assert ratio >= 0.97, (ratio, drafted)


# -- the winner's curse: verified trees are the most overestimated ----------------------------


def _simulate_overconfident(policy, p_true, n_steps=150, seed=0):
    """A drafter whose chains claim ``0.92 ** depth`` while the target accepts each node with
    probability ``p_true`` (independently, seeded); the drafter never learns, so only the
    policy's own calibration can react. Returns (speed ratio over plain decoding, verified
    draft tokens, accepted draft tokens) with the policy's cost model as the machine."""
    rng = np.random.default_rng(seed)
    cost = policy.cost
    t_spec, n_tok, drafted, accepted = 0.0, 0, 0, 0
    for step in range(n_steps):
        cand = chain_with(0.92, 12)
        b = policy.choose(cand).n_nodes
        tree = cand.best_subtree(b) if b < cand.n_nodes else cand
        k = 0
        while k < b - 1 and rng.random() < p_true:
            k += 1
        policy.observe_outcome(tree, k)
        drafted += b - 1
        accepted += k
        n_tok += k + 1
        t_spec += cost.t_decode_us(b)
    return n_tok * cost.t_decode_us(1) / t_spec, drafted, accepted


def test_verified_trees_that_keep_failing_are_backed_off():
    """Issue 15 (code prompts below 0.97x): the verified trees of a request predicted 46.8
    tokens over 8 steps and emitted 29. Drafts claiming 0.92 per node that the target accepts
    half of the time: with the score calibration the run stays >= 0.97x of plain; without it
    (exponent pinned at 1) the same run is clearly slower than plain, which is what this test
    defends."""
    pol = SpeculationPolicy(fixed_cost_model())
    ratio, drafted, accepted = _simulate_overconfident(pol, 0.5)
    assert ratio >= 0.97, (ratio, drafted, accepted)
    off = SpeculationPolicy(fixed_cost_model())
    off.calibration = ScoreCalibration(lo=1.0, hi=1.0)
    ratio_off, drafted_off, _ = _simulate_overconfident(off, 0.5)
    assert ratio_off < 0.9 and drafted_off > 3 * drafted, (ratio_off, drafted_off, ratio, drafted)


def test_overconfident_drafts_that_still_pay_keep_smaller_trees():
    """Claims of 0.92 per node, truth 0.8: verified as claimed the run is slower than plain
    (0.88x); the calibrated policy keeps speculating with smaller trees and is not."""
    ratio, drafted, _ = _simulate_overconfident(SpeculationPolicy(fixed_cost_model()), 0.8)
    off = SpeculationPolicy(fixed_cost_model())
    off.calibration = ScoreCalibration(lo=1.0, hi=1.0)
    ratio_off, drafted_off, _ = _simulate_overconfident(off, 0.8)
    assert ratio >= 0.97 and ratio > ratio_off + 0.1 and 0 < drafted < drafted_off, (ratio, ratio_off, drafted, drafted_off)


def test_calibration_keeps_speculating_when_the_estimates_hold():
    """Drafts that are as good as they claim keep most of their gain: the calibration (an
    estimate from few trees) and the trust region cost at most 15% of the speed-up here, and
    the run stays well above plain decoding."""
    ratio, _, _ = _simulate_overconfident(SpeculationPolicy(fixed_cost_model()), 0.92)
    off = SpeculationPolicy(fixed_cost_model())
    off.calibration = ScoreCalibration(lo=1.0, hi=1.0)
    ratio_off, _, _ = _simulate_overconfident(off, 0.92)
    assert ratio > 1.4 and ratio - 1.0 >= 0.85 * (ratio_off - 1.0), (ratio, ratio_off)


def test_score_calibration_fits_forgets_and_carries_over():
    c = ScoreCalibration()
    assert c.exponent() == 1.0
    chain = 0.9 ** np.arange(1, 6)  # claims 0.9 per node
    for _ in range(20):
        c.observe(chain, 1)  # the target accepts one draft token per tree
    g = c.exponent()
    # the fitted exponent predicts about one accepted token per tree (the prior pulls a little)
    assert g > 3 and 0.8 < float(np.sum(chain**g)) < 1.6, g
    for _ in range(80):  # plain steps: the evidence fades, the exponent returns towards 1
        c.observe(np.empty(0), 0)
    assert 1.0 <= c.exponent() < g
    c.begin_request()  # a new request starts from the long-run exponent, above 1 now
    assert 1.0 < c.exponent() < g
    np.testing.assert_allclose(c.calibrate(np.array([0.5, 0.25])), np.array([0.5, 0.25]) ** c.exponent())


def test_the_model_step_is_credited_only_with_what_it_adds():
    """``auto`` verifies the head's tree merged with the n-gram tree. A head whose drafts are
    accepted 3 tokens deep, but only 0.2 tokens beyond what the n-gram tree got, adds its
    drafting time and little else: ``prefer_model`` says no (it used to credit the head with
    its whole acceptance length, and said yes). With a real gain it says yes, and a model
    drafting alone (the cheap tree is the root: gain = acceptance length) is judged as before."""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    shape = TreeShape(depth=4, width=1, max_nodes=5)
    t5 = pol.cost.t_decode_us(5) + pol.host_us(5)
    cheap = Choice(5, 3.0, 3.0 / t5)  # the n-gram tree: 3 tokens expected from 5 nodes
    stats = ModelDraftStats(t_draft_us=2000.0, n_steps=10, t_host_us=200.0)
    stats.accept_length, stats.gain_length = 3.0, 0.2
    assert not pol.prefer_model(cheap, stats, shape)
    stats.gain_length = 3.5  # 4.5 tokens expected from the model step, against the cheap step's 3
    assert pol.prefer_model(cheap, stats, shape)
    alone = Choice(1, 1.0, 1.0 / (pol.cost.t_decode_us(1) + pol.host_us(1)))
    stats.accept_length = stats.gain_length = 3.0
    assert pol.prefer_model(alone, stats, shape)
    stats.accept_length = stats.gain_length = 0.3
    assert not pol.prefer_model(alone, stats, shape)


def test_a_model_step_verifies_at_least_what_the_cheap_drafts_alone_would():
    """A step that runs the model (here its first: a probe) verifies the merged tree's best
    nodes, never fewer than the n-gram tree alone would have had: a long confident n-gram
    run is not cut down to the model's budget (5 nodes here). Where the cheap drafts are
    weak the model's budget is what is verified."""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    pol.calibration = ScoreCalibration(first_nodes=64)
    stats = ModelDraftStats(t_draft_us=2000.0, n_steps=0, t_host_us=200.0)  # never run: a probe
    long_run = chain_with(0.995, 40)
    alone = pol.choose(long_run).n_nodes
    assert alone > 5
    plan = pol.plan(long_run, stats, max_nodes=64, max_depth=40, fixed_shape=None)
    assert plan.shape is not None and plan.n_nodes == alone
    fresh = ModelDraftStats(t_draft_us=2000.0, n_steps=0, t_host_us=200.0)  # a new drafter: its first probe
    weak = pol.plan(chain_with(0.3, 10), fresh, max_nodes=64, max_depth=40)
    assert weak.shape is not None and weak.n_nodes == weak.shape.max_nodes


def test_where_the_cheap_drafts_verify_nothing_a_model_step_verifies_only_its_nodes_that_pay():
    """Where the n-gram tree would verify nothing (weak drafts), a model step's tree is
    verified only where its nodes pay by their own scores: an unsure head's chain not at all
    (the step is plain, having paid the drafting), a sure one whole, also when the request's
    score calibration (of the n-gram scores) has learnt that its n-gram trees are far too
    sure. Where the n-gram tree verifies something, or the plan is not adaptive, the plan's
    size stands (None); a tree of sampled children is verified whole. (It failed when
    ``select_model_nodes`` kept the plan's size everywhere: the unsure chain was verified
    whole; and when it applied the request's score calibration to the head's scores: the
    sure chain was dropped.)"""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    weak = chain_with(0.3, 5)
    assert pol.choose(weak).n_nodes == 1
    stats = ModelDraftStats(t_draft_us=2000.0, n_steps=0, t_host_us=200.0)
    plan = pol.plan(weak, stats, max_nodes=64, max_depth=8)
    assert plan.shape is not None and plan.cheap_nodes == 1  # a new model's first try
    for scores, want in (([0.1, 0.05, 0.02], 1), ([0.95, 0.92, 0.9], 4)):
        head = TokenTree.chain(1, [20, 21, 22], TokenSource.EAGLE3, scores)
        assert pol.select_model_nodes(head, plan, max_nodes=64, t_spent_us=1800.0) == want, scores
    assert pol.select_model_nodes(TokenTree.root_only(1), plan, max_nodes=64, t_spent_us=1800.0) == 1
    for _ in range(20):  # n-gram trees that failed: the request's calibration far below their scores
        pol.calibration.observe(np.array([0.9, 0.85, 0.8]), 0)
    assert pol.calibration.exponent() > 3.0
    head = TokenTree.chain(1, [20, 21, 22], TokenSource.EAGLE3, [0.9, 0.85, 0.8])
    assert pol.select_model_nodes(head, plan, max_nodes=64, t_spent_us=1800.0) == 4
    from localspec.tree import TreeBuilder

    b = TreeBuilder(1)  # sampled children (classic rejection sampling), unsure by their depth bucket
    for k, t in enumerate((20, 21)):
        b.add(0, t, source=TokenSource.EAGLE3, score=0.05, draft_prob=0.3, draw_index=k)
    sampled = b.build()
    assert pol.select_model_nodes(sampled, plan, max_nodes=64, t_spent_us=1800.0) == plan.n_nodes
    strong = chain_with(0.99, 6)
    plan = pol.plan(strong, ModelDraftStats(t_draft_us=2000.0, n_steps=0, t_host_us=200.0), max_nodes=64, max_depth=8)
    assert plan.cheap_nodes > 1 and plan.shape is not None
    assert pol.select_model_nodes(head, plan, max_nodes=64, t_spent_us=1800.0) is None
    fixed = pol.plan(weak, stats, max_nodes=64, max_depth=8, adaptive=False)
    assert fixed.cheap_nodes is None and pol.select_model_nodes(head, fixed, max_nodes=64, t_spent_us=1800.0) is None


def test_where_the_cheap_drafts_verify_nothing_the_model_runs_where_its_value_or_its_acceptance_pays():
    """``prefer_model`` on a step the n-gram tree leaves plain runs the model where its measured
    ``value`` (what its such steps emitted against the plain steps they replaced) is above 1,
    or where the estimate from its acceptance pays, which charges every drafted row (such a
    step verifies only the nodes that pay, so it costs at most that): a head whose steps
    emitted one token in 10% more time runs while its acceptance says it pays and stops when
    that falls too; one whose steps paid runs on a poor acceptance estimate; a probe's outcome
    replaces the average. On a step with n-gram drafts the acceptance estimate alone decides.
    (It failed when ``prefer_model`` ignored ``value``, and when a value below 1 overruled the
    estimate: measured as user turns, the head alone then ran 0.91-0.97x of the rule before
    the measured worth, and 1.05x with both.)"""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    shape = TreeShape(depth=4, width=1, max_nodes=5)
    alone = Choice(1, 1.0, 1.0 / pol.step_us(1))
    stats = ModelDraftStats(t_draft_us=2000.0, n_steps=10, t_host_us=200.0)
    stats.accept_length = stats.gain_length = 3.0
    assert pol.prefer_model(alone, stats, shape)  # no value yet: the acceptance estimate
    stats.observe_value(1, 10000.0, 11000.0)  # one token in 10% more time
    assert stats.value == pytest.approx(10000.0 / 11000.0)
    assert pol.prefer_model(alone, stats, shape)  # its acceptance still pays
    stats.accept_length = stats.gain_length = 0.1
    assert not pol.prefer_model(alone, stats, shape)  # neither pays
    for _ in range(8):
        stats.observe_value(2, 10000.0, 14000.0)
    assert stats.value > 1.0 and pol.prefer_model(alone, stats, shape)  # its worth pays
    stats.observe_value(1, 10000.0, 12500.0, probe=True)
    assert stats.value == pytest.approx(0.8) and not pol.prefer_model(alone, stats, shape)
    t5 = pol.cost.t_decode_us(5) + pol.host_us(5)
    stats.value, stats.accept_length, stats.gain_length = 2.0, 3.0, 0.1
    assert not pol.prefer_model(Choice(5, 3.0, 3.0 / t5), stats, shape)  # n-gram drafts: the estimate decides
    stats.gain_length = 3.5
    assert pol.prefer_model(Choice(5, 3.0, 3.0 / t5), stats, shape)


def test_auto_records_the_heads_gain_beyond_the_ngram_tree():
    """``ModelDraftStats.observe_accept`` with a baseline: accept_length counts the model's
    tree, gain_length only what it got beyond the cheap drafts."""
    st = ModelDraftStats()
    st.n_steps = 1
    st.observe_accept(3, gain=0)
    assert st.accept_length == 3.0 and st.gain_length == 0.0
    st.observe_accept(2)
    assert st.gain_length == 2.0  # n_steps <= 1: the last value


def test_per_depth_counts_stop_at_the_trees_depth_decay_and_are_replaced_by_a_probe():
    """``observe_accept`` with the model tree's depth: depth d is tried when the path reached
    d - 1 accepted and the tree has a node at d; a path accepted to the tree's depth says
    nothing of deeper ones. Counts decay per observation; a probe's outcome replaces them."""
    st = ModelDraftStats(n_steps=2, depth_decay=0.5)
    st.observe_accept(2, depth=4)  # accepted 2 of a 4-deep tree: depths 1-3 tried, 1-2 accepted
    assert st.depth_tried[:5] == [1.0, 1.0, 1.0, 0.0, 0.0] and st.depth_ok[:4] == [1.0, 1.0, 0.0, 0.0]
    st.observe_accept(3, depth=3)  # the whole tree accepted: depth 4 was not tried
    assert st.depth_tried[:4] == [1.5, 1.5, 1.5, 0.0] and st.depth_ok[:4] == [1.5, 1.5, 1.0, 0.0]
    q = st.depth_rates(4)
    r1 = (1.5 + 2 * 0.5) / (1.5 + 2)  # two pseudo-observations at the prior
    r2 = (1.5 + 2 * r1) / (1.5 + 2)  # the prior of each depth is the rate of the one above
    r3 = (1.0 + 2 * r2) / (1.5 + 2)
    assert q[:3] == pytest.approx([r1, r1 * r2, r1 * r2 * r3])
    assert q[3] == pytest.approx(r1 * r2 * r3 * r3)  # untried: its prior
    st.probe = True
    st.observe_accept(0, depth=2)
    assert st.depth_tried[:3] == [1.0, 0.0, 0.0] and st.depth_ok[:2] == [0.0, 0.0]
    assert ModelDraftStats().depth_rates(3) is None


def _stats_with_rates(rate: float, n: int = 40, depth: int = 6) -> ModelDraftStats:
    """A model drafter whose every next draft is accepted with chance ``rate`` (deterministic
    counts: ``n`` steps of ``depth``-deep trees, accepted as far as that rate says)."""
    st = ModelDraftStats(t_draft_us=1500.0, n_steps=n, t_host_us=100.0, depth_decay=1.0)
    accepted = []
    for k in range(n):
        acc = 0
        while acc < depth and (k * 7919 % 1000 + 0.5) / 1000.0 < rate ** (acc + 1):
            acc += 1
        st.observe_accept(acc, depth=depth)
        accepted.append(acc)
    st.accept_length = st.gain_length = float(np.mean(accepted))
    return st


def test_the_model_drafts_the_chain_whose_expected_rate_is_highest_for_the_machine():
    """``model_shape``: where each verified node costs a good part of a decode (the 2-core
    CPU's table), a head whose drafts are accepted about half the time drafts a short chain,
    and a better head a longer one; where a batch costs about one token (a GPU), the same
    head drafts deeper. Each choice is the best of the shapes it weighs (``tree_shape``'s
    tree: within ``width_credit`` of the best chain)."""
    cpu = {1: 22000.0, 2: 25800.0, 3: 30000.0, 4: 33400.0, 5: 50500.0, 6: 55100.0, 7: 58400.0, 8: 52300.0,
           12: 66500.0, 16: 81400.0, 32: 145600.0, 64: 279300.0}  # fmt: skip
    pol = SpeculationPolicy(CostModel(cpu), max_nodes=64)
    pol.cost.observe_draft_levels([800.0, 600.0, 400.0, 400.0, 400.0, 400.0])
    half, good = _stats_with_rates(0.5), _stats_with_rates(0.9)
    s_half = pol.model_shape(half, max_depth=6, max_nodes=64, max_width=4)
    s_good = pol.model_shape(good, max_depth=6, max_nodes=64, max_width=4)
    assert s_half.width == 1 and s_half.max_nodes == s_half.depth + 1 and s_half.depth <= 2
    assert s_good.depth > s_half.depth
    for st, best in ((half, s_half), (good, s_good)):
        q = st.depth_rates(6)
        others = [TreeShape(d, 1, d + 1) for d in range(1, 7)] + [pol.tree_shape(st, max_depth=6, max_nodes=64, max_width=4)]
        assert pol.model_rate(st, best, q) >= (1 - pol.width_credit) * max(pol.model_rate(st, o, q) for o in others)
    assert pol.model_rate(half, s_half) > pol.model_rate(half, pol.tree_shape(half, max_depth=6, max_nodes=64, max_width=4))
    # against a plain step, the short chain pays (about 1.55 tokens for 1.2 decodes)
    plain = Choice(1, 1.0, 1.0 / pol.step_us(1))
    assert pol.prefer_model(plain, half, s_half)
    flat = SpeculationPolicy(CostModel({b: 4000.0 * (1 + 0.002 * (b - 1)) for b in (1, 2, 3, 4, 8, 16, 32, 64)}), max_nodes=64)
    flat.cost.observe_draft_levels([800.0, 600.0, 400.0, 400.0, 400.0, 400.0])
    deeper = flat.model_shape(half, max_depth=6, max_nodes=64, max_width=4)
    assert deeper.depth > s_half.depth  # verification nearly free: the same head drafts deeper


def test_a_shape_is_credited_no_deeper_than_its_nodes_reach():
    """``model_rate``: a shape deeper than its node budget (``tree_shape``'s tree where the
    budget is one or two nodes, as on a CPU where t(2) is twice t(1)) is credited the accepted
    length of the depths its nodes reach, not of its depth: (depth 4, 2 nodes) drafts one node
    and gets at most one token, so it is worth no more than a chain of one and loses to the
    chain of two of a head that is nearly always right (otherwise it was chosen and the head
    drafted one token a step)."""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    pol.cost.observe_draft_levels([1000.0] * 6)
    st = _stats_with_rates(0.97)
    q = st.depth_rates(6)
    shallow = TreeShape(4, 1, 2)
    one, two = TreeShape(1, 1, 2), TreeShape(2, 1, 3)
    assert pol.model_rate(st, shallow, q) <= pol.model_rate(st, one, q)
    assert pol.model_rate(st, shallow, q) < pol.model_rate(st, two, q)


def test_a_model_whose_drafts_got_nothing_accepted_is_credited_nothing_at_any_depth():
    """Per-depth counts from earlier steps do not make a model that now gets nothing accepted
    look worth running: with ``accept_length`` 0 (a failed probe) every shape is credited no
    gain, so only its probes bring it back."""
    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    st = _stats_with_rates(0.9)
    st.accept_length = st.gain_length = 0.0
    for d in range(1, 5):
        shape = TreeShape(d, 1, d + 1)
        assert pol.model_rate(st, shape) == pytest.approx(1.0 / (pol.model_step_us(st, shape) + pol.step_us(d + 1)))
    assert not pol.prefer_model(Choice(1, 1.0, 1.0 / pol.step_us(1)), st, TreeShape(1, 1, 2))


def test_the_early_plain_exit_never_changes_the_choice():
    """``choose`` skips the calibration fit when an upper bound of every tree's rate cannot beat
    plain decoding. Over random trees, calibrations and draft costs its choice equals a brute
    force over the cost table with the calibrated scores (the bound must be a true bound: a
    mutation that bounds with the raw scores instead of ``score ** lo`` fails here, where
    underconfident drafts have an exponent below 1)."""
    rng = np.random.default_rng(5)
    n_spec = 0
    for trial in range(300):
        cm = fixed_cost_model() if trial % 2 else CostModel(dict(PARITY_COSTS_US))
        pol = SpeculationPolicy(cm, max_nodes=int(rng.choice([4, 16, 64])), min_gain=float(rng.choice([0.0, 0.05, 0.3])))
        cal = pol.calibration
        for _ in range(int(rng.integers(0, 4))):  # verified trees: over- or underconfident claims
            s = np.sort(rng.random(int(rng.integers(1, 8))))[::-1]
            cal.observe(s, int(rng.integers(0, s.size + 1)))
        n = int(rng.integers(2, 40))
        p = float(rng.choice([0.2, 0.5, 0.7, 0.85, 0.95]))
        scores = np.cumprod(np.clip(rng.normal(p, 0.1, n), 0.01, 1.0))
        tree = TokenTree.chain(1, list(range(10, 10 + n)), TokenSource.NGRAM, scores)
        t_draft = float(rng.choice([0.0, 500.0, 5000.0]))
        c = pol.choose(tree, t_draft_us=t_draft)
        # reference: the full search
        limit = min(pol.max_nodes, tree.n_nodes, cal.trust_nodes())
        cs = np.sort(scores)[::-1] ** cal.exponent()
        plain = 1.0 / (t_draft + cm.t_decode_us(1) + pol.host_us(1))
        best_b, best_r = 1, plain
        for b in cm.sizes:
            if 2 <= b <= limit:
                r = (1.0 + cs[: b - 1].sum()) / (t_draft + cm.t_decode_us(b) + pol.host_us(b))
                if r > best_r:
                    best_b, best_r = b, r
        if best_r < plain * (1.0 + pol.min_gain):
            best_b = 1
        assert c.n_nodes == best_b, (trial, c, best_b, cal.exponent())
        n_spec += best_b > 1
    assert 30 < n_spec < 270, n_spec  # both branches exercised


def test_the_calibration_exponent_is_the_root_of_its_equation():
    """``ScoreCalibration.exponent`` (safeguarded Newton from the last fit) against bisection
    on the defining equation, over random histories whose roots fall inside [lo, hi] and
    beyond either bound, fitted step after step as the engine does."""
    rng = np.random.default_rng(11)
    n_in = n_lo = n_hi = 0
    for _ in range(60):
        c = ScoreCalibration(lam=float(rng.choice([0.2, 1.0, 4.0])))
        c.log_center = float(rng.normal(0.0, 0.5))
        for _ in range(int(rng.integers(1, 25))):
            if rng.random() < 0.6:
                s = np.sort(rng.random(int(rng.integers(1, 12))) ** float(rng.choice([0.1, 1.0, 3.0])))[::-1]
                c.observe(s, int(rng.integers(0, s.size + 1)))
            else:
                c.observe(np.empty(0), 0)
            got = c.exponent()
            if not c._trees:
                # the prior: the long-run exponent, never below 1 (math.exp, as the rule
                # computes it; numpy's SIMD exp can differ from libm's in the last bit, e.g. on
                # AVX-512 CPUs)
                assert got == min(max(math.exp(c.log_center), 1.0), c.hi)
                continue
            w = np.concatenate([np.full(t.size, c.decay ** (c._step - st)) for t, _, st in c._trees])
            a = sum(c.decay ** (c._step - st) * a_i for _, a_i, st in c._trees)
            ls = np.log(np.clip(np.concatenate([t for t, _, _ in c._trees]), 1e-12, 1.0))

            def f(lg):
                return float(np.dot(w, np.exp(np.exp(lg) * ls))) - a - c.lam * (lg - c.log_center)

            lo, hi = np.log(c.lo), np.log(c.hi)
            if f(lo) <= 0:
                want, n_lo = c.lo, n_lo + 1
            elif f(hi) >= 0:
                want, n_hi = c.hi, n_hi + 1
            else:
                for _ in range(60):
                    mid = 0.5 * (lo + hi)
                    lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
                want, n_in = float(np.exp(0.5 * (lo + hi))), n_in + 1
            assert abs(np.log(got) - np.log(want)) < 1e-9, (got, want)
    assert n_in > 50 and n_lo > 5 and n_hi > 5, (n_in, n_lo, n_hi)


# -- risk before evidence, and probes of a model drafter that does not pay ----------------------

FLAT_COSTS_US = {1: 10000.0, 2: 11000.0, 3: 12000.0, 4: 13000.0, 8: 17000.0, 16: 25000.0, 32: 41000.0, 64: 73000.0}


def test_a_new_request_risks_no_tree_on_borrowed_optimism():
    """Issue 31's held-out summary (a 12-token answer) lost 4% on one rejected 2-token draft
    risked before the request had any evidence. A request whose drafts were underconfident
    (accepted more than their scores said) leaves a long-run exponent below 1; a new request
    must not verify weak drafts on that borrowed optimism: its first trees are priced by its
    drafts' own scores against the cost table (here 0.12 per node cannot pay for a row at
    1.1 plain decodes). Once the request's own verified trees show its drafts underconfident,
    the same drafts are verified."""
    from localspec.costmodel import CostModel

    pol = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=64)
    earlier = pol.calibration.for_request()
    for _ in range(20):  # verified 3-node chains scored 0.5 per node, every draft accepted
        earlier.observe(0.5 ** np.arange(1, 4), 3)
    assert earlier.exponent() < 1.0
    pol.calibration.end_request(earlier)
    assert pol.calibration.log_center < 0.0  # the long-run exponent is below 1 now
    weak = chain_with(0.12, 6)
    new = pol.calibration.for_request()
    assert pol.choose(weak, calibration=new).n_nodes == 1  # step 1: no tree
    for _ in range(5):  # the request's own trees: underconfident too
        new.observe(np.array([0.12, 0.12**2]), 2)
    assert new.exponent() < 1.0
    assert pol.choose(weak, calibration=new).n_nodes > 1


def _auto_steps(pol, auto, model, script, pos, n_steps):
    """``n_steps`` steps of the engine's ``propose_one`` with ``auto`` over the token sequence
    ``script`` from ``pos`` (greedy: the target emits the script); returns (the steps on which
    the model drafted, the steps whose verified tree had drafts, the new position)."""
    from localspec.policy import accepted_length
    from localspec.step import propose_one

    cal = pol.calibration.for_request()
    drafted, verified = [], []
    for i in range(n_steps):
        before = model.extends
        p = propose_one(pol, auto, script[pos - 1], 16, 16, adaptive=True, calibration=cal)
        n = accepted_length(p.tree, script[pos : pos + 17])
        emitted = script[pos : pos + n + 1]
        auto.observe(p.candidate, emitted)
        auto.accept(emitted)
        cal.observe(np.asarray(p.tree.score[1:], dtype=np.float64), n)
        b = p.tree.n_nodes  # the step's time as the engine measures it: the cost table's
        pol.observe_step(b, pol.cost.t_decode_us(b), pol.host_us(b))
        pos += len(emitted)
        if model.extends > before:
            drafted.append(i)
        if p.tree.n_nodes > 1:
            verified.append(i)
    return drafted, verified, pos


def test_a_model_drafter_that_does_not_pay_is_probed_at_bounded_cost_and_comes_back():
    """``auto`` (issue 30, part 4): a model drafter whose drafts are never accepted is probed
    after gaps that double from ``explore_every`` (32) steps: after warm-up it drafts on at
    most ``explore_budget`` (1%) of the steps (it drafted on every 32nd before: 3%). When its
    drafts become right, the next probe brings it back: it then drafts, and is verified, on
    nearly every step."""
    from localspec.drafters.auto import AutoDrafter
    from localspec.drafters.ngram import NgramDrafter
    from helpers import ScriptedModelDrafter

    from localspec.costmodel import CostModel

    script = list(range(1000, 9000))  # no token repeats: the n-grams never draft
    pol = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)  # probes cheaper than a step
    model = ScriptedModelDrafter(script, level_us=1000.0, right=False)
    auto = AutoDrafter(model, NgramDrafter())
    auto.begin(script[:20])
    warm, n_steps = 200, 3000
    drafted, verified, pos = _auto_steps(pol, auto, model, script, 20, n_steps)
    assert drafted[0] == 0 and set(verified) <= set(drafted)  # only the probes verified drafts
    after = [i for i in drafted if i >= warm]
    assert 1 <= len(after) <= pol.explore_budget * (n_steps - warm) + 1, drafted
    model.right = True
    drafted, verified, _ = _auto_steps(pol, auto, model, script, pos, 300)
    first = drafted[0]
    assert first <= pol.max_explore_gap(model.stats, TreeShape(2, 1, 4))
    assert len(drafted) >= 0.9 * (300 - first) and len(verified) >= 0.9 * (300 - first - 1)


def _requests(pol, auto, model, script, pos, n_requests, n_steps):
    """``n_requests`` requests of ``n_steps`` steps each (``_auto_steps`` after ``begin`` on
    the script so far); returns (the number of the request of each step the model drafted,
    the new position)."""
    drafted_in = []
    for r in range(n_requests):
        auto.begin(script[:pos])
        drafted, _, pos = _auto_steps(pol, auto, model, script, pos, n_steps)
        drafted_in += [r] * len(drafted)
    return drafted_in, pos


def test_probes_of_a_head_that_never_pays_are_bounded_over_the_drafters_life_not_per_request():
    """``auto`` over 40 requests of 30 steps with a head whose drafts are never accepted and
    whose probe costs about 4 steps, most of it the catch-up of its first level (16 positions
    at 2 ms): the first request of the fresh drafter probes it once, and from then on the
    measured cost of all probes (drafting with the catch-up, and the rows they add) stays
    within ``explore_budget`` of the measured step time since, across requests: 4 probes in
    all, not one per request (a per-request reset of the exploration state probes every
    request). Its reported drafting times, catch-up included, are what was charged."""
    from localspec.costmodel import CostModel
    from localspec.drafters.auto import AutoDrafter
    from localspec.drafters.ngram import NgramDrafter
    from helpers import ScriptedModelDrafter

    script = list(range(1000, 9000))  # no token repeats: the n-grams never draft
    pol = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)
    model = ScriptedModelDrafter(script, level_us=1000.0, catch_up_us=2000.0, right=False)
    auto = AutoDrafter(model, NgramDrafter())
    drafted_in, pos = _requests(pol, auto, model, script, 20, 40, 30)
    st = model.stats
    assert drafted_in[0] == 0  # a new head is tried on the first request
    assert len(drafted_in) == st.n_probes and len(set(drafted_in)) == len(drafted_in)  # one probe per request at most
    first = model.draft_us[0]
    assert first >= 16 * 2000.0  # its first level wrote 16 positions
    assert sum(model.draft_us) <= st.explore_spent_us  # every probe's measured drafting time is charged
    assert st.explore_spent_us - first <= pol.explore_budget * (pol.t_steps_us - st.explore_from_us)
    assert 2 <= len(drafted_in) <= 1 + pol.explore_budget * pol.t_steps_us / min(model.draft_us), drafted_in
    assert len(drafted_in) <= 40 // 8, drafted_in


def test_a_head_that_pays_again_is_used_within_the_gap_of_its_probes():
    """After 3,000 steps whose probes of the head failed, its drafts become right: the next
    probe, at most as far as the longest gap between the failed probes (steps), pays, and the
    head drafts on nearly every step from then on, in the same request and the next."""
    from localspec.costmodel import CostModel
    from localspec.drafters.auto import AutoDrafter
    from localspec.drafters.ngram import NgramDrafter
    from helpers import ScriptedModelDrafter

    script = list(range(1000, 20000))
    pol = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)
    model = ScriptedModelDrafter(script, level_us=1000.0, catch_up_us=1000.0, right=False)
    auto = AutoDrafter(model, NgramDrafter())
    auto.begin(script[:20])
    drafted, _, pos = _auto_steps(pol, auto, model, script, 20, 3000)
    gaps = np.diff(drafted)
    assert len(drafted) >= 3 and gaps.min() >= pol.explore_every
    model.right = True
    drafted, verified, pos = _auto_steps(pol, auto, model, script, pos, int(gaps.max()) + 100)
    first = drafted[0]
    assert first <= gaps.max(), (first, gaps)
    n = len(range(first, int(gaps.max()) + 100))
    assert len(drafted) >= 0.9 * n and len(verified) >= 0.9 * (n - 1)
    auto.begin(script[:pos])
    drafted, _, _ = _auto_steps(pol, auto, model, script, pos, 50)
    assert drafted[:3] == [0, 1, 2] and len(drafted) >= 45


def test_probes_cost_at_most_the_exploration_budget_of_the_time():
    """The longest gap between probes: probes on at most 1% of the steps, and, where a probe
    (the model's drafting time and the rows it verifies) costs more than a plain step, their
    cost at most 1% of the time of the plain steps between them; an expensive probe waits
    that long from the first gap on, a cheap one doubles its gaps from ``explore_every``."""
    from localspec.costmodel import CostModel

    stats = ModelDraftStats(t_draft_us=500.0, n_steps=5)
    shape = TreeShape(2, 1, 4)
    cheap = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)
    assert cheap.probe_us(stats, shape) < cheap.step_us(1) and cheap.max_explore_gap(stats, shape) == 100
    for pol in (SpeculationPolicy(fixed_cost_model(), max_nodes=16), cheap):
        pol.cost.observe_draft_levels([30000.0, 30000.0])  # two levels of 30 ms each
        gap = pol.max_explore_gap(stats, shape)
        probe_us = pol.probe_us(stats, shape)
        assert probe_us > pol.step_us(1)
        assert probe_us / (gap * pol.step_us(1)) <= pol.explore_budget < probe_us / ((gap - 1) * pol.step_us(1))
        assert pol.explore_gap_due(stats, shape) == gap  # the first gap already pays for the probe
    fresh = ModelDraftStats(t_draft_us=500.0, n_steps=5)
    flat = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)
    gaps = []
    for _ in range(5):  # a probe of one node, about 0.15 of a step
        fresh.explore_gap = flat.next_explore_gap(fresh)
        gaps.append(fresh.explore_gap)
    assert gaps == [32, 64, 100, 100, 100]


def test_the_gap_before_a_probe_follows_its_measured_cost_not_the_first_tries_estimate():
    """A first try is priced as verifying its whole planned tree (``probe_us``: 16 nodes and
    two 30 ms levels, several plain steps: hundreds of steps of gap at a 1% budget); where
    ``select_model_nodes`` verified only the root and the drafting cost 4 ms, the next probe
    is due after the gap that cost fits in (``explore_gap_due``), not the first estimate's;
    and a later probe measured dear lengthens the gap again."""
    from localspec.costmodel import CostModel

    pol = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)
    pol.cost.observe_draft_levels([30000.0, 30000.0])
    stats, shape = ModelDraftStats(t_draft_us=60000.0, n_steps=1), TreeShape(2, 8, 16)
    estimate = pol.explore_gap_due(stats, shape)
    assert estimate == math.ceil(pol.probe_us(stats, shape) / (pol.explore_budget * pol.step_us(1))) > 500
    stats.explore_gap = pol.next_explore_gap(stats)  # stored at the try: the doubling alone
    stats.last_probe_us = 4000.0  # measured: drafting only, no row beyond the plain step's
    assert pol.explore_gap_due(stats, shape) == max(pol.explore_every, math.ceil(4000.0 / (pol.explore_budget * pol.step_us(1))))
    assert pol.explore_gap_due(stats, shape) < estimate / 10
    stats.steps_since_run = pol.explore_gap_due(stats, shape)
    stats.explore_from_us, pol.t_steps_us = 0.0, stats.steps_since_run * pol.step_us(1)
    assert pol.probe_due(stats, shape) and not pol.probe_due(replace(stats, steps_since_run=stats.steps_since_run - 1), shape)
    stats.last_probe_us = 90000.0
    assert pol.explore_gap_due(stats, shape) == math.ceil(90000.0 / (pol.explore_budget * pol.step_us(1)))


def test_depths_below_what_the_emitted_tokens_tested_are_not_counted_as_rejected():
    """A chain of 6 of which the policy verified one node: the target accepted it and its own
    next token is the model's second node (2 emitted, both along the chain). Depths 1 and 2
    were tried and accepted; depths 3-6 were never tested, so they count neither way. A step
    whose second emitted token left the chain tried depth 2 and rejected it."""
    st = ModelDraftStats()
    st.observe_accept(2, depth=6, n_emitted=2)
    assert st.depth_tried[:3] == [1.0, 1.0, 0.0] and st.depth_ok[:3] == [1.0, 1.0, 0.0]
    st = ModelDraftStats()
    st.observe_accept(1, depth=6, n_emitted=2)
    assert st.depth_tried[:3] == [1.0, 1.0, 0.0] and st.depth_ok[:3] == [1.0, 0.0, 0.0]
    st = ModelDraftStats()
    st.observe_accept(6, depth=6, n_emitted=7)  # the whole chain verified and accepted
    assert st.depth_tried[:7] == [1.0] * 6 + [0.0] and st.depth_ok[:6] == [1.0] * 6


def test_a_head_needs_features_only_where_it_may_draft_soon():
    """``needs_features``: the step pauses the feature tap for a head that pays on no step (not
    even against a plain one) while its next probe is more than ``feature_lead`` steps away;
    a head never tried, one that would pay, and one whose probe is that close get the rows."""
    from localspec.costmodel import CostModel

    pol = SpeculationPolicy(CostModel(dict(FLAT_COSTS_US)), max_nodes=16)
    shape = TreeShape(2, 1, 4)
    new = ModelDraftStats(t_draft_us=500.0)
    assert pol.needs_features(new)  # never planned with: no shape yet
    new.last_shape = shape
    assert pol.needs_features(new)  # never tried: the first plan probes it
    idle = ModelDraftStats(t_draft_us=500.0, n_steps=3, n_probes=3, accept_length=0.0, gain_length=0.0,
                           explore_gap=64, explore_from_us=0.0, last_shape=shape)  # fmt: skip
    pol.t_steps_us = 1e9  # the budget is no limit here: the gap is
    idle.steps_since_run = 10
    assert not pol.needs_features(idle)
    idle.steps_since_run = 64 - pol.feature_lead - 1
    assert not pol.needs_features(idle)
    idle.steps_since_run = 64 - pol.feature_lead
    assert pol.needs_features(idle) and not pol.probe_due(idle, shape)  # rows from feature_lead steps ahead
    pol.t_steps_us = 0.0  # and a probe out of budget is not due however long the gap
    idle.steps_since_run = 1000
    assert not pol.needs_features(idle)
    paying = ModelDraftStats(t_draft_us=500.0, n_steps=3, accept_length=3.0, gain_length=3.0, last_shape=shape)
    assert pol.needs_features(paying)  # 4 tokens for about 1.5 plain steps


class _SureNgrams:
    """An n-gram part that proposes a fixed chain with high raw scores."""

    def __init__(self, tokens, scores):
        self.tokens, self.scores, self.history = list(tokens), list(scores), []

    def begin(self, history, context=()):
        self.history = list(history)

    def propose(self, max_depth, max_nodes):
        return TokenTree.chain(self.history[-1], self.tokens, TokenSource.NGRAM, self.scores)

    def observe(self, tree, emitted):
        pass

    def accept(self, tokens):
        self.history.extend(tokens)

    def close(self):
        pass


def test_auto_verifies_the_models_own_tree_where_its_ngrams_would_verify_nothing():
    """``auto`` on a step whose n-gram chain the request's calibration rejects (its n-gram trees
    failed: exponent far above 1, the raw 0.95 worth about 0.6): the merged tree's node that
    both drafted carries the n-gram's raw 0.95, the head's own score is 0.1. The step verifies
    the head's own tree by its own scores, so nothing (not the merged node on the n-gram's
    uncalibrated score), and the head's gain when its draft is then emitted is all of it (the
    unverified n-gram match is no baseline). (It failed when the merged tree was verified: 2
    nodes; and with the n-gram tree as the baseline: gain 0.)"""
    from helpers import ScriptedModelDrafter
    from localspec.drafters.auto import AutoDrafter
    from localspec.step import propose_one

    pol = SpeculationPolicy(fixed_cost_model(), max_nodes=64)
    for _ in range(20):
        pol.calibration.observe(np.array([0.9, 0.85, 0.8]), 0)
    script = [5, 6, 7, 40, 41, 42]
    model = ScriptedModelDrafter(script, right=True, score=0.1)
    auto = AutoDrafter(model, _SureNgrams([40, 77], [0.95, 0.9]))
    auto.begin(script[:3])
    p = propose_one(pol, auto, 7, 8, 64, calibration=pol.calibration)
    assert p.model_step and p.candidate.n_nodes > 2  # merged: the head's chain and the n-gram's 77
    assert p.tree.n_nodes == 1, p.tree.n_nodes
    auto.observe(p.candidate, [40])  # the target emitted the head's (and the n-grams') 40
    assert model.stats.accept_length == 1.0 and model.stats.gain_length == 1.0
