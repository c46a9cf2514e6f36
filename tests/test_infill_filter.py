"""llama.cpp's infill sampler as a per-position candidate filter: what it keeps, and that
speculation with it stays lossless (adversarial drafters, greedy and seeded sampling)."""

import numpy as np
import pytest

from helpers import RandomDrafter
from localspec import SamplingParams
from localspec.errors import InvalidRequestError
from localspec.infill_filter import MAX_INFILL_CANDIDATES, InfillFilter

PROMPT = "def add_one(x):\n    return x + 1\n\n\ndef add_two(x):\n    return x + 2\n\n\ndef add_three(x):\n"


@pytest.fixture
def infill(model):
    f = InfillFilter(model)
    yield f
    f.close()


def test_text_tokens_that_prefix_others_absorb_them(model, infill):
    the, then, there = (model.tokenize(w, add_special=False)[0] for w in (" the", " then", " there"))
    ids = np.array([the, then, there, 100, 200], dtype=np.int64)
    logits = np.array([2.0, 1.5, 1.0, -3.0, -3.0], dtype=np.float32)
    out_ids, out_logits = infill(ids, logits)
    # " then" and " there" merge into " the", whose probability passes 0.2; the rest drops
    assert list(out_ids) == [the] and out_logits[0] == 2.0


def test_end_of_generation_wins_when_likely_enough(model, infill):
    ids = np.array([model.eos, 500, 600, 700], dtype=np.int64)
    out_ids, _ = infill(ids, np.array([3.0, 1.0, 1.0, 1.0], dtype=np.float32))
    assert list(out_ids) == [model.eos]


def test_no_confident_text_token_gives_end_of_text(model, infill):
    ids = np.arange(1000, 1040, dtype=np.int64)  # 40 candidates, none near 0.2
    out_ids, _ = infill(ids, np.zeros(40, dtype=np.float32))
    assert list(out_ids) == [model.eot]


def test_too_many_candidates_is_a_clear_error(infill):
    ids = np.arange(MAX_INFILL_CANDIDATES + 1, dtype=np.int64)
    with pytest.raises(InvalidRequestError, match="top_k"):
        infill(ids, np.zeros(ids.size, dtype=np.float32))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_with_infill_is_lossless(engine, model, temperature):
    f = InfillFilter(model)
    sp = SamplingParams(temperature=temperature, top_k=40, top_p=0.9, min_p=0.0, seed=11, candidate_filter=f)
    old, old_adaptive = engine.drafter, engine.adaptive
    try:
        engine.reset()
        plain = engine.generate(PROMPT, max_tokens=32, sampling=sp, speculative=False)
        for drafter in (old, RandomDrafter(width=3, depth=4, seed=5)):  # the n-gram drafter, an adversary
            engine.drafter = drafter
            engine.adaptive = False  # verify whatever is drafted
            engine.reset()
            spec = engine.generate(PROMPT, max_tokens=32, sampling=sp)
            assert spec.token_ids == plain.token_ids
            assert spec.stats.num_draft_tokens > 0
    finally:
        engine.drafter, engine.adaptive = old, old_adaptive
        f.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_candidate_filter_applies_on_the_native_path_too(temperature):
    """A filter that keeps one token decides the outcome whether or not the C kernels are on
    (they know no filters, so a request with one must take the numpy pipeline)."""
    from localspec import native
    from localspec.sampling import LogitsProcessor

    class KeepOne:
        name = "keep-one"

        def __call__(self, ids, logits):
            keep = ids == 7
            return ids[keep], logits[keep]

    row = np.linspace(0.0, 5.0, 64, dtype=np.float32)  # argmax is 63
    row[7] = 4.0
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, candidate_filter=KeepOne())
    for on in ([True, False] if native.AVAILABLE else [False]):
        proc = LogitsProcessor(params, 64, use_native=on)
        assert proc.candidates(row).ids.tolist() == [7]
        assert proc.choose(row, pos=3, seed=1) == 7
