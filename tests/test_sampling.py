"""Table tests of the logits pipeline against a brute-force implementation of llama.cpp's
sampler semantics, and tests of the counter-based random streams."""

import math
import re

import numpy as np
import pytest
from scipy import stats

from conftest import chisquare_pvalue
from localspec import native
from localspec.errors import InvalidRequestError
from localspec.sampling import (
    LogitsProcessor,
    PenaltyWindow,
    SamplingParams,
    gumbel_noise,
    stream_key,
    uniform,
    uniforms,
)


def brute_force(x, p: SamplingParams, counts=None):
    """Straightforward llama.cpp chain: bias, penalties, top-k, top-p, min-p, temperature."""
    x = np.array(x, dtype=np.float32, copy=True)
    for t, b in p.logit_bias.items():
        x[t] += b
    for t, c in (counts or {}).items():
        if p.has_penalties:
            x[t] = x[t] * p.repeat_penalty if x[t] <= 0 else x[t] / p.repeat_penalty
            x[t] -= c * p.frequency_penalty + p.presence_penalty
    order = sorted([i for i in range(len(x)) if np.isfinite(x[i])], key=lambda i: (-x[i], i))
    if p.temperature <= 0:
        return [order[0]], None
    if p.top_k > 0:
        order = order[: p.top_k]
    if p.top_p < 1:
        v = np.array([x[i] for i in order], dtype=np.float64)
        e = np.exp(v - v.max())
        cum = np.cumsum(e / e.sum())
        n = next(i + 1 for i, c in enumerate(cum) if c >= p.top_p) if (cum >= p.top_p).any() else len(order)
        order = order[:n]
    if p.min_p > 0:
        mx = x[order[0]]
        order = [i for i in order if x[i] >= mx + math.log(p.min_p)] or order[:1]
    return sorted(order), {i: x[i] / p.temperature for i in order}


CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.5, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.999, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=0, top_p=0.0, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.0, min_p=0.05),
    SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.8, logit_bias={3: 5.0, 7: -math.inf}),
    SamplingParams(temperature=0.8, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
    SamplingParams(temperature=0.0, repeat_penalty=1.5),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: repr(p)[15:80])
def test_pipeline_matches_brute_force(params, rng):
    n_vocab = 600
    proc = LogitsProcessor(params, n_vocab)
    for trial in range(20):
        row = (rng.standard_normal(n_vocab) * 3).astype(np.float32)
        counts = {int(t): int(c) for t, c in zip(rng.integers(0, n_vocab, 5), rng.integers(1, 4, 5))}
        want_ids, want_logits = brute_force(row, params, counts)
        c = proc.candidates(row, counts)
        assert sorted(c.ids.tolist()) == want_ids
        if want_logits is not None:
            got = dict(zip(c.ids.tolist(), c.logits.tolist()))
            for i in want_ids:
                assert got[i] == pytest.approx(want_logits[i], rel=1e-5, abs=1e-5)


def test_large_vocab_top_p_path(rng):
    # exercise the growing-prefix search for top-p over a 262k row with a flat tail
    n = 262144
    row = rng.standard_normal(n).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.95, min_p=0.0)
    c = LogitsProcessor(p, n).candidates(row)
    order = np.argsort(-row.astype(np.float64), kind="stable")
    e = np.exp(row[order].astype(np.float64) - row.max())
    cum = np.cumsum(e) / e.sum()
    k = int(np.flatnonzero(cum >= 0.95)[0]) + 1
    assert c.ids.size == k
    assert set(c.ids.tolist()) == set(order[:k].tolist())


@pytest.mark.parametrize("use_native", [False, True])
def test_top_p_zero_keeps_only_the_most_likely_token(rng, use_native):
    """top_p 0 is llama.cpp's top-p keeping its one token (the CLI, ``/v1/`` and the
    llama.cpp fields take it alike): sampling at any temperature then picks the argmax."""
    if use_native and not native.AVAILABLE:
        pytest.skip(f"C kernels not built: {native.LOAD_ERROR}")
    n = 262144
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.0, min_p=0.0, seed=3)
    proc = LogitsProcessor(params, n, use_native=use_native)
    for trial in range(4):
        row = rng.standard_normal(n).astype(np.float32)
        top = int(np.argmax(row))
        assert proc.candidates(row).ids.tolist() == [top]
        assert proc.choose(row, trial, 3) == top


def test_greedy_is_argmax_after_bias(rng):
    row = rng.standard_normal(100).astype(np.float32)
    top = int(np.argmax(row))
    proc = LogitsProcessor(SamplingParams.greedy(logit_bias={top: -math.inf}), 100)
    second = int(np.argsort(-row)[1])
    assert proc.choose(row, 0, 0) == second


def test_params_validation():
    with pytest.raises(InvalidRequestError):
        SamplingParams(temperature=-1)
    for top_p in (-0.01, 1.01, math.nan):
        with pytest.raises(InvalidRequestError, match=r"top_p must be in \[0, 1\]"):
            SamplingParams(top_p=top_p)
    with pytest.raises(InvalidRequestError):
        SamplingParams(verify="lossy")
    with pytest.raises(InvalidRequestError):
        LogitsProcessor(SamplingParams(logit_bias={10**9: 1.0}), 100)


def test_penalty_window_slides():
    w = PenaltyWindow(3, [1, 2, 3, 1])
    assert dict(w.counts) == {2: 1, 3: 1, 1: 1}
    w.push(1)
    assert dict(w.counts) == {3: 1, 1: 2}
    c = w.copy()
    c.push(9)
    assert dict(w.counts) == {3: 1, 1: 2}
    assert dict(c.counts) == {1: 2, 9: 1}
    assert dict(PenaltyWindow(0, [1, 2]).counts) == {}
    assert dict(PenaltyWindow(-1, [1, 2, 1]).counts) == {1: 2, 2: 1}


def test_streams_are_deterministic_and_independent():
    k1 = stream_key(42, 7)
    assert k1 == stream_key(42, 7)
    assert k1 != stream_key(42, 8) != stream_key(43, 7)
    u = uniforms(k1, np.arange(1000))
    assert np.all((u > 0) & (u < 1))
    assert uniform(k1, 17) == u[17]
    # uniformity (Kolmogorov-Smirnov) and no correlation between neighbouring positions
    big = uniforms(k1, np.arange(200000))
    assert stats.kstest(big, "uniform").pvalue > 1e-3
    other = uniforms(stream_key(42, 8), np.arange(200000))
    assert abs(np.corrcoef(big, other)[0, 1]) < 0.01


def test_gumbel_max_samples_the_softmax():
    """Chi-square: argmax(logits/T + gumbel(seed, pos, id)) over many positions ~ softmax."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    proc = LogitsProcessor(params, logits.size)
    n = 20000
    draws = np.array([proc.choose(logits, pos, 99) for pos in range(n)])
    probs = np.exp(logits.astype(np.float64) / 0.9)
    obs = np.bincount(draws, minlength=logits.size)
    assert chisquare_pvalue(obs, probs) > 1e-3


def test_gumbel_noise_matches_reference_formula():
    g = gumbel_noise(5, 3, np.array([0, 1, 2]))
    u = uniforms(stream_key(5, 3), np.array([0, 1, 2]))
    assert np.allclose(g, -np.log(-np.log(u)))


def test_fields_of_the_wrong_type_are_refused_with_their_name():
    """``temperature="0.5"`` was a TypeError from a comparison; ``seed="7"`` and ``seed=1.5``
    were taken (1.5 as 1); ``logit_bias=None`` failed at the first token, ``{1: "x"}`` was a
    ValueError without the field's name."""
    for kw, says in ((dict(temperature="0.5"), "temperature must be a number, got '0.5'"),
                     (dict(top_p=None), "top_p must be a number, got None"),
                     (dict(top_k=True), "top_k must be an integer, got True"),
                     (dict(seed="7"), "seed must be an integer or None, got '7'"),
                     (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
                     (dict(logprobs=2.0), "logprobs must be an integer or None, got 2.0"),
                     (dict(logit_bias=None), "logit_bias must map token ids to biases, got None"),
                     (dict(logit_bias={1: "x"}), "logit_bias of token 1 must be a number, got 'x'"),
                     (dict(logit_bias={1: None}), "logit_bias of token 1 must be a number, got None"),
                     (dict(logit_bias={"1": 2.0}), "logit_bias keys must be token ids (integers), got '1'"),
                     (dict(logit_bias={1.5: 2.0}), "logit_bias keys must be token ids (integers), got 1.5"),
                     (dict(grammar=5), "grammar must be GBNF text or None, got int")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=f"^{re.escape(says)}$"):
            SamplingParams(**kw)
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int32(4), seed=np.int64(3),
                       logit_bias={np.int64(2): np.float32(-1.0), 3: -math.inf})  # numpy numbers are numbers
    assert (p.top_k, p.seed) == (4, 3)
