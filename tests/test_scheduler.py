"""The batched scheduler: node budget across requests, and outputs that do not depend on the
neighbours (the same text alone or batched, at T=0 and with a seed), with the real model."""

import dataclasses

import pytest

from conftest import fixed_cost_model
from localspec import SamplingParams
from localspec.errors import ContextOverflowError, InvalidRequestError
from localspec.scheduler import BatchScheduler, allocate_nodes
from localspec.tree import TokenTree

PROMPTS = [
    "def fibonacci(n):\n    ",
    "List of primes: 2, 3, 5, 7, 11,",
    "The capital of France is",
]
N = 16


def chain(score: float, n: int) -> TokenTree:
    return TokenTree.chain(1, list(range(2, 2 + n)), scores=[score ** (i + 1) for i in range(n)])


def cost(b: int) -> float:
    return fixed_cost_model().t_decode_us(b) + 1500.0 + 100.0 * (b - 1)


def saturating(b: int) -> float:
    """A GPU-like step cost: flat up to 8 tokens (the hardware is not full), then linear."""
    return 10000.0 * max(1.0, b / 8) + 1000.0


def test_speculation_fades_as_the_batch_fills():
    for c in (cost, saturating):
        one = allocate_nodes([chain(0.9, 16)], c)
        assert one[0] > 4  # one request: a long draft pays
        per_request = [sum(allocate_nodes([chain(0.9, 16)] * r, c)) / r for r in (1, 2, 4, 8)]
        assert per_request[0] > per_request[1] > per_request[2] >= per_request[3]
    # once the batch fills the hardware, a draft node costs as much as it is expected to give
    assert allocate_nodes([chain(0.9, 16)] * 8, saturating) == [1] * 8
    assert allocate_nodes([chain(0.9, 16)] * 4, saturating) != [1] * 4  # and it returns as the batch empties


def test_budget_goes_to_the_requests_likely_to_accept():
    sizes = allocate_nodes([chain(0.95, 16), chain(0.2, 16), None], cost)
    assert sizes[0] > sizes[1] and sizes[2] == 1


def test_no_draft_below_min_gain_and_node_limits():
    assert allocate_nodes([chain(0.05, 8)], cost) == [1]
    assert allocate_nodes([chain(0.99, 30)], cost, max_nodes=[4])[0] <= 4


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt decoded alone by the engine (greedy, and seeded at T=0.8)."""
    g = dataclasses.replace(SamplingParams.greedy(), logprobs=0)
    s = SamplingParams(temperature=0.8, seed=1234)
    out = {"greedy": [], "logprobs": [], "seeded": []}
    for p in PROMPTS:
        engine.reset()
        r = engine.generate(p, max_tokens=N, sampling=g)
        out["greedy"].append(r.token_ids)
        out["logprobs"].append([lp.logprob for lp in r.logprobs])
        engine.reset()
        out["seeded"].append(engine.generate(p, max_tokens=N, sampling=s).token_ids)
    engine.reset()
    return out


def _run(model, sampling, **kw):
    sched = BatchScheduler(model, parallel=len(PROMPTS), cost_model=fixed_cost_model(), **kw)
    try:
        jobs = [sched.submit(model.tokenize(p), max_tokens=N, sampling=sampling) for p in PROMPTS]
        sched.run_until_idle()
        return [j.wait() for j in jobs], sched
    finally:
        sched.close()


def test_batched_equals_alone_greedy_with_full_trees(model, alone):
    # adaptive=False verifies every drafted tree: many rows of several requests per decode
    res, sched = _run(model, dataclasses.replace(SamplingParams.greedy(), logprobs=0), n_ctx=256, adaptive=False)
    assert [r.token_ids for r in res] == alone["greedy"]
    # bit-identical logits rows: the emitted tokens' log-probabilities are equal as floats
    # (a cell of a request placed before its earlier cells would change them in the last bits)
    assert [[lp.logprob for lp in r.logprobs] for r in res] == alone["logprobs"]
    multi = [(r, n) for r, n in sched.step_log if r > 1 and n > r]
    assert multi, "no step decoded drafts of several requests together"
    assert sum(r.stats.num_draft_tokens for r in res) > 0


def test_batched_equals_alone_seeded(model, alone):
    res, _ = _run(model, SamplingParams(temperature=0.8, seed=1234), n_ctx=256)
    assert [r.token_ids for r in res] == alone["seeded"]


def test_compaction_keeps_outputs(model, alone):
    sched = BatchScheduler(model, parallel=2, n_ctx=64, cost_model=fixed_cost_model(), adaptive=False, max_tree_nodes=8)
    try:
        sched.kv_size = 64  # a software limit far below the real cache: compactions at most steps
        jobs = [sched.submit(model.tokenize(p), max_tokens=N, sampling=SamplingParams.greedy()) for p in PROMPTS]
        sched.run_until_idle()
        assert [j.wait().token_ids for j in jobs] == alone["greedy"]
        assert sched.n_compactions >= 1
    finally:
        sched.close()


def test_cancel_frees_the_slot_and_others_go_on(model, alone):
    sched = BatchScheduler(model, parallel=2, n_ctx=256, cost_model=fixed_cost_model())
    try:
        seen = []
        a = sched.submit(model.tokenize(PROMPTS[0]), max_tokens=200, sampling=SamplingParams.greedy(),
                         on_chunk=lambda c: seen.append(c))
        b = sched.submit(model.tokenize(PROMPTS[1]), max_tokens=N, sampling=SamplingParams.greedy())
        c = sched.submit(model.tokenize(PROMPTS[2]), max_tokens=N, sampling=SamplingParams.greedy())
        while not seen:
            sched.step()
        a.cancel()
        sched.step()
        assert a.done.is_set() and a.result.finish_reason == "cancelled"
        assert sched.n_active == 2  # c took a's slot at once
        sched.run_until_idle()
        assert [b.wait().token_ids, c.wait().token_ids] == alone["greedy"][1:]
    finally:
        sched.close()


def test_bad_requests(model):
    sched = BatchScheduler(model, parallel=1, n_ctx=32, cost_model=fixed_cost_model())
    try:
        with pytest.raises(ContextOverflowError):
            sched.submit(list(range(10, 50)))
        with pytest.raises(InvalidRequestError):
            sched.submit([])
        with pytest.raises(InvalidRequestError):
            sched.submit([model.n_vocab])
    finally:
        sched.close()
    with pytest.raises(InvalidRequestError):
        BatchScheduler(model, drafter="eagle3")


def test_generate_batch_matches_generate(engine, alone):
    res = engine.generate_batch(PROMPTS, parallel=2, max_tokens=N, sampling=SamplingParams.greedy(), n_ctx=256)
    assert [r.token_ids for r in res] == alone["greedy"]
    out = engine.generate_batch(["word " * 300, PROMPTS[0]], parallel=2, max_tokens=4,
                                sampling=SamplingParams.greedy(), n_ctx=256, return_exceptions=True)
    assert isinstance(out[0], ContextOverflowError)  # recorded in its place, the others go on
    assert out[1].token_ids == alone["greedy"][0][:4]
