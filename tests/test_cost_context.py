"""The cost model's context term: a verified row costs more after a long context than after
the table's (``CostModel.set_context``, ``context_scale``). Timings are a scripted machine
fed to ``observe``, never the real clock; one test checks that the step tells the model its
context on the real default model."""

import pytest

from conftest import FIXED_COSTS_US, frozen_cost_model
from localspec.costmodel import CostModel

T1 = FIXED_COSTS_US[1]


def excess_scale(n_tokens: int) -> float:
    """The scripted machine: the excess of a batch's ratio over one token grows with the
    context, as on the 2-core Xeon but steeper (the same below 512 tokens as at the table's
    256, then 1.4x, 1.8x from 1,024 and 2.1x from 2,048, where the Xeon measured about 1.2-1.3x
    past 512), so that a price learned in the wrong bucket is far off; t(1) does not move."""
    return 1.0 if n_tokens < 512 else 1.4 if n_tokens < 1024 else 1.8 if n_tokens < 2048 else 2.1


def true_us(b: int, n_tokens: int) -> float:
    r = FIXED_COSTS_US[b] / T1
    return T1 * (1.0 + (r - 1.0) * excess_scale(n_tokens))


def feed(cm: CostModel, n_tokens: int, sizes=(1, 2, 4, 8), rounds: int = 6) -> None:
    cm.set_context(n_tokens)
    for _ in range(rounds):
        for b in sizes:
            cm.observe(b, true_us(b, n_tokens))


def rel_err(cm: CostModel, b: int, n_tokens: int) -> float:
    cm.set_context(n_tokens)
    return abs(cm.t_decode_us(b) / true_us(b, n_tokens) - 1.0)


def test_context_buckets_double_from_twice_the_tables_context():
    cm = CostModel(dict(FIXED_COSTS_US), context_ref=256)
    assert [cm.context_bucket(n) for n in (0, 256, 511, 512, 1023, 1024, 2047, 2048, 4096)] == [0, 0, 0, 1, 1, 2, 2, 3, 4]
    assert cm.context_scale(3) == 1.0  # nothing learned: the table's


def test_rows_after_a_long_context_are_priced_from_the_decodes_there_and_short_ones_keep_the_table():
    cm = CostModel(dict(FIXED_COSTS_US), context_ref=256)
    feed(cm, 300, sizes=(1,))
    feed(cm, 1500)
    # sizes never decoded at 1,500 tokens take the scale their neighbours taught
    for b in (3, 12, 16):
        assert rel_err(cm, b, 1500) < 0.03, (b, cm.t_decode_us(b), true_us(b, 1500))
    assert cm.context_scale(cm.context_bucket(1500)) == pytest.approx(1.8, rel=0.05)  # shrunk by one pseudo-observation
    # what the long context taught does not price the rows of a short one
    for b in (2, 4, 8, 16):
        assert rel_err(cm, b, 300) < 0.03, (b, cm.t_decode_us(b), true_us(b, 300))
    # a longer context than any seen starts from the nearest one below (the growth is monotone)
    cm.set_context(3000)
    assert cm.ratio(8) == pytest.approx(true_us(8, 1500) / T1, rel=0.03)


def test_requests_that_alternate_short_and_long_contexts_are_each_priced_at_theirs():
    """A server or a benchmark mixing short and long prompts: one model learns every bucket,
    and each request's rows are priced at its own context."""
    cm = CostModel(dict(FIXED_COSTS_US), context_ref=256)
    for _ in range(5):
        for n in (200, 700, 1500, 2500):
            feed(cm, n, rounds=2)
    for n in (200, 700, 1500, 2500):
        for b in (2, 4, 8, 16):
            assert rel_err(cm, b, n) < 0.05, (n, b, cm.t_decode_us(b), true_us(b, n))


def test_a_load_that_falls_forgets_the_scale_it_taught():
    """A bucket's scale learned in a burst of load (its large batches slowed most) is dropped
    when the load falls, as the per-size ratios are (``CostModel.load_fell_since``)."""
    cm = CostModel(dict(FIXED_COSTS_US), context_ref=256)
    cm.set_context(1500)
    for _ in range(8):
        cm.observe(1, 3.0 * T1)
        cm.observe(8, 3.0 * true_us(8, 1500) * 1.6)
    assert cm.context_scale() > 2.0
    for _ in range(20):
        cm.observe(1, T1)
    assert cm.context_scale() == 1.0


def test_the_step_prices_its_rows_at_the_requests_context(model):
    from localspec import Engine

    cm = frozen_cost_model()
    e = Engine(model, drafter="ngram", n_ctx=2048, cost_model=cm)
    try:
        prompt = " ".join(["the cat sat on the mat and looked at the door"] * 60)
        n_prompt = len(e.tokenize(prompt))
        assert n_prompt > 600
        e.generate(prompt, max_tokens=4)
        assert n_prompt - 1 <= cm.context <= n_prompt + 4  # the prompt but its last token (the root), then the steps' tokens
        assert cm.context_bucket() == 1
    finally:
        e.close()


def test_bounds_are_priced_at_the_current_context_right_after_an_observation():
    """``min_ratio`` (the allocation's cost floor) from plain steps up, straight after a decode
    was fed back (every bucket's curve is rebuilt then), at a short and a long context."""
    cm = CostModel(dict(FIXED_COSTS_US), context_ref=256)
    feed(cm, 1500, rounds=2)
    for n in (1500, 300):
        cm.set_context(n)
        cm.observe(1, T1)
        assert cm.min_ratio(1, 16) == 1.0
        assert cm.min_ratio(2, 16) == pytest.approx(min(cm.ratio(b) for b in (2, 3, 4, 8, 12, 16)))
    cm.set_context(1500)
    assert cm.min_ratio(8, 8) == pytest.approx(true_us(8, 1500) / T1, rel=0.05)
