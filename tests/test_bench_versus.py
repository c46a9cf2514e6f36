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
    rows = compare_drafters(model, prompts, labels, max_tokens=12)
    (row,) = rows
    assert row["ngram"]["identical"] and row["ngram#2"]["identical"]
    assert row["ngram"]["n_generated_tokens"] == row["ngram#2"]["n_generated_tokens"] > 0
    for name in labels:  # every emitted token has exactly one source
        assert sum(row[name]["token_sources"].values()) == row[name]["n_generated_tokens"]
        assert 0 < row[name]["n_steps"] <= row[name]["n_generated_tokens"]
    (cat, total) = summarize_versus(rows, labels)
    assert cat["category"] == "qa" and set(labels) <= set(cat) and total["category"] == "all"
    assert total["ngram"]["token_sources"] == row["ngram"]["token_sources"]


def test_repeats_time_every_engine_in_every_round(model):
    prompts = [BenchPrompt("qa", "qa", 1, "Question: Name three rivers in Europe.\nAnswer:")]
    rows = compare_drafters(model, prompts, ["ngram"], max_tokens=8, repeats=3)
    (row,) = rows
    for name in ("plain", "ngram"):
        times = row[name]["t_decode_us_rounds"]
        assert len(times) == 3 and all(t > 0 for t in times)
        assert row[name]["t_decode_us"] == pytest.approx(sum(times) / 3)
    assert row["ngram"]["identical"]
    with pytest.raises(ValueError, match="repeats"):
        compare_drafters(model, prompts, ["ngram"], max_tokens=8, repeats=0)
