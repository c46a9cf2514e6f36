"""An error raised inside a generation step leaves the engine consistent."""

import re

import pytest

from localspec import SamplingParams
from localspec.errors import GrammarError


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_grammar_error_mid_step_keeps_the_cache_consistent(engine, drafter):
    """The grammar is complete after " yes" but every end-of-generation token is banned: the
    step raises GrammarError after its tree was decoded. The stream still gets its result, the
    error is the GrammarError (not a KV check failure), and the next request works."""
    old = engine.drafter_name
    engine.set_drafter(drafter)
    try:
        engine.reset()
        prompt = "Question: Is the sky blue?\nAnswer:"
        banned = {t: float("-inf") for t in engine.model.eog_ids}
        sampling = SamplingParams.greedy(grammar='root ::= " yes" | " no"', logit_bias=banned)
        stream = engine.stream(prompt, max_tokens=8, sampling=sampling)
        with pytest.raises(GrammarError):
            for _ in stream:
                pass
        assert stream.result is not None and stream.result.text in ("", " yes", " no")
        engine.cache.check()
        r = engine.generate(prompt, max_tokens=4, sampling=SamplingParams.greedy())
        assert r.stats.n_generated_tokens == 4 and r.stats.n_cached_tokens > 0
    finally:
        engine.set_drafter(old)


def test_a_closed_engine_is_an_error_not_a_crash(model):
    # generating from a closed engine handed llama.cpp the freed KV cache: a segfault of the
    # whole process (a token-id prompt; a text prompt aborted in the freed vocabulary instead)
    from conftest import frozen_cost_model
    from localspec import Engine
    from localspec.errors import LocalSpecError

    e = Engine(model, drafter="ngram", n_ctx=256, cost_model=frozen_cost_model())
    assert e.generate([2, 9259], max_tokens=2, sampling=SamplingParams.greedy()).finish_reason == "length"
    e.close()
    for call in (lambda: e.generate([2, 9259], max_tokens=2, sampling=SamplingParams.greedy()),
                 lambda: e.generate("Hi", max_tokens=2), lambda: e.tokenize("Hi"),
                 lambda: e.generate_batch(["Hi"], max_tokens=2), e.reset,
                 lambda: e.set_drafter("none")):  # fmt: skip (reset: a DecodeError; set_drafter: no error)
        with pytest.raises(LocalSpecError, match="^the engine is closed: make a new Engine$"):
            call()


def test_arguments_of_the_wrong_type_are_invalid_request_errors(model):
    """Each was a raw TypeError / AttributeError from deep inside (or, for ``drafter=5``, an
    engine that failed at its first request and at ``close``); ``drafter="bogus"`` was a bare
    ValueError, and ``n_threads=-3`` was taken."""
    from conftest import frozen_cost_model
    from localspec import Engine
    from localspec.errors import InvalidRequestError

    for kw, says in ((dict(drafter=5), "drafter must be a drafter name, a Drafter or None, got int"),
                     (dict(drafter="bogus"), "unknown drafter 'bogus'; choose one of none, ngram"),
                     (dict(n_ctx="64"), "n_ctx must be a whole number of at least 16, got '64'"),
                     (dict(n_threads=-3), "n_threads must be a whole number of at least 1, got -3")):  # fmt: skip
        with pytest.raises(InvalidRequestError, match=says):
            Engine(model, n_ctx=kw.pop("n_ctx", 256), cost_model=frozen_cost_model(), **kw)
    e = Engine(model, drafter="none", n_ctx=256, cost_model=frozen_cost_model())
    try:
        with pytest.raises(InvalidRequestError, match=r"sampling must be a SamplingParams .*got \{'temperature': 0\}"):
            e.generate("Hi", max_tokens=2, sampling={"temperature": 0})
        assert e.generate("Hi", max_tokens=2, sampling=SamplingParams.greedy()).finish_reason == "length"
    finally:
        e.close()


def test_more_engine_arguments_of_the_wrong_type(model):
    from conftest import frozen_cost_model
    from localspec import Engine
    from localspec.errors import InvalidRequestError

    for kw, says in ((dict(max_tree_nodes="8"), "max_tree_nodes must be a whole number of at least 1, got '8'"),
                     (dict(n_gpu_layers="1"), "n_gpu_layers must be a whole number of at least -1, got '1'"),
                     (dict(model=5), "model must be a GGUF path, a Model or None, got 5"),
                     (dict(cost_model=5), "cost_model must be a CostModel or None, got 5"),
                     (dict(draft_memory="x"), "draft_memory must be a DraftMemory or None, got 'x'")):  # fmt: skip
        args = dict(model=model, drafter="none", n_ctx=256, cost_model=frozen_cost_model(), **{})
        args.update(kw)
        with pytest.raises(InvalidRequestError, match=f"^{re.escape(says)}$"):
            Engine(**args)
