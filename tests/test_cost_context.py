"""The cost model's context term: a verified row costs more after a long context than after
the table's (``CostModel.set_context``, ``context_scale``). Timings are a scripted machine
fed to ``observe``, never the real clock; one test checks that the step tells the model its
context on the real default model."""

import numpy as np
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


def test_a_size_never_decoded_in_a_long_context_takes_the_scale_of_its_neighbours_not_of_two_rows():
    """The context does not scale every size alike (the Xeon, 2026-12-07: the excess of 2 rows
    grew 1.9x from 256 to 2,048 tokens, that of 8-16 rows 1.3x), and an `auto` engine's head
    steps verify 2 rows again and again. A bucket that saw 2 rows often and 12 rows a few
    times prices 8 and 16 rows from 12's scale: the old mean over the sizes observed, each
    weighing its observations, put 8 and 16 rows 27-29% above their cost."""
    cm = CostModel(dict(FIXED_COSTS_US), context_ref=256)

    def true_long(b: int) -> float:
        r = FIXED_COSTS_US[b] / T1
        return T1 * (1.0 + (r - 1.0) * (1.9 if b == 2 else 1.3))

    cm.set_context(1500)
    for i in range(20):
        cm.observe(1, T1)
        cm.observe(2, true_long(2))
        if i % 5 == 0:
            cm.observe(12, true_long(12))
    for b in (8, 16):
        assert abs(cm.t_decode_us(b) / true_long(b) - 1.0) < 0.10, (b, cm.t_decode_us(b), true_long(b))
    assert abs(cm.t_decode_us(2) / true_long(2) - 1.0) < 0.03


def test_a_table_wrong_for_large_batches_is_corrected_by_the_large_batches_observed():
    """A table right up to 4 rows and 25% too dear from 8 on (a calibration whose large
    batches ran in a burst): the many small steps observed say nothing of 16 rows, the
    decodes of 12 and 24 rows do. The old correction, one geometric mean over every size
    observed, left 16 rows 20% too dear."""
    table = {b: t * (1.25 if b >= 8 else 1.0) for b, t in FIXED_COSTS_US.items()}
    cm = CostModel(table, context_ref=256)
    cm.set_context(300)
    for i in range(20):
        cm.observe(1, T1)
        for b in (2, 3, 4):
            cm.observe(b, FIXED_COSTS_US[b])
        if i % 3 == 0:
            cm.observe(12, FIXED_COSTS_US[12])
            cm.observe(24, FIXED_COSTS_US[24])
    assert abs(cm.t_decode_us(16) / FIXED_COSTS_US[16] - 1.0) < 0.08, cm.t_decode_us(16)
    for b in (2, 3, 4):
        assert abs(cm.t_decode_us(b) / FIXED_COSTS_US[b] - 1.0) < 0.02, (b, cm.t_decode_us(b))


def test_a_kernel_of_no_width_and_a_batch_of_no_tokens_are_refused():
    """``size_width`` 0 would price every size as one token (a NaN clipped to 1)."""
    with pytest.raises(ValueError, match="size_width"):
        CostModel(dict(FIXED_COSTS_US), size_width=0.0)
    cm = CostModel(dict(FIXED_COSTS_US))
    for call in (lambda: cm.table_correction(0), lambda: cm.context_scale(2, -1)):
        with pytest.raises(ValueError, match="at least 1 token"):
            call()


def test_an_observation_keeps_the_curves_of_lower_buckets_and_prices_as_a_full_rebuild_would():
    """An observation drops only the cached curves of its own context bucket and the buckets
    above it (theirs are built from it); every price after any mix of buckets, sizes, bursts
    that are forgotten and a table that expires is the one a model rebuilding every curve and
    table ratio after each observation gives, bit for bit."""
    rng = np.random.default_rng(0)

    class Rebuilds(CostModel):
        def _invalidate(self, bucket: int = 0) -> None:
            super()._invalidate(0)
            self._table_ratios.clear()

    fast = CostModel(dict(FIXED_COSTS_US), context_ref=256, expire_after=30)
    full = Rebuilds(dict(FIXED_COSTS_US), context_ref=256, expire_after=30)
    n_tokens, burst, kept = 300, 1.0, 0
    for _ in range(1500):
        n_tokens = int(rng.integers(0, 4000)) if rng.random() < 0.05 else n_tokens + int(rng.integers(1, 8))
        if rng.random() < 0.03:
            burst = float(rng.choice([0.5, 1.0, 2.5]))  # 0.5: the table expires; 2.5 then 1: forgotten
        b = int(rng.choice([1, 1, 2, 3, 4, 8, 16]))
        t = true_us(b, n_tokens) * (1.25 if b > 1 else 1.0) * burst * float(rng.lognormal(0.0, 0.05))  # a table 20% cheap
        curve0 = fast._curves.get(0)
        for cm in (fast, full):
            cm.set_context(n_tokens)
            cm.observe(b, t)
        kept += curve0 is not None and fast._curves.get(0) is curve0
        for n in (n_tokens, 100, 900, 3000):
            fast.set_context(n)
            full.set_context(n)
            assert [fast.t_decode_us(s) for s in (1, 2, 3, 5, 8, 12, 16, 64)] == [full.t_decode_us(s) for s in (1, 2, 3, 5, 8, 12, 16, 64)]
            assert fast.min_ratio(2, 64) == full.min_ratio(2, 64)
        fast.set_context(n_tokens)
        full.set_context(n_tokens)
    rebased = fast.rebased
    for _ in range(40):  # a quiet machine beats the table where bucket 0 has learned its ratios: it expires
        for b in (1, 2, 4, 8):
            for cm in (fast, full):
                cm.set_context(300)
                cm.observe(b, 0.25 * true_us(b, 300) * (1.25 if b > 1 else 1.0))
    assert fast.rebased == full.rebased > rebased >= 1 and kept > 100  # and bucket 0's curve outlived observations above it
    for n in (100, 900):
        fast.set_context(n)
        full.set_context(n)
        assert [fast.t_decode_us(s) for s in (2, 3, 8, 64)] == [full.t_decode_us(s) for s in (2, 3, 8, 64)]
