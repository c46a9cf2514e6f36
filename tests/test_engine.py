"""Real-model tests of the engine: lossless greedy and sampled decoding, stops, limits,
streaming, cache reuse, errors."""

import math
import re

import numpy as np
import pytest

from conftest import chisquare_pvalue, frozen_cost_model
from helpers import RandomDrafter, ScriptedDrafter, assert_same_as_plain
from localspec import Engine, SamplingParams
from localspec.errors import ContextOverflowError, GrammarError, InvalidRequestError
from localspec.request_state import RequestState
from localspec.tree import TokenSource, TreeBuilder
from localspec.verify import verify_greedy, verify_rejection

GREEDY = SamplingParams.greedy()
PROMPT = "The three primary colours are red, yellow and blue. The three primary colours are"


@pytest.fixture
def eng(engine):
    """The shared engine, with its drafter restored afterwards."""
    old = engine.drafter
    old_adaptive = engine.adaptive
    yield engine
    engine.drafter = old
    engine.adaptive = old_adaptive


def plain(eng, prompt, n, sampling=GREEDY, **kw):
    eng.reset()
    return eng.generate(prompt, max_tokens=n, sampling=sampling, speculative=False, **kw)


def test_plain_decoding_is_deterministic_and_counts(eng):
    a = plain(eng, PROMPT, 24)
    b = plain(eng, PROMPT, 24)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    s = a.stats
    assert s.n_steps == 24 and s.mean_acceptance_length == 1.0 and s.num_draft_tokens == 0
    assert s.token_sources == {"decode": 24}
    assert a.finish_reason == "length"


def test_oracle_drafter_is_accepted_and_output_unchanged(eng):
    ref = plain(eng, PROMPT, 40)
    prompt_ids = eng.tokenize(PROMPT)
    eng.drafter = ScriptedDrafter(prompt_ids + ref.token_ids, chain=6)
    eng.adaptive = False
    eng.reset()
    res = eng.generate(PROMPT, max_tokens=40, sampling=GREEDY)
    assert_same_as_plain(eng, prompt_ids, ref.token_ids, res.token_ids)
    s = res.stats
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0
    assert s.mean_acceptance_length > 4
    assert s.n_steps < 12


@pytest.mark.parametrize("kind", ["random", "wrong", "decoys"])
def test_adversarial_drafters_still_give_the_target_argmax(eng, kind):
    prompt_ids = eng.tokenize(PROMPT)
    ref = plain(eng, PROMPT, 32)
    script = prompt_ids + ref.token_ids
    eng.drafter = {
        "random": RandomDrafter(width=3, depth=4, seed=1),
        "wrong": ScriptedDrafter(script, chain=5, wrong_every=3),
        "decoys": ScriptedDrafter(script, chain=4, decoys=2, seed=3),
    }[kind]
    eng.adaptive = False
    eng.reset()
    res = eng.generate(PROMPT, max_tokens=32, sampling=GREEDY)
    assert_same_as_plain(eng, prompt_ids, ref.token_ids, res.token_ids)
    assert res.stats.num_draft_tokens > 0


def test_each_emitted_token_is_the_argmax_of_its_verification_row(model):
    """By construction: checked on a real tree decode with random drafts."""
    from localspec.backend import Context, SequenceCache

    ctx = Context(model, n_ctx=512, n_seq_max=9)
    cache = SequenceCache(ctx, max_tree_nodes=16)
    try:
        prompt = model.tokenize(PROMPT)
        cache.prefill(prompt[:-1])
        rng = np.random.default_rng(0)
        b = TreeBuilder(prompt[-1])
        top = 0
        for _ in range(3):
            node = 0
            for _d in range(3):
                node = b.add(node, int(rng.integers(0, 262144)), source=TokenSource.NGRAM)
        # make one branch start with the real argmax so something is accepted
        tree = b.build()
        lay, logits = cache.decode_tree(tree)
        top = int(np.argmax(logits[0]))
        cache.commit(tree, lay, [])
        cache.truncate(len(prompt) - 1)
        b2 = TreeBuilder(prompt[-1])
        n1 = b2.add(0, top, source=TokenSource.NGRAM)
        b2.add(n1, 5, source=TokenSource.NGRAM)
        b2.add(0, 7, source=TokenSource.NGRAM)
        tree = b2.build()
        lay, logits = cache.decode_tree(tree)
        req = RequestState(GREEDY, model, prompt)
        res = verify_greedy(tree, logits, req.cursor(cache.n_past + 1))
        assert res.path == [n1]
        for tok, row in zip(res.tokens, res.rows):
            assert tok == int(np.argmax(logits[row]))
        cache.commit(tree, lay, res.path)
    finally:
        ctx.close()


@pytest.mark.parametrize("max_tokens", list(range(1, 13)))
def test_max_tokens_never_exceeded_with_drafts_of_4(eng, max_tokens):
    prompt_ids = eng.tokenize(PROMPT)
    ref = plain(eng, PROMPT, 12)
    eng.drafter = ScriptedDrafter(prompt_ids + ref.token_ids + [9] * 20, chain=4)
    eng.adaptive = False
    eng.reset()
    res = eng.generate(PROMPT, max_tokens=max_tokens, sampling=GREEDY)
    assert len(res.token_ids) == max_tokens
    assert res.finish_reason == "length"
    assert_same_as_plain(eng, prompt_ids, ref.token_ids[:max_tokens], res.token_ids)


def test_stop_string_inside_an_accepted_block_cuts_everything(eng):
    prompt_ids = eng.tokenize(PROMPT)
    ref = plain(eng, PROMPT, 30)
    text = ref.text
    # a stop string of two tokens from the middle of the reference continuation, whose first
    # occurrence is there
    for j in range(8, 26):
        k = len(eng.model.detokenize(ref.token_ids[:j]))
        stop = text[k : k + len(eng.model.detokenize(ref.token_ids[j : j + 2]))]
        if len(stop.strip()) >= 2 and text.find(stop) == k:
            break
    else:
        pytest.fail("no unique stop string in the reference text")
    eng.drafter = ScriptedDrafter(prompt_ids + ref.token_ids, chain=8)
    eng.adaptive = False
    eng.reset()
    stream = eng.stream(PROMPT, max_tokens=30, sampling=GREEDY, stop=[stop])
    chunks = [c.text for c in stream]
    res = stream.result
    assert res.finish_reason == "stop" and res.stop == stop
    assert res.text == text[: text.index(stop)]
    assert "".join(chunks) == res.text
    n = len(res.token_ids)
    assert eng.model.detokenize(res.token_ids) == res.text[: len(eng.model.detokenize(res.token_ids))]
    assert res.stats.n_generated_tokens == n == len(res.sources)
    assert res.stats.num_accepted_tokens == sum(1 for s in res.sources if s == TokenSource.NGRAM)
    # the stop was completed inside a multi-token accepted block
    assert res.stats.mean_acceptance_length > 1.5
    # KV cache cut at the same point: prompt + kept tokens (or fewer)
    assert eng.cache.n_past <= len(prompt_ids) + n
    assert eng.cache.tokens == (prompt_ids + res.token_ids)[: eng.cache.n_past]


def test_end_of_generation_inside_an_accepted_block(eng):
    """A grammar forces a short answer, then only end-of-generation tokens are allowed; the
    drafter proposes the answer and the EOS in one block."""
    grammar = 'root ::= " yes" | " no"'
    sp = SamplingParams.greedy(grammar=grammar)
    ref = plain(eng, "Is the sky blue? Answer:", 10, sampling=sp)
    assert ref.finish_reason == "stop" and ref.stop == "<eog>"
    assert ref.text in (" yes", " no")
    prompt_ids = eng.tokenize("Is the sky blue? Answer:")
    eos = eng.model.eos
    eng.drafter = ScriptedDrafter(prompt_ids + ref.token_ids + [eos, 1000, 1001], chain=6)
    eng.adaptive = False
    eng.reset()
    res = eng.generate("Is the sky blue? Answer:", max_tokens=10, sampling=sp)
    assert res.finish_reason == "stop" and res.stop == "<eog>"
    assert res.token_ids == ref.token_ids and res.text == ref.text
    assert eos not in res.token_ids


def test_grammar_errors_are_clear(eng):
    with pytest.raises(GrammarError):
        eng.generate("x", max_tokens=2, sampling=SamplingParams.greedy(grammar="root ::= ("))
    # the engine is still usable
    assert len(eng.generate("x", max_tokens=2, sampling=GREEDY).token_ids) == 2


def test_a_grammar_dead_end_mid_generation_keeps_the_cache_consistent(eng):
    # "a", then only end-of-generation is allowed, and the bias bans it: verification raises
    eos_ban = {t: float("-inf") for t in eng.model.eog_ids}
    sp = SamplingParams.greedy(grammar='root ::= "a"', logit_bias=eos_ban)
    eng.reset()
    stream = eng.stream("Say a:", max_tokens=5, sampling=sp)
    with pytest.raises(GrammarError):
        for _ in stream:
            pass
    eng.cache.check()
    assert eng.cache.tokens == eng.tokenize("Say a:") + stream.result.token_ids
    assert len(eng.generate("x", max_tokens=2, sampling=GREEDY).token_ids) == 2


def test_utf8_streaming_is_byte_identical(eng):
    prompt = "Translate to Japanese and Chinese with emoji: I love tea 🍵 ->"
    for spec in (False, True):
        eng.reset()
        stream = eng.stream(prompt, max_tokens=48, sampling=SamplingParams(seed=3, temperature=0.9), speculative=spec)
        chunks = [c.text for c in stream]
        assert "".join(chunks) == stream.result.text
        assert "".join(chunks).encode("utf-8") == stream.result.text.encode("utf-8")


def test_prompt_longer_than_context_is_a_clear_error(eng):
    long = "word " * 5000
    n = len(eng.tokenize(long))
    with pytest.raises(ContextOverflowError) as e:
        eng.generate(long, max_tokens=4)
    assert str(e.value) == (f"the prompt has {n} tokens but the context holds {eng.n_ctx}; shorten it or give a context "
                            f"of at least {n + 1} tokens ({n + 4} for all 4 tokens asked): Engine(n_ctx=), --n-ctx")  # fmt: skip
    assert len(eng.generate("Hello", max_tokens=3, sampling=GREEDY).token_ids) == 3


def test_bad_requests(eng):
    with pytest.raises(InvalidRequestError):
        eng.generate("x", max_tokens=-1)
    for bad in (None, 2.5, True, "8"):  # not a TypeError from a comparison deep inside
        with pytest.raises(InvalidRequestError, match="max_tokens must be a whole number >= 0, got"):
            eng.generate("x", max_tokens=bad)
        with pytest.raises(InvalidRequestError, match="max_tokens must be a whole number"):
            list(eng.stream("x", max_tokens=bad))
    assert len(eng.generate("x", max_tokens=np.int64(2), sampling=GREEDY).token_ids) == 2
    with pytest.raises(InvalidRequestError):
        eng.generate([10**9], max_tokens=1)
    with pytest.raises(InvalidRequestError):
        eng.generate("", max_tokens=1, add_special=False)
    for bad in (None, 5, b"bytes"):  # was "'NoneType' object is not iterable" (or bytes read as ids)
        with pytest.raises(TypeError, match="prompt must be text"):
            eng.generate(bad, max_tokens=1)


def test_nearly_full_context(model):
    e = Engine(model, drafter="ngram", n_ctx=256, cost_model=frozen_cost_model())
    try:
        text = "a b c d e f g h " * 200
        prompt = e.tokenize(text)[:240]
        res = e.generate(prompt, max_tokens=100, sampling=GREEDY)
        assert res.finish_reason == "length"
        assert len(prompt) + len(res.token_ids) <= e.n_ctx + 1
        assert len(res.token_ids) >= 10
        e.cache.check()
        ref = e.generate(prompt, max_tokens=len(res.token_ids), sampling=GREEDY, speculative=False)
        assert_same_as_plain(e, prompt, ref.token_ids, res.token_ids)
    finally:
        e.close()


def test_kv_reuse_between_requests(eng):
    eng.reset()
    a = eng.generate(PROMPT, max_tokens=8, sampling=GREEDY)
    b = eng.generate(PROMPT, max_tokens=8, sampling=GREEDY)
    assert b.stats.n_cached_tokens == len(eng.tokenize(PROMPT)) - 1
    assert b.stats.n_generated_tokens == 8
    assert_same_as_plain(eng, eng.tokenize(PROMPT), a.token_ids, b.token_ids)
    c = eng.generate(PROMPT + a.text + " And", max_tokens=4, sampling=GREEDY)
    assert c.stats.n_cached_tokens >= len(eng.tokenize(PROMPT))


def test_cancel_mid_stream_leaves_engine_consistent(eng):
    eng.reset()
    stream = eng.stream(PROMPT, max_tokens=200, sampling=GREEDY)
    got = 0
    for _ in stream:
        got += 1
        if got == 5:
            stream.cancel()
    assert stream.result.finish_reason == "cancelled"
    assert 5 <= len(stream.result.token_ids) < 200
    eng.cache.check()
    # closing a stream early also leaves it consistent
    s2 = eng.stream(PROMPT, max_tokens=50, sampling=GREEDY)
    next(iter(s2))
    s2.close()
    eng.cache.check()
    assert len(eng.generate("Hi", max_tokens=3, sampling=GREEDY).token_ids) == 3


def test_seed_gives_the_same_text_with_and_without_speculation(eng):
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
    prompt = PROMPT + " red, yellow and blue. The three primary colours are"
    p = plain(eng, prompt, 48, sampling=sp)
    eng.reset()
    s = eng.generate(prompt, max_tokens=48, sampling=sp)
    assert s.stats.num_accepted_tokens > 0
    # identical with the exact kernels; elsewhere only a near-tie of the perturbed logits may flip
    assert_same_as_plain(eng, eng.tokenize(prompt), p.token_ids, s.token_ids, sampling=sp)


def test_penalties_and_bias_apply_identically_with_speculation(eng):
    sp = SamplingParams.greedy(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, logit_bias={236761: -2.0})
    prompt_ids = eng.tokenize(PROMPT)
    ref = plain(eng, PROMPT, 32, sampling=sp)
    ref_nopen = plain(eng, PROMPT, 32)
    assert ref.token_ids != ref_nopen.token_ids  # the penalties matter here
    eng.drafter = ScriptedDrafter(prompt_ids + ref.token_ids, chain=6)
    eng.adaptive = False
    eng.reset()
    res = eng.generate(PROMPT, max_tokens=32, sampling=sp)
    assert res.stats.num_accepted_tokens > 10
    assert_same_as_plain(eng, prompt_ids, ref.token_ids, res.token_ids)


def test_logprobs_match_plain_decoding_within_tolerance(eng):
    sp = SamplingParams.greedy(logprobs=3)
    prompt_ids = eng.tokenize(PROMPT)
    ref = plain(eng, PROMPT, 16, sampling=sp)
    eng.drafter = ScriptedDrafter(prompt_ids + ref.token_ids, chain=5)
    eng.adaptive = False
    eng.reset()
    res = eng.generate(PROMPT, max_tokens=16, sampling=sp)
    assert len(res.logprobs) == len(res.token_ids)
    n = next((i for i, (x, y) in enumerate(zip(ref.token_ids, res.token_ids)) if x != y), len(ref.token_ids))
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(ref.logprobs[:n], res.logprobs[:n])]
    assert max(diffs) < 0.25  # batched vs single-token logits (docs/architecture.md)
    for lp in res.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1]


def test_real_model_rejection_and_gumbel_reproduce_the_target_distribution(model):
    """Chi-square on real logits: verify one real tree many times with different seeds."""
    from localspec.backend import Context, SequenceCache

    ctx = Context(model, n_ctx=512, n_seq_max=9)
    cache = SequenceCache(ctx, max_tree_nodes=16)
    try:
        prompt = model.tokenize("Once upon a time, there was a")
        cache.prefill(prompt[:-1])
        lay, lg = cache.decode_tree(TreeBuilder(prompt[-1]).build())
        root_row = lg[0].copy()
        cache.commit(TreeBuilder(prompt[-1]).build(), lay, [])
        cache.truncate(len(prompt) - 1)
        top = np.argsort(-root_row)[:3]
        b = TreeBuilder(prompt[-1])
        kids = [b.add(0, int(t), source=TokenSource.NGRAM) for t in top]
        b.add(kids[0], 13, source=TokenSource.NGRAM)
        tree = b.build()
        lay, lg = cache.decode_tree(tree)
        rows = lg.copy()
        cache.commit(tree, lay, [])
        sp = SamplingParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0)
        proc_probs = RequestState(sp.with_seed(0), model, prompt).cursor(len(prompt)).target_probs(rows[0])
        support = np.flatnonzero(proc_probs)
        for mode, fn in (("rejection", verify_rejection), ("gumbel", verify_greedy)):
            counts = np.zeros(model.n_vocab)
            p = SamplingParams(**{**sp.__dict__, "verify": mode})
            for seed in range(3000):
                req = RequestState(p.with_seed(seed), model, prompt)
                res = fn(tree, rows, req.cursor(len(prompt)))
                counts[res.tokens[0]] += 1
            assert counts[np.setdiff1d(np.arange(model.n_vocab), support)].sum() == 0
            assert chisquare_pvalue(counts[support], proc_probs[support]) > 1e-3, mode
    finally:
        ctx.close()


def test_max_time_ms_stops_generation(eng):
    eng.reset()
    res = eng.generate(PROMPT, max_tokens=500, sampling=GREEDY, max_time_ms=1)
    assert res.finish_reason == "time"
    assert 1 <= len(res.token_ids) < 500
    eng.cache.check()


def test_draft_context_is_used_by_the_ngram_drafter(eng):
    """Text given as draft context (e.g. an editor's suffix) is drafted from. A fresh n-gram
    drafter per run and no adaptive policy: the counts depend on nothing but the drafter (the
    adaptive policy learns from step times, which vary on a loaded machine)."""
    from localspec.drafters import make_drafter

    prompt = "A short story about a lighthouse keeper named Elias:"
    ref = plain(eng, prompt, 24)
    eng.adaptive = False
    runs = []
    for ctx in ([], [ref.token_ids]):
        eng.drafter = make_drafter("ngram")
        eng.reset()
        runs.append(eng.generate(prompt, max_tokens=24, sampling=GREEDY, draft_context=ctx))
    without, with_ctx = runs
    assert with_ctx.token_ids == ref.token_ids == without.token_ids
    assert with_ctx.stats.num_accepted_tokens >= without.stats.num_accepted_tokens + 8
    assert with_ctx.stats.mean_acceptance_length > 2


def test_cancel_after_end_does_not_leak_into_the_next_request(eng):
    s = eng.stream("Hi", max_tokens=2, sampling=GREEDY)
    list(s)
    s.cancel()  # too late: must not abort the next request
    res = eng.generate("Hello", max_tokens=3, sampling=GREEDY)
    assert res.finish_reason == "length" and len(res.token_ids) == 3


def test_small_contexts_work_or_are_refused_clearly(model):
    """llama.cpp aborts the process when a context's sequences outnumber its tokens: a small
    context gets smaller trees, a tiny one a clear error, never an abort."""
    from localspec.backend import Context
    from localspec.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="at least 16"):
        Engine(model, n_ctx=8)
    with pytest.raises(InvalidRequestError, match="cannot hold 65 sequences"):
        Context(model, n_ctx=64, n_seq_max=65)
    e = Engine(model, n_ctx=64, cost_model=frozen_cost_model())
    try:
        assert e.max_tree_nodes == 31
        prompt = "one two three four, one two three four, one two"
        spec = e.generate(prompt, max_tokens=12, sampling=GREEDY)
        e.reset()
        assert spec.token_ids == e.generate(prompt, max_tokens=12, sampling=GREEDY, speculative=False).token_ids
        with pytest.raises(ContextOverflowError):
            e.generate(" ".join(str(i) for i in range(100)), max_tokens=4, sampling=GREEDY)
        assert e.generate(prompt, max_tokens=2, sampling=GREEDY).finish_reason == "length"  # still usable
    finally:
        e.close()


def test_a_stream_started_on_one_thread_can_finish_on_another(eng):
    """A stream holds the engine's lock from its first chunk to its end; a consumer that takes
    the first chunk on one thread and the rest on another (both alive, so their idents differ)
    gets the whole output, and the engine works afterwards. With ``threading.RLock`` the end
    of the stream raised ``RuntimeError: cannot release un-acquired lock`` (seen under load in
    tests/test_rpc.py, where it replaced the stream's WorkerLostError)."""
    import threading

    ref = eng.generate("The capital of France is", max_tokens=12, sampling=GREEDY, speculative=False)
    stream = eng.stream("The capital of France is", max_tokens=12, sampling=GREEDY, speculative=False)
    got: list = []
    first_done, release_first = threading.Event(), threading.Event()

    def first():
        got.append(next(stream).token)
        first_done.set()
        release_first.wait(60)  # stay alive while the other thread finishes the stream

    a = threading.Thread(target=first)
    a.start()
    assert first_done.wait(120)
    box: dict = {}

    def rest():
        try:
            box["tokens"] = [c.token for c in stream if c.token >= 0]
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    b = threading.Thread(target=rest)
    b.start()
    b.join(120)
    release_first.set()
    a.join(60)
    assert "error" not in box, box.get("error")
    assert got + box["tokens"] == ref.token_ids
    assert eng.generate("The capital of France is", max_tokens=12, sampling=GREEDY, speculative=False).token_ids == ref.token_ids


STORY = "Once upon a time"


def test_a_request_in_the_thread_of_an_open_stream_is_refused_and_the_stream_stays_right(eng):
    """The engine's lock let its holder's thread in again: a ``generate`` between two chunks
    of a stream decoded on the KV cache the stream went on with, and both outputs were wrong
    without a word. Now the request raises and the stream's output is the one it has alone."""
    alone = eng.generate(STORY, max_tokens=16, sampling=GREEDY).token_ids
    with eng.stream(STORY, max_tokens=16, sampling=GREEDY) as stream:
        got = [next(stream).token]
        for request in (lambda: eng.generate("Hello", max_tokens=4, sampling=GREEDY), eng.reset,
                        lambda: eng.set_drafter("ngram"),
                        lambda: eng.stream("Hello", max_tokens=4)):  # refused when made, not at its first chunk
            with pytest.raises(InvalidRequestError, match="a stream on this engine is still open in this thread"):
                request()
        got += [c.token for c in stream if c.token >= 0]
    assert got == alone and stream.result.finish_reason == "length"
    assert eng.generate(STORY, max_tokens=16, sampling=GREEDY).token_ids == alone


def test_breaking_out_of_a_stream_loop_frees_the_engine_for_another_thread(eng):
    """``break`` out of ``for chunk in engine.stream(...)`` drops the stream: it ends there
    (the engine's weak reference and no reference cycle keep it alive no longer), so a
    request from another thread runs instead of waiting for ever."""
    import threading

    for chunk in eng.stream(STORY, max_tokens=64, sampling=GREEDY):
        if chunk.token >= 0:
            break
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=eng.generate("Hi", max_tokens=4, sampling=GREEDY)), daemon=True)
    t.start()
    t.join(300)
    assert "r" in box and len(box["r"].token_ids) == 4


def test_closing_an_engine_closes_its_open_stream(model):
    e = Engine(model, drafter="none", n_ctx=256, cost_model=frozen_cost_model())
    stream = e.stream(STORY, max_tokens=64, sampling=GREEDY)
    next(stream)
    e.close()
    assert stream.result is not None and stream.result.finish_reason == "cancelled"


def test_a_stream_left_open_at_exit_prints_nothing():
    """It printed "Exception ignored in: <generator object Engine._run ...>" with a
    DecodeError (the stream finalized after its engine's context)."""
    import subprocess
    import sys

    code = ("import localspec\n"
            "e = localspec.Engine(drafter='none', n_ctx=256)\n"
            "s = e.stream('Once upon a time', max_tokens=64, sampling=localspec.SamplingParams.greedy())\n"
            "next(s)\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Exception" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_stop_string_is_one_stop_not_its_characters(eng):
    """``stop="word"`` was ``list("word")``: a stop at each of its characters (the OpenAI
    server takes one string as one stop); a stop that is not text is refused."""
    alone = eng.generate(STORY, max_tokens=24, sampling=GREEDY).text
    words = alone.split()
    assert len(words) >= 3, alone
    w = " " + words[2]  # its space comes earlier in the text than the word
    cut = eng.generate(STORY, max_tokens=24, sampling=GREEDY, stop=w)
    assert cut.text == alone[: alone.index(w)] == eng.generate(STORY, max_tokens=24, sampling=GREEDY, stop=[w]).text
    assert cut.finish_reason == "stop" and cut.stop == w
    for bad, says in ((None, "got NoneType"), ([""], "must not be empty"), (["a", 3], "got an item 3")):
        with pytest.raises(InvalidRequestError, match=says):
            eng.generate(STORY, max_tokens=2, sampling=GREEDY, stop=bad)


def test_generate_batch_refuses_one_text_and_names_a_bad_prompt(eng):
    """``generate_batch("abc")`` ran three prompts, "a", "b" and "c"."""
    with pytest.raises(InvalidRequestError, match="not one text"):
        eng.generate_batch("abc", max_tokens=2, sampling=GREEDY)
    out = eng.generate_batch([None, ["a"], "Hi"], max_tokens=2, sampling=GREEDY, return_exceptions=True)
    assert isinstance(out[0], TypeError) and "got NoneType" in str(out[0])
    assert isinstance(out[1], TypeError) and "got an item 'a'" in str(out[1])
    assert out[2].token_ids == eng.generate("Hi", max_tokens=2, sampling=GREEDY).token_ids


def test_max_tokens_of_a_batch_and_max_time_ms_are_checked_as_generate_checks_them(eng):
    """``generate_batch(max_tokens=np.int64(4))`` was "'numpy.int64' object is not iterable",
    ``1.5`` the same TypeError; ``max_time_ms="5"`` a TypeError from a comparison, and NaN meant
    no limit at all (a new user's report)."""
    import numpy as np

    (one,) = eng.generate_batch(["Hi"], max_tokens=np.int64(3), sampling=GREEDY)
    assert one.token_ids == eng.generate("Hi", max_tokens=3, sampling=GREEDY).token_ids
    for bad in (1.5, None, [2, "3"]):
        with pytest.raises(InvalidRequestError, match=r"^max_tokens must be a whole number >= 0, got "):
            eng.generate_batch(["Hi", "Yo"], max_tokens=bad, sampling=GREEDY)
    for bad in ("5", math.nan, -1, True):
        with pytest.raises(InvalidRequestError, match=rf"^max_time_ms must be a number of milliseconds > 0 or None, got {re.escape(repr(bad))}$"):
            eng.generate("Hi", max_tokens=2, sampling=GREEDY, max_time_ms=bad)
    assert eng.generate("Hi", max_tokens=2, sampling=GREEDY, max_time_ms=np.float32(1e6)).finish_reason == "length"


def test_closing_an_engine_while_another_thread_decodes_waits_for_its_step():
    """``close()`` from another thread freed the context under the running decode: the process
    died (SIGSEGV). Now the stream is cancelled, close waits for its step, and the stream ends
    as cancelled. In a child process: a crash would take the test worker with it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import threading
        import localspec
        e = localspec.Engine(drafter="none", n_ctx=4096)
        s = e.stream("Once upon a time", max_tokens=3000, sampling=localspec.SamplingParams.greedy())
        next(s)
        closer = threading.Thread(target=e.close)
        closer.start()
        n = sum(1 for _ in s)
        closer.join(300)
        assert not closer.is_alive() and n < 2999, n
        print(s.result.finish_reason)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "cancelled", (r.returncode, r.stderr[-2000:])


def test_draft_context_and_prompt_text_are_checked_before_anything_runs(eng):
    """Token ids in ``draft_context`` outside the vocabulary reached llama.cpp ("invalid
    token[1] = 999999", then a DecodeError mid-generation); a lone surrogate in a text prompt
    was a UnicodeEncodeError."""
    toks = eng.tokenize(STORY)
    with pytest.raises(InvalidRequestError, match="token id 999999 is outside the vocabulary"):
        eng.generate(toks, max_tokens=4, sampling=GREEDY, draft_context=[toks[1:] + [999999]])
    with pytest.raises(TypeError, match="got int"):
        eng.generate(toks, max_tokens=4, sampling=GREEDY, draft_context=[5])
    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate at character 1"):
        eng.generate("a\ud800b", max_tokens=4, sampling=GREEDY)
    for prompts in (5, (p for p in ["Hi"]), {"a": 1}):
        with pytest.raises(InvalidRequestError, match="prompts must be a list of prompts"):
            eng.generate_batch(prompts, max_tokens=2, sampling=GREEDY)
    assert eng.generate(toks, max_tokens=4, sampling=GREEDY, draft_context=[toks[1:]]).token_ids == \
        eng.generate(toks, max_tokens=4, sampling=GREEDY).token_ids
