"""Every drafter on the batched step: the same texts alone and batched.

For each drafter (n-gram, a draft model, the shipped EAGLE-3 head, the shipped Medusa heads,
an MTP block of a test-written model, auto), four requests with different sampling
parameters (greedy, and three seeded samplers with Gumbel verification: for a seed, the text
is plain decoding's whatever the trees; classic rejection sampling is exact in distribution
only, tested by chi-square in the drafters' own tests) run alone on an ``Engine`` and together on a
``BatchScheduler`` with three slots, so that the fourth waits in the queue first and then
takes a slot whose drafter served another request. Every text must be the engine's, token
for token, and the batch must really have verified and accepted drafts (a drafter that
drafted nothing would pass the equality trivially).

Trees are verified without the adaptive policy (``adaptive=False``: every drafted node up to
the limits), so the model drafters run at every step.
"""

from __future__ import annotations

import pytest

from conftest import frozen_cost_model
from localspec.engine import Engine
from localspec.sampling import SamplingParams
from localspec.scheduler import BatchScheduler

PROMPTS = [
    "Question: What is the capital of France?\nAnswer: The capital of France is Paris.\n"
    "Question: What is the capital of France?\nAnswer:",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
SAMPLINGS = [
    SamplingParams.greedy(),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0, top_k=20, seed=12),
    SamplingParams(temperature=0.7, top_p=0.9, repeat_penalty=1.1, seed=13),
]
N = 24


def run_alone(eng: Engine, prompts, samplings) -> list[list[int]]:
    out = []
    for p, sp in zip(prompts, samplings):
        eng.reset()
        out.append(eng.generate(p, max_tokens=N, sampling=sp).token_ids)
    return out


def run_batched(model, tokenize, prompts, samplings, **kw) -> list:
    sched = BatchScheduler(model, parallel=3, n_ctx=512, cost_model=frozen_cost_model(), adaptive=False,
                           max_tree_nodes=16, **kw)  # fmt: skip
    try:
        jobs = [sched.submit(tokenize(p), max_tokens=N, sampling=sp) for p, sp in zip(prompts, samplings)]
        sched.run_until_idle()
        return [j.wait(0) for j in jobs]
    finally:
        sched.close()


def check_same(eng: Engine, name: str, prompts=PROMPTS, samplings=SAMPLINGS, **options) -> None:
    alone = run_alone(eng, prompts, samplings)
    batched = run_batched(eng.model, eng.tokenize, prompts, samplings, drafter=name, drafter_options=options)
    assert [r.token_ids for r in batched] == alone
    assert all(r.stats.drafter != "none" for r in batched)
    assert sum(r.stats.num_accepted_tokens for r in batched) > 0, "the batch accepted no draft"


@pytest.fixture(scope="module")
def shared_model(model):
    return model


def engine_for(model, name, **options) -> Engine:
    return Engine(model, drafter=name, n_ctx=1024, cost_model=frozen_cost_model(), adaptive=False,
                  max_tree_nodes=16, **options)  # fmt: skip


@pytest.mark.parametrize("name", ["ngram", "eagle3", "medusa", "auto"])
def test_every_drafter_gives_the_same_texts_alone_and_batched(shared_model, name):
    eng = engine_for(shared_model, name)
    try:
        check_same(eng, name)
    finally:
        eng.close()


def test_a_draft_model_gives_the_same_texts_alone_and_batched(shared_model, derived_draft_path):
    eng = engine_for(shared_model, "draft", draft_model=derived_draft_path)
    try:
        check_same(eng, "draft", draft_model=derived_draft_path)
    finally:
        eng.close()


def test_an_mtp_block_gives_the_same_texts_alone_and_batched(tmp_path):
    from mtp_gguf import write_tiny_glm4moe

    path = write_tiny_glm4moe(tmp_path / "tiny-glm4moe-mtp.gguf")
    eng = Engine(path, drafter="mtp", n_ctx=1024, n_threads=1, cost_model=frozen_cost_model(), adaptive=False,
                 max_tree_nodes=16)  # fmt: skip
    try:
        prompts = ["abcabcabc", "hello hello", "0123456789", "zzz yyy zzz"]
        check_same(eng, "mtp", prompts=prompts)
    finally:
        eng.close()


def test_generate_batch_runs_the_engines_model_drafter(shared_model):
    """``Engine.generate_batch`` makes each slot a drafter like the engine's (name and options):
    the shipped EAGLE-3 head drafts in the batch too, with the engine's texts."""
    eng = engine_for(shared_model, "eagle3")
    try:
        alone = run_alone(eng, PROMPTS[:2], SAMPLINGS[:2])
        res = eng.generate_batch(PROMPTS[:2], parallel=2, max_tokens=N, sampling=SAMPLINGS[:2], n_ctx=512)
        assert [r.token_ids for r in res] == alone
        assert all(r.stats.drafter == "eagle3" for r in res)
        assert sum(r.stats.token_sources.get("eagle3", 0) for r in res) > 0
    finally:
        eng.close()


# -- model drafters draft together ----------------------------------------------------------------

def _step_counts(sched, count) -> list[tuple[int, int, int]]:
    """Run ``sched`` to the end one step at a time: for each step in which a model drafted,
    ``(requests that drafted, levels of the longest tree, model calls counted by count())``."""
    out = []
    stats = {id(d.stats): d.stats for d in sched._drafters}.values()  # shared by the slots
    group = getattr(sched._drafters[0], "hub", None) or getattr(sched._drafters[0], "heads", None)
    while sched.n_active or sched._queue:
        before = sum(s.n_steps for s in stats)
        c0 = count()
        sched.step()
        n_drafted = sum(s.n_steps for s in stats) - before  # one drafted step per request
        if n_drafted:
            out.append((n_drafted, len(getattr(group, "last_level_us", ())), count() - c0))
    return out


def test_the_slots_share_what_the_policy_learns_of_the_model(shared_model):
    """A server's slots share the model drafter's ``ModelDraftStats`` (its cost, gain and
    probe gap), as one engine keeps them over its requests, so that a slot's first request
    does not probe again a head that the other slots have found not to pay."""
    for name in ("eagle3", "medusa", "auto"):
        sched = _scheduler(shared_model, name)
        try:
            parts = [d.model if name == "auto" else d for d in sched._drafters]  # auto: its head
            assert all(p.stats is parts[0].stats for p in parts) and len(parts) == 4, name
        finally:
            sched.close()


def _scheduler(model, name, **options):
    sched = BatchScheduler(model, parallel=4, n_ctx=512, cost_model=frozen_cost_model(), adaptive=False,
                           max_tree_nodes=16, drafter=name, drafter_options=options)  # fmt: skip
    for p in PROMPTS:
        sched.submit(model.tokenize(p), max_tokens=12, sampling=SamplingParams.greedy())
    return sched


def _count_calls(obj, method: str, monkeypatch) -> list:
    calls = []
    real = getattr(obj, method)
    monkeypatch.setattr(obj, method, lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("name", ["eagle3", "eagle3-host", "draft", "mtp"])
def test_model_drafters_of_four_requests_share_one_context_and_decode_each_level_once(
    shared_model, derived_draft_path, name, monkeypatch, tmp_path
):
    """``--parallel 4``: the four slots' drafters share the loaded head / draft model / MTP
    block (loaded once) and one draft context, and in a step where several requests draft, each
    tree level of all of them is ONE llama.cpp call (the number of calls with outputs is the
    longest tree's levels, not the sum over requests, as it was with a context per slot).
    ``eagle3-host``: the head on the host runtime, one ``run_level`` per level for all the
    requests: one ``ls_head_level`` C call over every drafting request's entries."""
    from localspec.backend import Model
    from localspec.drafters import eagle3_host

    host = name == "eagle3-host"
    monkeypatch.setenv("LOCALSPEC_EAGLE3_RUNTIME", "host" if host else "llama")
    name = "eagle3" if host else name
    target = shared_model
    if name == "mtp":
        from mtp_gguf import write_tiny_glm4moe

        target = Model(write_tiny_glm4moe(tmp_path / "tiny-glm4moe-mtp.gguf"))
    loads = _count_calls(Model, "__init__", monkeypatch)
    options = {"draft_model": derived_draft_path} if name == "draft" else {}
    sched = _scheduler(target, name, **options)
    try:
        assert len(loads) == 1  # the head / draft model / MTP block, once for the four slots
        first = sched._drafters[0]
        assert all(d.model is first.model and d.hub is first.hub and d.ctx is first.ctx for d in sched._drafters)
        assert sorted(d.seq0 for d in sched._drafters) == [first.hub.seqs_each * i for i in range(4)]
        ctx = first.hub.ctx
        if host:
            assert ctx is None and first.runtime == "host"
            calls = _count_calls(first.hub, "decode_levels", monkeypatch)
            levels_run = _count_calls(eagle3_host, "run_level", monkeypatch)
        elif name == "draft":
            calls = _count_calls(ctx, "decode", monkeypatch)
        else:  # a long catch-up's head is decoded first, without outputs, in a call of its own
            calls = _count_calls(ctx, "process", monkeypatch)
        steps = _step_counts(sched, lambda: sum(1 for a in calls if getattr(a[0], "n_outputs", 1)))
    finally:
        sched.close()
        if target is not shared_model:
            target.close()
    together = [(n, levels, c) for n, levels, c in steps if n > 1]
    assert together and max(n for n, _, _ in together) == 4
    assert all(c == levels for _, levels, c in together), together
    if host:  # one level call held the rows of the four requests' roots
        assert max(sum(p.n_out for p in a[1]) for a in levels_run) >= 4


def test_medusa_heads_of_four_requests_load_once_and_run_one_call_per_matrix(shared_model, monkeypatch):
    """``--parallel 4`` with Medusa heads: the heads' weights are read once and shared by the
    four slots, and a step in which several requests draft runs each head matrix once over
    all their final-norm rows (``gemm_t`` of [R, n_embd]): as many C calls as one request's step."""
    from localspec.models import medusa_gguf
    from localspec.native import rows

    reads = _count_calls(medusa_gguf, "read_medusa_gguf", monkeypatch)
    sched = _scheduler(shared_model, "medusa")
    try:
        assert len(reads) == 1
        first = sched._drafters[0]
        assert all(d.heads is first.heads for d in sched._drafters)
        heads = first.heads
        per_step = heads.n_heads + (1 if heads.shared else heads.n_heads)
        calls = _count_calls(rows, "gemm_t", monkeypatch)
        steps = _step_counts(sched, lambda: len(calls))
    finally:
        sched.close()
    together = [(n, c) for n, _, c in steps if n > 1]
    assert together and max(n for n, _ in together) == 4
    assert all(c == per_step for _, c in together), together
    block_rows = [a[1].shape[0] for a in calls if any(a[0] is w for w in heads.w_t)]
    assert max(block_rows) == 4  # each head's block: one call over the four requests' rows
