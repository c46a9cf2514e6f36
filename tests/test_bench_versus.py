"""``localspec bench drafters --versus``: a drafter named twice runs two engines of it (an
A/A/B run shows the spread of a drafter against itself beside the drafter compared)."""

import pytest

from localspec.bench.dataset import BenchPrompt
from localspec.bench.drafters import compare_drafters, summarize_versus, versus_labels


def test_labels_number_the_repeats():
    assert versus_labels(["ngram", "ngram", "auto", "ngram"]) == ["ngram", "ngram#2", "auto", "ngram#3"]
    assert versus_labels(["ngram", "auto"]) == ["ngram", "auto"]


def test_a_drafter_named_twice_runs_on_two_engines(model):
    prompts = [BenchPrompt("qa", "qa", 1, "Question: Name three rivers in Europe.\nAnswer:")]
    labels = versus_labels(["ngram", "ngram"])
    configured = []
    rows = compare_drafters(model, prompts, labels, max_tokens=12, configure={"ngram#2": lambda e: configured.append(e.drafter_name)})
    assert configured == ["ngram"]  # the second engine only, once
    (row,) = rows
    assert row["ngram"]["identical"] and row["ngram#2"]["identical"]
    assert row["ngram"]["n_generated_tokens"] == row["ngram#2"]["n_generated_tokens"] > 0
    for name in labels:  # every emitted token has exactly one source
        assert sum(row[name]["token_sources"].values()) == row[name]["n_generated_tokens"]
        assert 0 < row[name]["n_steps"] <= row[name]["n_generated_tokens"]
    (cat, total) = summarize_versus(rows, labels)
    assert cat["category"] == "qa" and set(labels) <= set(cat) and total["category"] == "all"
    assert total["ngram"]["token_sources"] == row["ngram"]["token_sources"]
    assert cat["last_over_first_ci"] == pytest.approx([cat["last_over_first"]] * 2)  # one prompt: no spread


def test_repeats_time_every_engine_in_every_round(model):
    prompts = [BenchPrompt("qa", "qa", 1, "Question: Name three rivers in Europe.\nAnswer:")]
    rows = compare_drafters(model, prompts, ["ngram"], max_tokens=8, repeats=3)
    (row,) = rows
    for name in ("plain", "ngram"):
        times = row[name]["t_decode_us_rounds"]
        assert len(times) == 3 and all(t > 0 for t in times)
        assert row[name]["t_decode_us"] == pytest.approx(sorted(times)[1])  # the median round
    assert row["ngram"]["identical"]
    with pytest.raises(ValueError, match="repeats"):
        compare_drafters(model, prompts, ["ngram"], max_tokens=8, repeats=0)


def test_the_ratio_interval_covers_the_ratio_of_the_prompts_population():
    """``ratio_interval`` on 300 simulated runs of 30 prompts (times lognormal around 1 s,
    speed-ups lognormal around 1.05x with a 10% spread, correlated with nothing): the 95%
    interval holds the population's ratio of summed speeds (from a million prompts) in about
    95% of runs, not far more (an interval that resamples the two engines' prompts apart is
    much wider) nor far less; a run whose every prompt has the same ratio gets that ratio."""
    import numpy as np

    from localspec.bench.drafters import ratio_interval

    rng = np.random.default_rng(7)

    def draw(p):
        t_a = rng.lognormal(0.0, 0.3, p)
        return np.full(p, 128.0), t_a, np.full(p, 128.0), t_a / rng.lognormal(np.log(1.05), 0.1, p)

    n_a, t_a, n_b, t_b = draw(1_000_000)
    truth = t_a.sum() / t_b.sum()
    hits = 0
    for k in range(300):
        lo, hi = ratio_interval(*draw(30), n_boot=500, seed=k)
        assert lo <= hi
        hits += lo <= truth <= hi
    assert 0.88 <= hits / 300 <= 0.99, hits
    n, t = np.full(5, 100.0), np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert ratio_interval(n, t, n, t / 1.2) == pytest.approx((1.2, 1.2))
    assert ratio_interval(n[:1], t[:1], n[:1], t[:1] / 1.2) == pytest.approx((1.2, 1.2))
    # a prompt that ends at once (no tokens, a few ms: Spec-Bench question 243 on the default
    # model) among others: resamples of it alone have no ratio and are left out, not NaN
    n0, t0 = np.array([0.0, 100.0, 100.0]), np.array([0.02, 1.0, 2.0])
    assert ratio_interval(n0, t0, n0, t0 / 1.2, n_boot=500) == pytest.approx((1.2, 1.2))
