"""Standalone draft models on the real Gemma 3 270M: the target as its own draft, a derived
(layer-truncated) draft, sampled drafts under classic rejection sampling, small draft
contexts, and the auto drafter."""

import numpy as np
import pytest

from conftest import frozen_cost_model
from helpers import (
    REJECTION_SAMPLING, REJECTION_SHAPES, PlainReferences, assert_greedy_is_target_argmax, assert_rejection_sampling_exact,
    assert_same_as_plain,
)
from localspec import Engine, SamplingParams
from localspec.backend import Context, SequenceCache
from localspec.drafters.draft_model import DraftModelDrafter
from localspec.policy import TreeShape
from localspec.request_state import RequestState
from localspec.tree import TokenSource, TreeBuilder

GREEDY = SamplingParams.greedy()
CHAIN = TreeShape(depth=4, width=1, max_nodes=5, min_score=0.0)
TREE = TreeShape(depth=3, width=2, max_nodes=8, min_score=0.0)
STORY = (
    "Chapter 1. The lighthouse keeper climbed the spiral stairs every evening at dusk, counting "
    "the one hundred and twelve steps as his father had taught him. From the lamp room he could "
    "see the whole bay: the fishing boats coming home, the gulls circling the harbour wall, and "
    "the dark line of the cliffs to the north where the old road ran. "
)


@pytest.fixture(scope="module")
def eng(model):
    e = Engine(model, drafter="none", n_ctx=4096, cost_model=frozen_cost_model())
    yield e
    e.close()


def run(eng, prompt, n, sampling=GREEDY, drafter=None, **kw):
    eng.set_drafter(drafter)
    eng.adaptive = drafter is None or not getattr(drafter, "fixed_shape", None)
    eng.reset()
    try:
        return eng.generate(prompt, max_tokens=n, sampling=sampling, speculative=drafter is not None, **kw)
    finally:
        if drafter is not None:
            drafter.cache.check()  # the draft's KV: seq 0 consistent, scratch sequences empty
            assert all(drafter.ctx.pos_max(s) == -1 for s in range(1, drafter.ctx.n_seq_max))


_PLAIN = PlainReferences()


def plain_run(eng, prompt, n, sampling=GREEDY):
    """Plain decoding of ``prompt`` (``run`` without a drafter), once per module (``PlainReferences``)."""
    return _PLAIN.get(run, eng, prompt, n, sampling)


def no_eog(model, **kw):
    """Greedy sampling that never ends the text (long-generation tests)."""
    return SamplingParams.greedy(logit_bias={t: -np.inf for t in model.eog_ids}, **kw)


def test_target_as_its_own_draft_past_the_sliding_window(eng, model):
    """Draft = target: under exact kernels every draft row is bit-identical to the target's
    single-token row, so every draft is accepted and the output is plain greedy decoding,
    over 216 generated tokens that take the context from 499 tokens well past Gemma's
    512-token window (both the target's and the draft's sliding-window layers wrap while
    drafting; a prompt just inside the window leaves the decoding, not the prefill, to cross
    it: 320 tokens after a 428-token prompt took 38 s of the suite)."""
    prompt = model.tokenize(STORY * 7)
    sp = no_eog(model)
    spec = run(eng, prompt, 216, sp, DraftModelDrafter(model, shape=CHAIN))
    assert len(prompt) < 512 and len(prompt) + len(spec.token_ids) > 512 + 200 and len(spec.token_ids) == 216
    assert_greedy_is_target_argmax(eng, prompt, spec.token_ids, exclude=model.eog_ids)
    s = spec.stats
    rate = s.num_accepted_tokens / s.num_draft_tokens
    print(f"target as draft: accepted {s.num_accepted_tokens}/{s.num_draft_tokens} = {rate:.4f}, "
          f"mean acceptance length {s.mean_acceptance_length:.2f}")  # fmt: skip
    assert rate >= 0.99
    assert s.mean_acceptance_length > 4.5


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_derived_draft_greedy_output_is_the_target_argmax(eng, model, derived_draft, shape):
    prompt = model.tokenize("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    plain = plain_run(eng, prompt, 48)
    spec = run(eng, prompt, 48, drafter=DraftModelDrafter(derived_draft, shape=shape))
    assert_same_as_plain(eng, prompt, plain.token_ids, spec.token_ids)
    s = spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # a real, imperfect draft
    assert s.token_sources.get("draft_model", 0) == s.num_accepted_tokens


def test_adaptive_policy_with_a_derived_draft(eng, model, derived_draft):
    prompt = model.tokenize(STORY)
    plain = run(eng, prompt, 48)
    spec = run(eng, prompt, 48, drafter=DraftModelDrafter(derived_draft))
    assert_same_as_plain(eng, prompt, plain.token_ids, spec.token_ids)


def test_gumbel_drafts_use_the_targets_noise(eng, model):
    """At temperature > 0 with seeded Gumbel verification, a draft that perturbs its logits
    with the target's per-position noise proposes the target's own picks: with the target
    as draft nearly everything is accepted, and the text is the plain run's for the seed."""
    sp = SamplingParams(temperature=0.8, seed=99, logit_bias={t: -np.inf for t in model.eog_ids})
    prompt = model.tokenize(STORY)
    plain = run(eng, prompt, 64, sp)
    spec = run(eng, prompt, 64, sp, DraftModelDrafter(model, shape=CHAIN))
    s = spec.stats
    assert s.num_accepted_tokens >= 0.95 * s.num_draft_tokens
    assert_same_as_plain(eng, prompt, plain.token_ids, spec.token_ids, sampling=sp)


def test_small_draft_context_sees_the_recent_tail(eng, model):
    """A 256-token draft context under a 720-token history: the window slides (bounded
    re-prefill), nothing crashes, the output is still the target's."""
    prompt = model.tokenize(STORY * 12)[:720]
    d = DraftModelDrafter(model, n_ctx=256, shape=CHAIN)
    plain = run(eng, prompt, 48)
    spec = run(eng, prompt, 48, drafter=d)
    assert_same_as_plain(eng, prompt, plain.token_ids, spec.token_ids)
    assert len(prompt) == 720 and d.ctx.n_ctx == 256 and d.offset > len(prompt) - 256
    assert d.cache.n_past <= 256 and d.cache.tokens == d.history[d.offset : d.offset + d.cache.n_past]
    s = spec.stats
    assert s.num_accepted_tokens > 0.5 * s.num_draft_tokens  # the tail is enough to draft well


def test_auto_drafter_with_a_draft_model(eng, model, derived_draft_path):
    prompt = model.tokenize(STORY + STORY[:200])
    plain = run(eng, prompt, 64)
    eng.set_drafter("auto", draft_model=derived_draft_path)
    eng.adaptive = True
    eng.reset()
    res = eng.generate(prompt, max_tokens=64, sampling=GREEDY)
    assert eng.drafter.model is not None and eng.drafter.model.stats.n_steps >= 1
    assert_same_as_plain(eng, prompt, plain.token_ids, res.token_ids)
    eng.set_drafter(None)


def test_drafter_options_are_checked(model):
    from localspec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="--draft-model"):
        Engine(model, drafter="draft", n_ctx=256, cost_model=frozen_cost_model())
    with pytest.raises(InvalidRequestError, match="does not take"):
        Engine(model, drafter="ngram", draft_model="x.gguf", n_ctx=256, cost_model=frozen_cost_model())
    # only the options it does not take, as the command line and Python spell them (it named
    # every option given, the shipped head's path the engine adds for `auto` among them: "does
    # not take draft_shape, eagle"; then only the flags, which a Python caller never typed)
    from localspec.drafters import make_drafter

    with pytest.raises(InvalidRequestError, match=r"^drafter 'auto' does not take --draft-shape \(Python: draft_shape=\); see"):
        make_drafter("auto", draft_shape=TreeShape(6, 1, 7), eagle="head.gguf")
    with pytest.raises(InvalidRequestError, match=r"^--draft-shape \(Python: draft_shape=\) needs a drafter \(not 'none'\): choose one with --drafter \(Python: drafter=\)$"):
        make_drafter("none", draft_shape=TreeShape(6, 1, 7))


# -- classic rejection sampling with the draft's own probabilities, on fixed real rows --------


def rows_after(model, prompt, tokens):
    """Logits after ``prompt`` and after ``prompt + [t]`` for each t: one tree decode."""
    ctx = Context(model, n_ctx=512, n_seq_max=len(tokens) + 2)
    cache = SequenceCache(ctx, max_tree_nodes=len(tokens) + 1)
    try:
        cache.prefill(prompt[:-1])
        b = TreeBuilder(prompt[-1])
        for t in tokens:
            b.add(0, int(t), source=TokenSource.NGRAM)
        tree = b.build()
        _, lg = cache.decode_tree(tree)
        return lg[0].copy(), {int(tree.token_ids[i]): lg[i].copy() for i in range(1, tree.n_nodes)}
    finally:
        ctx.close()


@pytest.mark.parametrize("shape", REJECTION_SHAPES, ids=["chain", "tree"])
def test_rejection_sampling_with_draft_probabilities_is_exact(model, derived_draft, shape):
    """Drafts sampled from the derived draft's own distribution, verified by classic
    rejection sampling against the target: the first two emitted tokens follow the target's
    joint distribution (chi-square over thousands of seeds; real logits of both models)."""
    prompt = model.tokenize("My favourite fruit is the")
    d_root, _ = rows_after(derived_draft, prompt, [])
    draft_support = RequestState(REJECTION_SAMPLING.with_seed(0), model, prompt).processor.candidates(d_root).ids
    _, d_after = rows_after(derived_draft, prompt, draft_support)
    assert_rejection_sampling_exact(model, prompt, d_root, d_after, shape, lambda p, toks: rows_after(model, p, toks))
