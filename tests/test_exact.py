"""Exact kernels: with ``LOCALSPEC_KERNELS=exact`` (the default) on llama.cpp's CPU backend,
batched rows must be bit-identical to single-token decodes (checked at > 512 tokens of
context), and speculative output must equal plain output exactly - greedy and seeded, with
trees, out-of-order accepted branches and long contexts. A failure here means the exact
configuration stopped being exact (a llama.cpp update, a new CPU path): it fails, it does
not skip. Only ``LOCALSPEC_KERNELS=fast`` (no exactness promised) skips."""

import numpy as np
import pytest

from helpers import PROSE, ScriptedDrafter
from localspec import SamplingParams
from localspec.backend import Batch, Context, exact_kernels


def max_batched_row_difference(model) -> float:
    """max |logits of 8 tokens decoded in one batch - the same decoded one by one| after 600
    tokens of context."""
    p = model.tokenize(PROSE * 30)[:640]
    assert len(p) == 640
    n0, n = 600, 8

    def rows(bs):
        ctx = Context(model, n_ctx=1024, n_seq_max=2)
        b = Batch(512, 2)
        try:
            for i in range(0, n0, 512):
                b.set_sequence(p[i : min(n0, i + 512)], i, output="none")
                ctx.decode(b)
            out = []
            i = n0
            while i < n0 + n:
                g = p[i : min(i + bs, n0 + n)]
                b.set_sequence(g, i, output="all")
                ctx.decode(b)
                out.extend(ctx.logits().copy())
                i += len(g)
            return np.array(out)
        finally:
            ctx.close()

    a, b = rows(1), rows(n)
    assert a.shape == b.shape == (n, model.n_vocab)
    return float(np.abs(a - b).max())


@pytest.fixture(scope="module")
def exact(model):
    """The exact configuration is on (else skip: fast kernels promise no bit-identity)."""
    if not exact_kernels():
        pytest.skip("LOCALSPEC_KERNELS=fast: no bit-identity promised; near-tie tests cover this case")
    return True


def test_batched_rows_are_bit_identical(model, exact):
    d = max_batched_row_difference(model)
    assert d == 0.0, f"batched rows differ from single-token decodes by up to {d:.3g} with the exact kernels on"


def test_speculative_equals_plain_exactly_with_trees_and_long_context(engine, exact):
    prompt = engine.tokenize(PROSE * 30)[:620]
    g = SamplingParams.greedy()
    old, old_adaptive = engine.drafter, engine.adaptive
    try:
        engine.reset()
        ref = engine.generate(prompt, max_tokens=200, sampling=g, speculative=False)
        # decoy branches come first, so accepted nodes land out of cell order and are re-decoded
        engine.drafter = ScriptedDrafter(prompt + ref.token_ids, chain=6, decoys=1, wrong_every=5, seed=7, decoys_first=True)
        engine.adaptive = False
        engine.reset()
        res = engine.generate(prompt, max_tokens=200, sampling=g)
        assert res.token_ids == ref.token_ids
        assert res.stats.num_accepted_tokens > 60
        assert res.stats.n_redecoded_tokens > 30
        engine.drafter, engine.adaptive = old, old_adaptive
        engine.reset()
        ng = engine.generate(prompt, max_tokens=200, sampling=g)
        assert ng.token_ids == ref.token_ids
    finally:
        engine.drafter, engine.adaptive = old, old_adaptive


def test_seeded_sampling_equals_plain_exactly(engine, exact):
    prompt = engine.tokenize(PROSE * 3)
    sp = SamplingParams(temperature=0.9, seed=42)
    engine.reset()
    ref = engine.generate(prompt, max_tokens=120, sampling=sp, speculative=False)
    engine.reset()
    res = engine.generate(prompt, max_tokens=120, sampling=sp)
    assert res.token_ids == ref.token_ids
