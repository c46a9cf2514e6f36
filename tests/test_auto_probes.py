"""``auto`` with a model drafter that does not pay: rare probes, plain decoding's tokens, and
the model back once its drafts are right (issue 30, part 4), on the real default model."""

from __future__ import annotations

import pytest

from conftest import frozen_cost_model
from helpers import PlainReferences, ScriptedModelDrafter, assert_same_as_plain
from localspec import Engine, SamplingParams
from localspec.drafters.auto import AutoDrafter
from localspec.drafters.ngram import NgramDrafter
from localspec.tree import TokenSource

GREEDY = SamplingParams.greedy(seed=0)
TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
_PLAIN = PlainReferences()


def _plain(e, prompt, n):
    """Plain greedy decoding's tokens of ``prompt`` (a fresh cache), once per module."""

    def run(eng, p, k, sampling):
        eng.reset()
        return eng.generate(p, max_tokens=k, sampling=sampling, speculative=False).token_ids

    return _PLAIN.get(run, e, prompt, n, GREEDY)


def test_auto_probes_a_model_that_does_not_pay_rarely_and_takes_it_back_when_right(model):
    """A scripted model drafter whose drafts are wrong drafts only on the policy's probes
    (gaps of at least ``explore_every``, 4 here, long enough that a probe's rows cost at most
    10% of the steps between: 15 or so, about 4 of 64 steps; every 5th step before), and the
    output is plain decoding's, and the failed probes leave the score calibration alone; with
    its drafts right, its next probe pays and it drafts most of the tokens from there on, still
    plain decoding's, and its steps still leave the calibration (of the n-gram scores) alone.
    When that probe comes depends on measured step times (the probes' budget is a share of
    them), so the second request is long enough for a probe after the longest gap. The table
    is nearly flat (a GPU's up to 8 tokens): there one right probe, the estimate's only
    observation after it, is enough to bring the model back (on a steep CPU table it is not:
    drafters.md, "probes")."""
    # held fixed (frozen_cost_model): the test is of the probes, not of this machine's batch costs
    flat = frozen_cost_model({b: 11900.0 * (1.0 + 0.02 * (b - 1)) for b in (1, 2, 3, 4, 8, 16, 32, 64)})
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=flat)
    try:
        prompt = e.tokenize(TEXT)
        ref = e.generate(prompt, max_tokens=160, sampling=GREEDY, speculative=False)
        m = ScriptedModelDrafter(prompt + ref.token_ids, right=False)
        # an n-gram part that drafts nothing (greedy Gemma 3 270M repeats itself: the n-grams
        # would draft most of the answer and leave the model few steps)
        e.set_drafter(AutoDrafter(m, NgramDrafter(max_occurrences=0)))
        e.policy.explore_every, e.policy.explore_budget = 4, 0.1
        e.reset()
        res = e.generate(prompt, max_tokens=64, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids[:64], res.token_ids)
        n_steps = res.stats.n_steps
        assert n_steps >= 40 and 3 <= m.extends <= 8, (n_steps, m.extends)
        # the failed probes are no evidence about the request's drafts: its score calibration
        # saw no verified tree, and the long-run exponent the next request starts from is 1
        assert e.policy.calibration.log_center == 0.0
        m.right = True
        m.extends = 0
        e.reset()
        res = e.generate(prompt, max_tokens=160, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        # its next probe comes within the longest gap (max_explore_gap: about 35 steps here) and
        # from there the model drafts nearly every token: chains of several right tokens a step
        first = res.sources.index(TokenSource.DRAFT_MODEL) if TokenSource.DRAFT_MODEL in res.sources else None
        assert first is not None and first <= 100, res.stats.token_sources
        after = res.sources[first:]
        assert after.count(TokenSource.DRAFT_MODEL) >= 0.7 * len(after), res.stats.token_sources
        # nor are the model's paying steps: the calibration is of the n-gram scores
        assert e.policy.calibration.log_center == 0.0
    finally:
        e.close()


QUESTIONS = [
    "Name three rivers in Europe.",
    "What is the boiling point of water at sea level?",
    "Give a synonym for happy.",
    "Translate 'good morning' into French.",
    "What is seven times eight?",
    "Who wrote Hamlet?",
    "List two primary colours.",
    "What does a thermometer measure?",
]


def _count_head_work(head) -> list[int]:
    """A counter of the head's computations: llama.cpp calls on its context (``runtime="llama"``)
    or the host runtime's level parts (``runtime="host"``)."""
    count = [0]
    for name in ("_host_root_part", "_host_frontier_part"):
        fn = getattr(head, name)

        def counted(*args, _fn=fn, **kw):
            count[0] += 1
            return _fn(*args, **kw)

        setattr(head, name, counted)
    return count


@pytest.mark.parametrize("runtime", ["host", "llama"])
def test_a_head_that_never_pays_is_probed_within_the_budget_over_requests_not_once_each(model, random_head_path, runtime):
    """``auto`` with an untrained EAGLE-3 head over 8 requests on one engine (as ``localspec
    bench`` and a server keep their drafter): the head is tried on the fresh engine's first
    request, and then only when the measured cost of its probes (drafting with the catch-up
    of its level 0, and the rows they add) stays within ``explore_budget`` of the engine's
    measured step time since: a request whose probe is not due makes no call at all on the
    head's context (no catch-up, no level 0). Fewer probes than requests (a per-request
    reset of the exploration state probes each one), every output plain decoding's."""
    from localspec.drafters.eagle3 import Eagle3Drafter

    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    try:
        prompts = [e.tokenize(q) for q in QUESTIONS]
        refs = [_plain(e, p, 24) for p in prompts]  # shared by both runtimes
        head = Eagle3Drafter(random_head_path, runtime=runtime)
        e.set_drafter(AutoDrafter(head, NgramDrafter(max_occurrences=0)))
        assert head.runtime == runtime, head.runtime_reason
        host_work = _count_head_work(head)

        def head_calls() -> int:
            return host_work[0] if runtime == "host" else head.ctx.n_calls

        touched = []  # per request: (calls on the head's context, probes)
        first_us = 0.0
        for p, ref in zip(prompts, refs):
            e.reset()
            calls0, probes0 = head_calls(), head.stats.n_probes
            res = e.generate(p, max_tokens=24, sampling=GREEDY)
            assert_same_as_plain(e, p, ref, res.token_ids)
            touched.append((head_calls() - calls0, head.stats.n_probes - probes0))
            first_us = first_us or head.stats.explore_spent_us  # the first request's probe, as measured
        st = head.stats
        assert touched[0][0] > 0 and touched[0][1] == 1, touched  # a new head is tried
        assert all((calls > 0) == (probes > 0) for calls, probes in touched), touched  # no probe: no head call
        assert st.n_steps == st.n_probes < len(prompts), touched  # it never paid; fewer probes than requests
        # the probes after the first (measured: drafting with the catch-up, and rows) within 1%
        # of the steps' measured time since the head was first planned with
        assert st.explore_spent_us - first_us <= e.policy.explore_budget * (e.policy.t_steps_us - st.explore_from_us)
    finally:
        e.close()


def test_the_tap_pauses_while_a_head_that_never_pays_waits_for_its_probes(model, random_head_path):
    """``auto`` with an untrained EAGLE-3 head and n-grams that draft nothing: between probes the
    step decodes with the feature tap paused (``SpeculationPolicy.needs_features``: the head
    does not pay even against a plain step, and no probe is due within ``feature_lead``
    steps), so most decodes capture no rows; the tap resumes ``feature_lead`` steps before
    each probe and the head, its context restarted after the gap, drafts again. The output
    is plain decoding's."""
    from localspec.drafters.eagle3 import Eagle3Drafter

    e = Engine(model, drafter="none", n_ctx=2048, cost_model=frozen_cost_model())
    try:
        prompt = e.tokenize(TEXT)
        ref = e.generate(prompt, max_tokens=96, sampling=GREEDY, speculative=False)
        head = Eagle3Drafter(random_head_path)
        e.set_drafter(AutoDrafter(head, NgramDrafter(max_occurrences=0)))
        e.policy.explore_every, e.policy.explore_budget = 4, 0.1
        e.reset()
        tap = e._tap
        decodes0 = tap.n_decodes  # decodes whose rows were taken: the prompt's and the steps' with the tap on
        res = e.generate(prompt, max_tokens=96, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        n_steps, with_rows = res.stats.n_steps, tap.n_decodes - decodes0 - 1  # the prompt: one decode
        st = head.stats
        assert n_steps >= 80 and st.n_steps == st.n_probes >= 3, (n_steps, st.n_probes)  # probes after gaps
        assert with_rows <= n_steps // 2, (with_rows, n_steps)  # paused on most steps
        assert with_rows >= st.n_probes  # resumed before each probe
        assert head.kv_first > 0  # the head's context restarted after a gap
    finally:
        e.close()


def test_an_unsure_heads_drafts_are_not_verified_and_its_measured_worth_stops_it(model, random_head_path, monkeypatch):
    """An untrained EAGLE-3 head drafting alone, on a nearly flat cost table (where every row
    is cheap and the old rule verified the whole tree of a model step): its drafts are unsure
    (its acceptance tracker scores them by their low confidence), so a model step verifies
    only the root (``SpeculationPolicy.select_model_nodes``), having paid the drafting; that
    step's measured worth (one token for more than a plain step's time: ``value`` below 1)
    stops the head until its next probe. Outputs are plain decoding's. (With the plan's size
    verified on every model step, its first step verified its whole tree of 9 nodes.)"""
    import localspec.step as step_mod
    from localspec.drafters.eagle3 import Eagle3Drafter

    flat = frozen_cost_model({b: 11900.0 * (1.0 + 0.02 * (b - 1)) for b in (1, 2, 3, 4, 8, 16, 32, 64)})
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=flat)
    verified = []  # (candidate nodes, verified nodes) of every step that drafted something
    real = step_mod.verified_tree

    def counted(cand, n, root, n_scratch=None):
        tree = real(cand, n, root, n_scratch)
        if cand is not None and cand.n_nodes > 1:
            verified.append((cand.n_nodes, tree.n_nodes))
        return tree

    monkeypatch.setattr(step_mod, "verified_tree", counted)
    try:
        prompts = [e.tokenize(q) for q in QUESTIONS[:3]]
        refs = [e.generate(p, max_tokens=40, sampling=GREEDY, speculative=False).token_ids for p in prompts]
        head = Eagle3Drafter(random_head_path)
        e.set_drafter(head)
        for p, ref in zip(prompts, refs):
            e.reset()
            res = e.generate(p, max_tokens=40, sampling=GREEDY)
            assert_same_as_plain(e, p, ref, res.token_ids)
        st = head.stats
        assert verified and all(v == 1 for _, v in verified), verified  # drafted, never verified
        assert st.n_steps >= 1 and st.n_value >= 1, (st.n_steps, st.n_value)
        assert st.value < 1.0, st.value  # one token a step, for the drafting on top of a plain step
        assert st.n_steps == st.n_probes, (st.n_steps, st.n_probes)  # after that, only its probes
    finally:
        e.close()
