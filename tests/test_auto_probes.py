"""``auto`` with a model drafter that does not pay: rare probes, plain decoding's tokens, and
the model back once its drafts are right (issue 30, part 4), on the real default model."""

from __future__ import annotations

from conftest import fixed_cost_model
from helpers import ScriptedModelDrafter, assert_same_as_plain
from localspec import Engine, SamplingParams
from localspec.drafters.auto import AutoDrafter
from localspec.drafters.ngram import NgramDrafter

GREEDY = SamplingParams.greedy(seed=0)
TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def test_auto_probes_a_model_that_does_not_pay_rarely_and_takes_it_back_when_right(model):
    """A scripted model drafter whose drafts are wrong drafts only on the policy's probes
    (gaps of at least ``explore_every``, 4 here, long enough that a probe's rows cost at most
    10% of the steps between: 15 or so, about 4 of 64 steps; every 5th step before), and the
    output is plain decoding's, and the failed probes leave the score calibration alone; with
    its drafts right, its next probe pays and it drafts most of the tokens, still plain
    decoding's."""
    e = Engine(model, drafter="none", n_ctx=2048, cost_model=fixed_cost_model())
    try:
        prompt = e.tokenize(TEXT)
        ref = e.generate(prompt, max_tokens=64, sampling=GREEDY, speculative=False)
        m = ScriptedModelDrafter(prompt + ref.token_ids, right=False)
        # an n-gram part that drafts nothing (greedy Gemma 3 270M repeats itself: the n-grams
        # would draft most of the answer and leave the model few steps)
        e.set_drafter(AutoDrafter(m, NgramDrafter(max_occurrences=0)))
        e.policy.explore_every, e.policy.explore_budget = 4, 0.1
        e.reset()
        res = e.generate(prompt, max_tokens=64, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        n_steps = res.stats.n_steps
        assert n_steps >= 40 and 3 <= m.extends <= 8, (n_steps, m.extends)
        # the failed probes are no evidence about the request's drafts: its score calibration
        # saw no verified tree, and the long-run exponent the next request starts from is 1
        assert e.policy.calibration.log_center == 0.0
        m.right = True
        m.extends = 0
        e.reset()
        res = e.generate(prompt, max_tokens=64, sampling=GREEDY)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
        assert res.stats.token_sources.get("draft_model", 0) >= 32, res.stats.token_sources
        assert res.stats.n_steps <= 32 and m.extends >= res.stats.n_steps // 2
    finally:
        e.close()
