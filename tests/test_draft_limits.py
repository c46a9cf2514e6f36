"""Per-request draft limits (llama.cpp's speculative.n_max / p_min as ``DraftLimits``): the tree
surgery, and the engine and the batch scheduler honouring them, output unchanged."""

import numpy as np
import pytest

from conftest import frozen_cost_model
from localspec import Engine, SamplingParams
from localspec.draft_limits import DraftLimits
from localspec.scheduler import BatchScheduler
from localspec.tree import TokenSource, TreeBuilder

# the n-gram drafter finds long continuations in text that repeats itself
PROMPT = "alpha beta gamma delta epsilon zeta eta theta, " * 6 + "alpha beta"
N = 48


def tree_of_scores():
    """root ─ a(.9) ─ b(.5) ─ c(.4);  a ─ d(.2);  root ─ e(.3)"""
    b = TreeBuilder(1)
    a = b.add(0, 10, source=TokenSource.NGRAM, score=0.9)
    bb = b.add(a, 11, source=TokenSource.NGRAM, score=0.5)
    b.add(bb, 12, source=TokenSource.NGRAM, score=0.4)
    b.add(a, 13, source=TokenSource.NGRAM, score=0.2)
    b.add(0, 14, source=TokenSource.NGRAM, score=0.3)
    return b.build()


def test_apply_cuts_by_score_then_count():
    t = tree_of_scores()
    assert DraftLimits().apply(t) is t
    assert sorted(DraftLimits(min_score=0.45).apply(t).token_ids[1:]) == [10, 11]
    assert sorted(DraftLimits(min_score=0.3).apply(t).token_ids[1:]) == [10, 11, 12, 14]
    assert sorted(DraftLimits(max_nodes=2).apply(t).token_ids[1:]) == [10, 11]
    assert sorted(DraftLimits(max_nodes=3, min_score=0.25).apply(t).token_ids[1:]) == [10, 11, 12]
    assert DraftLimits(max_nodes=0).apply(t).n_nodes == 1 and DraftLimits(min_score=1.0).apply(t).n_nodes == 1


def test_a_node_below_the_threshold_takes_its_subtree_along():
    b = TreeBuilder(1)
    a = b.add(0, 10, source=TokenSource.NGRAM, score=0.2)
    b.add(a, 11, source=TokenSource.NGRAM, score=0.9)  # higher than its parent: still cut with it
    assert DraftLimits(min_score=0.5).apply(b.build()).n_nodes == 1


def test_sampled_siblings_keep_a_prefix_of_their_draws():
    b = TreeBuilder(1)
    d = np.full(8, 1 / 8, dtype=np.float32)
    b.set_draft_dist(0, d)
    b.add(0, 3, source=TokenSource.DRAFT_MODEL, score=0.6, draft_prob=0.125)
    b.add(0, 4, source=TokenSource.DRAFT_MODEL, score=0.2, draft_prob=0.125)  # draw 1, below
    b.add(0, 5, source=TokenSource.DRAFT_MODEL, score=0.6, draft_prob=0.125)  # draw 2: dropped too
    t = DraftLimits(min_score=0.5).apply(b.build())
    assert t.token_ids.tolist() == [1, 3]


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        DraftLimits(max_nodes=-1)
    with pytest.raises(ValueError):
        DraftLimits(min_score=1.5)


@pytest.fixture(scope="module")
def exhaustive_engine(model):
    """Verifies every proposed tree (no adaptive sizing): what a limit cuts is what is drafted."""
    e = Engine(model, drafter="ngram", n_ctx=1024, cost_model=frozen_cost_model(), adaptive=False)
    yield e
    e.close()


def run_engine(engine, **kw):
    engine.reset()
    return engine.generate(PROMPT, max_tokens=N, sampling=SamplingParams.greedy(), **kw)


def run_sched(model, **kw):
    with BatchScheduler(model, parallel=1, n_ctx=512, cost_model=frozen_cost_model(), adaptive=False) as sched:
        job = sched.submit(model.tokenize(PROMPT, add_special=True), max_tokens=N, sampling=SamplingParams.greedy(), **kw)
        sched.run_until_idle()
        return job.wait()


@pytest.mark.parametrize("runner", ["engine", "scheduler"])
def test_limits_bound_what_is_drafted_and_change_no_output(runner, model, exhaustive_engine):
    def run(**kw):
        return run_engine(exhaustive_engine, **kw) if runner == "engine" else run_sched(model, **kw)

    plain = run(speculative=False)
    free = run()
    k = 2
    # without a limit the drafter's trees are larger than k somewhere: the limit below bites
    assert free.stats.num_draft_tokens > k * free.stats.n_spec_steps
    for limits in (DraftLimits(max_nodes=0), DraftLimits(min_score=1.0), DraftLimits(max_nodes=k),
                   DraftLimits(max_nodes=k, min_score=0.1)):  # fmt: skip
        r = run(draft_limits=limits)
        assert r.token_ids == plain.token_ids and r.text == plain.text
        st = r.stats
        if limits.max_nodes == 0 or limits.min_score == 1.0:
            assert st.num_draft_tokens == 0 and st.n_spec_steps == 0
        else:
            assert 0 < st.num_draft_tokens <= k * st.n_spec_steps
            assert st.drafted_per_depth[k:] == []  # no path deeper than k either
