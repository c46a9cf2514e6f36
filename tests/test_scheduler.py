"""The batched scheduler: node budget across requests, and outputs that do not depend on the
neighbours (the same text alone or batched, at T=0 and with a seed), with the real model."""

import dataclasses

import pytest

from conftest import fixed_cost_model, frozen_cost_model
from localspec import SamplingParams
from localspec.errors import ContextOverflowError, InvalidRequestError
from localspec.policy import allocate_nodes as _allocate
from localspec.scheduler import BatchScheduler
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


def allocate_nodes(*args, **kwargs) -> list[int]:
    return _allocate(*args, **kwargs).sizes


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
    sched = BatchScheduler(model, parallel=len(PROMPTS), cost_model=frozen_cost_model(), **kw)
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
    multi = [(r, n) for r, n, _p in sched.step_log if r > 1 and n > r]
    assert multi, "no step decoded drafts of several requests together"
    assert sum(r.stats.num_draft_tokens for r in res) > 0


def test_batched_equals_alone_seeded(model, alone):
    res, _ = _run(model, SamplingParams(temperature=0.8, seed=1234), n_ctx=256)
    assert [r.token_ids for r in res] == alone["seeded"]


def test_compaction_keeps_outputs(model, alone):
    sched = BatchScheduler(model, parallel=2, n_ctx=64, cost_model=frozen_cost_model(), adaptive=False, max_tree_nodes=8)
    try:
        sched.kv_size = 64  # a software limit far below the real cache: compactions at most steps
        jobs = [sched.submit(model.tokenize(p), max_tokens=N, sampling=SamplingParams.greedy()) for p in PROMPTS]
        sched.run_until_idle()
        assert [j.wait().token_ids for j in jobs] == alone["greedy"]
        assert sched.n_compactions >= 1
    finally:
        sched.close()


def test_cancel_frees_the_slot_and_others_go_on(model, alone):
    sched = BatchScheduler(model, parallel=2, n_ctx=256, cost_model=frozen_cost_model())
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
    sched = BatchScheduler(model, parallel=1, n_ctx=32, cost_model=frozen_cost_model())
    try:
        with pytest.raises(ContextOverflowError):
            sched.submit(list(range(10, 50)))
        with pytest.raises(InvalidRequestError):
            sched.submit([])
        with pytest.raises(InvalidRequestError):
            sched.submit([model.n_vocab])
    finally:
        sched.close()
    with pytest.raises(ValueError, match="unknown drafter"):
        BatchScheduler(model, drafter="no-such-drafter")


def test_generate_batch_matches_generate(engine, alone):
    res = engine.generate_batch(PROMPTS, parallel=2, max_tokens=N, sampling=SamplingParams.greedy(), n_ctx=256)
    assert [r.token_ids for r in res] == alone["greedy"]
    out = engine.generate_batch(["word " * 300, PROMPTS[0]], parallel=2, max_tokens=4,
                                sampling=SamplingParams.greedy(), n_ctx=256, return_exceptions=True)
    assert isinstance(out[0], ContextOverflowError)  # recorded in its place, the others go on
    n = len(engine.tokenize("word " * 300))
    assert str(out[0]) == (f"the prompt has {n} tokens but the context holds 256; shorten it or give a context of at "
                           f"least {n + 1} tokens ({n + 4} for all 4 tokens asked): serve --ctx-per-request, batch "
                           "--n-ctx, generate_batch(n_ctx=)")  # fmt: skip
    assert out[1].token_ids == alone["greedy"][0][:4]


def test_generate_batch_n_ctx_is_checked_not_replaced_by_the_default(engine):
    """``n_ctx=`` is each request's context as given: 0 is refused like any context below 16."""
    with pytest.raises(InvalidRequestError, match="n_ctx must be at least 16 tokens"):
        engine.generate_batch(["Hi"], max_tokens=1, n_ctx=0)


# -- the prompt cache, shared prefixes, moved cells and prompts prefilled in pieces ------------

# 817 tokens of plain text: longer than Gemma 3's 512-token sliding window by 300, so a shared
# or moved prefix must carry the window layers' cells beyond the window too (each prefill of it
# takes about 4 s on one core of the development CPU: the tests below prefill it 4-6 times)
LONG = " ".join(
    f"Note {i}: the {c} box on shelf {i % 7} holds {i * 7 % 13} {t}."
    for i, (c, t) in enumerate([(c, t) for c in ("red", "green", "blue", "white") for t in ("pens", "cups", "keys", "maps")] * 3)
)
GREEDY_LP = dataclasses.replace(SamplingParams.greedy(), logprobs=0)


def alone_run(engine, tokens, n=N):
    """(token ids, log-probabilities) of ``tokens`` decoded alone by a fresh engine context."""
    engine.reset()
    r = engine.generate(list(tokens), max_tokens=n, sampling=GREEDY_LP)
    engine.reset()
    return r.token_ids, [lp.logprob for lp in r.logprobs]


def as_run(result):
    return result.token_ids, [lp.logprob for lp in result.logprobs]


def test_a_prompt_cache_hit_decodes_bit_for_bit_as_alone(model, engine):
    p1 = model.tokenize(LONG)
    assert len(p1) > model.n_swa + 100
    sched = BatchScheduler(model, parallel=2, n_ctx=2048, cost_model=frozen_cost_model())
    try:

        def run(prompt, **kw):
            job = sched.submit(prompt, max_tokens=N, sampling=GREEDY_LP, **kw)
            sched.run_until_idle()
            return job.wait()

        ra = run(p1)
        assert ra.stats.n_cached_tokens == 0
        # the next turn: the prompt, the reply and more text (what a chat client sends)
        p2 = p1 + ra.token_ids + model.tokenize(" Then the", add_special=False)
        rb = run(p2)
        assert rb.stats.n_cached_tokens >= len(p1)  # the first request's cells, reply included
        n_before = sched.n_compactions
        sched.compact()  # the entries are moved (K and V bytes copied), not recomputed
        assert sched.n_compactions == n_before + 1 and sched.cache
        rc = run(p2)
        assert rc.stats.n_cached_tokens == len(p2) - 1  # all but the last token, the first root
        rd = run(p2, cache_prompt=False)
        assert rd.stats.n_cached_tokens == 0
    finally:
        sched.close()
    ref1, ref2 = alone_run(engine, p1), alone_run(engine, p2)
    # token for token and log-probability for log-probability (floats): every emitted token's
    # logits row is bit-identical to the one a fresh prefill gives
    assert as_run(ra) == ref1
    assert as_run(rb) == ref2 and as_run(rc) == ref2 and as_run(rd) == ref2


def test_prompts_sharing_a_header_prefill_it_once_and_decode_as_alone(model, engine):
    head = model.tokenize(LONG)
    tails = [" Question: which box holds keys?", " Question: how many shelves are there?",
             " Summary: the boxes hold"]  # fmt: skip
    prompts = [head + model.tokenize(t, add_special=False) for t in tails]
    sched = BatchScheduler(model, parallel=3, n_ctx=2048, cost_model=frozen_cost_model(), prompt_cache=0)
    try:
        jobs = [sched.submit(p, max_tokens=N, sampling=GREEDY_LP) for p in prompts]  # arrive together
        sched.run_until_idle()
        res = [j.wait() for j in jobs]
    finally:
        sched.close()
    # the first prefills the header; the others wait for it and share its cells (no prompt cache
    # entries here: the running request's own cells are shared)
    assert res[0].stats.n_cached_tokens == 0
    assert all(r.stats.n_cached_tokens >= len(head) - 1 for r in res[1:])
    prompt_rows = sum(p for _r, _n, p in sched.step_log)
    assert prompt_rows < 1.2 * len(head)  # not three times
    assert [as_run(r) for r in res] == [alone_run(engine, p) for p in prompts]


def test_compaction_moves_shared_prefixes_once_and_keeps_outputs(model, engine):
    head = model.tokenize(LONG)
    prompts = [head + model.tokenize(t, add_special=False) for t in (" First,", " Second,", " Third,")]
    sched = BatchScheduler(model, parallel=2, n_ctx=2048, cost_model=frozen_cost_model(), adaptive=False,
                           max_tree_nodes=8)  # fmt: skip
    try:
        first = sched.submit(prompts[0], max_tokens=N, sampling=GREEDY_LP)
        sched.run_until_idle()  # leaves a prompt-cache entry
        # a software limit a little above what is used now: compactions while both run, each
        # moving the shared header once
        sched.kv_size = sched.n_used + 48
        jobs = [sched.submit(p, max_tokens=N, sampling=GREEDY_LP) for p in prompts[1:]]
        n0 = sched.n_compactions
        sched.run_until_idle()
        res = [first.wait()] + [j.wait() for j in jobs]
        assert sched.n_compactions > n0
        assert sched.n_used < 2 * len(head)  # the header is held once, not once per sequence
    finally:
        sched.close()
    assert [as_run(r) for r in res] == [alone_run(engine, p) for p in prompts]


def test_a_long_prompt_joins_the_running_batch_in_pieces(model, engine):
    short = model.tokenize(PROMPTS[0])
    long_prompt = model.tokenize(LONG)
    sched = BatchScheduler(model, parallel=2, n_ctx=2048, cost_model=frozen_cost_model(), prefill_chunk=64)
    try:
        got = []
        a = sched.submit(short, max_tokens=64, sampling=GREEDY_LP, on_chunk=lambda c: got.append(c.token))
        while len(got) < 2:
            sched.step()
        b = sched.submit(long_prompt, max_tokens=N, sampling=GREEDY_LP)
        sched.step()  # b admitted: its first piece goes in with a's step
        steps_with_pieces = 0
        while b.result is None and sched.slots[1] is not None and sched.slots[1].prefilling:
            n_before = len(got)
            sched.step()
            r, _n, p = sched.step_log[-1]
            if p:
                steps_with_pieces += 1
                assert p <= 64 and r >= 1 and len(got) > n_before  # a goes on decoding meanwhile
        assert steps_with_pieces >= len(long_prompt) // 64 - 2
        sched.run_until_idle()
        ra, rb = a.wait(), b.wait()
    finally:
        sched.close()
    assert as_run(ra) == alone_run(engine, short, 64)
    assert as_run(rb) == alone_run(engine, long_prompt)


def test_a_dropped_entry_leaves_no_hole_before_a_running_request(model, engine):
    # prompt_cache=1: when b ends, a's entry (cells nobody else holds) is dropped while d runs;
    # freed cells would take d's next tokens before its own earlier cells
    long_prompt = model.tokenize(LONG)
    short = [model.tokenize(p) for p in PROMPTS]
    sched = BatchScheduler(model, parallel=2, n_ctx=2048, cost_model=frozen_cost_model(), prompt_cache=1)
    try:
        a = sched.submit(long_prompt, max_tokens=4, sampling=GREEDY_LP)
        sched.run_until_idle()
        sched.compact()  # a's entry now holds its cells alone (a finished request's are also junk's)
        d = sched.submit(short[1], max_tokens=48, sampling=GREEDY_LP)
        b = sched.submit(short[2], max_tokens=2, sampling=GREEDY_LP)
        while not b.done.is_set():
            sched.step()
        assert [e.tokens[:3] for e in sched.cache] == [short[2][:3]]  # a's entry is gone, d still runs
        assert not d.done.is_set()
        sched.run_until_idle()
        rd = d.wait()
    finally:
        sched.close()
    assert a.wait().stats.n_generated_tokens == 4
    assert as_run(rd) == alone_run(engine, short[1], 48)


def test_a_short_prompt_is_not_kept_waiting_by_a_long_one_being_prefilled(model, engine):
    long_prompt = model.tokenize(LONG)
    short = model.tokenize(PROMPTS[1])
    sched = BatchScheduler(model, parallel=2, n_ctx=2048, cost_model=frozen_cost_model(), prefill_chunk=64)
    try:
        got = []
        b = sched.submit(long_prompt, max_tokens=4, sampling=GREEDY_LP)
        sched.step()  # nobody decodes: a piece of 4 x 64 tokens
        assert sched.step_log[-1] == (0, 256, 256)
        a = sched.submit(short, max_tokens=N, sampling=GREEDY_LP, on_chunk=lambda c: got.append(c.token))
        sched.step()  # shortest first: all of a's prompt and its first tree, then b's next piece
        assert got and sched.slots[0].prefilling and not b.done.is_set()
        sched.run_until_idle()
        ra = a.wait()
    finally:
        sched.close()
    assert as_run(ra) == alone_run(engine, short)
