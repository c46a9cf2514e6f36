"""Unit tests of the completion server's pure parts: request parsing and validation, sampler
mapping, FIM prompt layout and truncation, editor stopping rules, response shaping."""

import json
import math

import numpy as np
import pytest

from localspec.sampling import LogitsProcessor, SamplingParams
from localspec.server.fields import RequestError
from localspec.server.prompt import (
    SNIPPET_SEPARATOR,
    ExtraChunk,
    build_infill_prompt,
    clip_chunks,
    clip_head,
    clip_tail,
)
from localspec.server.protocol import parse_request
from localspec.server.response import dumps, select_fields, sse
from localspec.server.sampling_fields import canonical_sampler_name, parse_sampler_fields, resolve_sampling
from localspec.server.stops import EditorStops
from plugin_requests import llama_vim_fim

LLAMA_VIM = llama_vim_fim("def f(x):\n", "    return ", "\n", [{"text": "import os\n", "filename": "a.py"}])


# -- protocol -------------------------------------------------------------------------------


def test_llama_vim_request_parses():
    r = parse_request("infill", LLAMA_VIM)
    assert r.kind == "infill" and r.input_prefix == "def f(x):\n" and r.prompt == "    return "
    assert r.input_extra[0].filename == "a.py" and r.n_predict == 128 and r.n_indent == 4
    assert r.t_max_predict_ms == 1000 and r.client_key == "slot:0" and not r.is_warmup
    assert r.sampler_fields.samplers == ["top_k", "top_p", "infill"] and r.sampler_fields.top_k == 40


def test_unknown_fields_are_ignored_and_unimplemented_ones_listed():
    r = parse_request("infill", {**LLAMA_VIM, "whatever": {"x": 1}, "lora": [{"id": 0, "scale": 0.5}], "model": "m"})
    assert r.not_implemented == ["lora"]


@pytest.mark.parametrize(
    "body, message",
    [
        ([1, 2], "JSON object"),
        ("text", "JSON object"),
        ({"input_suffix": ""}, '"input_prefix" is required'),
        ({"input_prefix": ""}, '"input_suffix" is required'),
        ({"input_prefix": 3, "input_suffix": ""}, '"input_prefix" must be a string'),
        ({**LLAMA_VIM, "input_extra": "x"}, '"input_extra" must be an array'),
        ({**LLAMA_VIM, "input_extra": [{"filename": "a"}]}, '"input_extra"[0]'),
        ({**LLAMA_VIM, "input_extra": [{"text": "a", "filename": 3}]}, "filename must be a string"),
        ({**LLAMA_VIM, "n_predict": "12"}, '"n_predict" must be an integer'),
        ({**LLAMA_VIM, "n_predict": 1.5}, '"n_predict" must be an integer'),
        ({**LLAMA_VIM, "n_predict": True}, '"n_predict" must be an integer'),
        ({**LLAMA_VIM, "n_predict": -2}, '"n_predict" must be in'),
        ({**LLAMA_VIM, "stream": "yes"}, '"stream" must be a boolean'),
        ({**LLAMA_VIM, "stop": [1]}, '"stop" must be a list of strings'),
        ({**LLAMA_VIM, "top_k": "40"}, '"top_k" must be an integer'),
        ({**LLAMA_VIM, "top_p": 1.5}, '"top_p" must be in'),
        ({**LLAMA_VIM, "temperature": -1}, '"temperature" must be >= 0.0, got -1.0'),
        ({**LLAMA_VIM, "n_indent": -1}, '"n_indent" must be >= 0, got -1'),
        ({**LLAMA_VIM, "samplers": 3}, '"samplers" must be'),
        ({**LLAMA_VIM, "logit_bias": 3}, '"logit_bias" must be'),
        ({**LLAMA_VIM, "logit_bias": [[1, "x"]]}, "biases must be numbers"),
        ({**LLAMA_VIM, "client_id": [1]}, '"client_id" must be'),
        ({**LLAMA_VIM, "prompt": 5}, '"prompt" must be a string'),
    ],
)
def test_bad_infill_requests_name_the_field(body, message):
    with pytest.raises(RequestError) as e:
        parse_request("infill", body)
    assert e.value.status == 400 and message in e.value.message
    assert "None" not in e.value.message  # a range with one bound names only that bound


@pytest.mark.parametrize(
    "kind, body, field",
    [
        ("infill", {**LLAMA_VIM, "input_prefix": "def f(\ud800"}, '"input_prefix"'),
        ("infill", {**LLAMA_VIM, "input_suffix": "\udfff"}, '"input_suffix"'),
        ("infill", {**LLAMA_VIM, "prompt": "x\ud83d"}, '"prompt"'),
        ("infill", {**LLAMA_VIM, "input_extra": [{"text": "a\ud800", "filename": "a.py"}]}, '"input_extra"[0].text'),
        ("infill", {**LLAMA_VIM, "input_extra": [{"text": "a", "filename": "\ud800"}]}, '"input_extra"[0].filename'),
        ("infill", {**LLAMA_VIM, "stop": ["ok", "\ud800"]}, '"stop"[1]'),
        ("completion", {"prompt": "\ud800"}, '"prompt"'),
        ("completion", {"prompt": "a", "grammar": 'root ::= "\ud800"'}, '"grammar"'),
        ("completion", {"prompt": "a", "client_id": "\udc00"}, '"client_id"'),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(kind, body, field):
    # "\ud800" is valid JSON but not Unicode text: it cannot be tokenised or echoed as UTF-8
    with pytest.raises(RequestError) as e:
        parse_request(kind, body)
    assert e.value.status == 400 and e.value.message.startswith(field + " ") and "surrogate" in e.value.message
    # a surrogate pair is a real character and is accepted
    pair = json.loads('{"prompt": "smile \\ud83d\\ude00"}')
    assert parse_request("completion", pair).prompt == "smile \N{GRINNING FACE}"


@pytest.mark.parametrize("prompt", [None, 3, [], [1, "a"], [True]])
def test_bad_completion_prompts(prompt):
    with pytest.raises(RequestError):
        parse_request("completion", {} if prompt is None else {"prompt": prompt})


def test_completion_request_forms():
    assert parse_request("completion", {"prompt": "hi", "max_tokens": 3}).n_predict == 3
    assert parse_request("completion", {"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_request("completion", {"prompt": "hi"}, default_n_predict=7).n_predict == 7
    r = parse_request("completion", {"prompt": "x", "n_predict": 0, "client_id": "ed"})
    assert r.is_warmup and r.client_key == "client:ed"
    assert parse_request("completion", {"prompt": "x"}).client_key is None


# -- samplers -------------------------------------------------------------------------------


class TinyVocab:
    """Enough of ``backend.Model`` for sampler resolution without the infill sampler."""

    n_vocab = 100
    eog_ids = frozenset({1, 2})

    def tokenize(self, text, add_special=False, parse_special=False):
        return [ord(c) % 100 for c in text]


@pytest.mark.parametrize(
    "name, canon",
    [("top_k", "top_k"), ("top-k", "top_k"), ("topk", "top_k"), ("Temp", "temperature"), ("nucleus", "top_p"),
     ("typ", "typ_p"), ("min-p", "min_p"), ("infill", "infill"), ("bogus", None)],
)  # fmt: skip
def test_sampler_names(name, canon):
    assert canonical_sampler_name(name) == canon


def resolve(body, defaults=None):
    return resolve_sampling(parse_sampler_fields(body), defaults or SamplingParams(), TinyVocab())


def test_samplers_not_named_are_off_and_temperature_defaults_to_one():
    plan = resolve({"top_k": 40, "top_p": 0.9, "samplers": ["top_k", "top_p"], "temperature": 0.2, "min_p": 0.3})
    p = plan.params
    assert (p.top_k, p.top_p, p.min_p, p.temperature) == (40, 0.9, 0.0, 1.0)
    assert plan.applied == ["top_k", "top_p"] and plan.not_applied == [] and plan.notes == []


def test_no_samplers_list_uses_the_default_chain_and_server_defaults():
    d = SamplingParams(temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, repeat_penalty=1.1)
    p = resolve({"top_k": 3}, d).params
    assert (p.top_k, p.top_p, p.min_p, p.temperature, p.repeat_penalty) == (3, 0.8, 0.1, 0.5, 1.1)


def test_sampler_letters_unknown_names_and_order_notes():
    plan = resolve({"samplers": "tkz", "temperature": 0.0})
    assert plan.params.is_greedy and plan.applied == ["top_k", "temperature"]
    assert any("unknown sampler 'z'" in n for n in plan.notes)
    assert any("localspec's order" in n for n in plan.notes)  # temperature was named first


def test_samplers_that_cannot_be_applied_are_reported():
    body = {
        "samplers": ["dry", "xtc", "typ_p", "top_n_sigma", "temperature"],
        "dry_multiplier": 0.8, "xtc_probability": 0.5, "typical_p": 0.9, "top_n_sigma": 1.0,
        "mirostat": 2, "dynatemp_range": 0.5,
    }  # fmt: skip
    plan = resolve(body)
    assert set(plan.not_applied) == {"dry", "xtc", "typ_p", "top_n_sigma", "mirostat 2", "dynatemp"}
    assert any("not applied" in n for n in plan.notes)
    # inactive by their own parameters: nothing to report
    assert resolve({"samplers": ["dry", "xtc", "typ_p"]}).not_applied == []


def test_infill_needs_top_k():
    plan = resolve({"samplers": ["top_p", "infill"]})
    assert plan.not_applied == ["infill"] and plan.params.candidate_filter is None


def test_logit_bias_forms_and_ignore_eos():
    p = resolve({"logit_bias": [[5, -1.0], ["a", False]], "ignore_eos": True}).params
    assert p.logit_bias[5] == -1.0 and p.logit_bias[ord("a") % 100] == -math.inf
    assert p.logit_bias[1] == p.logit_bias[2] == -math.inf
    assert resolve({"logit_bias": {"7": 2}}).params.logit_bias == {7: 2.0}
    # a key of other digits than 0-9 is text, as llama.cpp's strtol reads it (int("²") would raise)
    assert resolve({"logit_bias": {"²": 1}}).params.logit_bias == {ord("²") % 100: 1.0}
    with pytest.raises(RequestError, match="outside the vocabulary"):
        resolve({"logit_bias": [[1000, 1]]})


def test_json_schema_becomes_a_grammar():
    p = resolve({"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}).params
    assert p.grammar and "root" in p.grammar


def test_seed_minus_one_is_random():
    assert resolve({"seed": -1}).params.seed is None
    assert resolve({"seed": 5}).params.seed == 5
    fixed = SamplingParams(seed=5)  # the server's --seed: a request's -1 still draws a random seed
    assert resolve({"seed": -1}, fixed).params.seed is None and resolve({}, fixed).params.seed == 5
    assert resolve({"seed": 2**64 - 1}).params.seed == 2**64 - 1  # kept whole, not cut to 32 bits
    for bad in (-7, 2**64):
        with pytest.raises(RequestError, match=r'"seed" must be in 0\.\.18446744073709551615, or -1'):
            resolve({"seed": bad})


# -- the candidate filter in the sampling pipeline -------------------------------------------


class KeepBelow:
    """A test filter: keeps candidates whose id is below a bound."""

    name = "keep-below"

    def __init__(self, bound):
        self.bound = bound

    def __call__(self, ids, logits):
        keep = ids < self.bound
        return ids[keep], logits[keep]


def test_candidate_filter_sits_between_truncation_and_temperature():
    row = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    # top_k 3 keeps ids 0, 1, 2; the filter keeps those below 2
    p = SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0, candidate_filter=KeepBelow(2))
    c = LogitsProcessor(p, 6).candidates(row)
    assert list(c.ids) == [0, 1] and np.allclose(c.logits, [10.0, 8.0])
    # greedy: the argmax among the filtered candidates, after truncation
    g = SamplingParams.greedy(top_k=3, candidate_filter=KeepBelow(3))
    row2 = np.array([1.0, 2.0, 3.0, 9.0, 0.0, 0.0], dtype=np.float32)
    assert LogitsProcessor(g, 6).choose(row2, 0, 0) == 2
    assert LogitsProcessor(SamplingParams.greedy(), 6).choose(row2, 0, 0) == 3


# -- FIM prompt layout -------------------------------------------------------------------------


class FimVocab:
    """Characters as tokens (1000 + code point), FIM tokens 1..5, BOS 9."""

    bos, add_bos = 9, True

    def __init__(self, fim=("pre", "suf", "mid")):
        ids = {"pre": 1, "suf": 2, "mid": 3, "rep": 4, "sep": 5}
        self._fim = {k: ids[k] for k in fim}

    def fim_tokens(self):
        return dict(self._fim)

    def tokenize(self, text, add_special=False, parse_special=False):
        return [1000 + ord(c) for c in text]


def txt(tokens):
    return "".join(chr(t - 1000) if t >= 1000 else f"<{t}>" for t in tokens)


def test_fim_layout_follows_llama_cpp():
    extra = [ExtraChunk("X", "x.py")]
    b = build_infill_prompt(FimVocab(), "pre", "suf", "mid", extra, n_ctx=8192, n_predict=16)
    assert b.fim and txt(b.tokens) == f"<9>{txt(FimVocab().tokenize(SNIPPET_SEPARATOR))}X<1>premid<2>suf<3>"
    b = build_infill_prompt(FimVocab(("pre", "suf", "mid", "rep", "sep")), "p", "s", "", extra, n_ctx=8192, n_predict=16)
    assert txt(b.tokens) == "<9><4>myproject\n<5>x.py\nX<5>filename\n<1>p<2>s<3>"
    b = build_infill_prompt(FimVocab(), "p", "s", "", [], n_ctx=8192, n_predict=16, spm=True)
    assert txt(b.tokens) == "<9><2>s<1>p<3>"


def test_prefix_completion_without_fim_tokens_drafts_from_the_suffix():
    b = build_infill_prompt(FimVocab(()), "def f", "suffix text", "(x)", [ExtraChunk("E")], n_ctx=8192, n_predict=16)
    sep = SNIPPET_SEPARATOR
    assert not b.fim and txt(b.tokens) == f"<9>{sep}E{sep}def f(x)"
    assert [txt(c) for c in b.draft_context] == ["suffix text"]


def test_truncation_keeps_the_cut_point_stable_across_keystrokes():
    window = 256  # prefix keeps <= 192 tokens, cut in blocks of 16
    firsts = set()
    for n in range(300, 316):
        b = build_infill_prompt(FimVocab(), "a" * n, "s" * 500, "", [], n_ctx=2048, n_predict=16, window=window)
        assert b.n_prefix_dropped % 16 == 0 and b.tokens.count(1000 + ord("a")) <= 192
        assert b.n_suffix_dropped == 500 - (window // 4 - 2)
        firsts.add(b.n_prefix_dropped)
    assert len(firsts) <= 2  # 16 growing prefixes share at most two cut points
    # dropped parts still feed the drafter
    assert sum(len(c) for c in b.draft_context) == b.n_prefix_dropped + b.n_suffix_dropped


@pytest.mark.parametrize("fim", [("pre", "suf", "mid"), ()], ids=["fim", "prefix-completion"])
def test_an_edit_above_the_cut_keeps_the_kept_part_and_later_growth_cuts_in_blocks(fim):
    v = FimVocab(fim)
    text = "".join(f"line {i}\n" for i in range(60))  # 480 tokens; window 256 keeps <= 256 (192 with FIM)
    kw = dict(n_ctx=2048, n_predict=16, window=256)
    first = build_infill_prompt(v, text, "s", "", [], **kw)
    assert first.n_prefix_dropped > 0 and first.anchor is not None
    edited = build_infill_prompt(v, "# a new first line\n" + text, "s", "", [], anchor=first.anchor, **kw)
    assert edited.tokens == first.tokens  # the same prompt: the whole KV cache is reused
    assert edited.n_prefix_dropped == first.n_prefix_dropped + len("# a new first line\n")
    # without the anchor the cut moves with the edit and the prompt starts elsewhere
    assert build_infill_prompt(v, "# a new first line\n" + text, "s", "", [], **kw).tokens != first.tokens
    # typing at the cursor moves the cut by whole blocks (16 tokens) from the anchored point
    anchor, cuts = edited.anchor, set()
    for n in range(1, 40):
        b = build_infill_prompt(v, "# a new first line\n" + text + "x" * n, "s", "", [], anchor=anchor, **kw)
        assert (b.n_prefix_dropped - edited.n_prefix_dropped) % 16 == 0
        cuts.add(b.n_prefix_dropped)
    assert len(cuts) == 3
    # an anchor that no longer occurs falls back to blocks counted from the start
    other = build_infill_prompt(v, "z" * 480, "s", "", [], anchor=first.anchor, **kw)
    assert other.n_prefix_dropped % 16 == 0


def test_extra_context_takes_what_the_context_leaves():
    extra = [ExtraChunk("e" * 3000)]
    b = build_infill_prompt(FimVocab(), "p", "s", "", extra, n_ctx=2048, n_predict=100, window=512)
    assert b.n_extra_dropped > 0 and len(b.tokens) <= 2048 - 200 + 8


def test_clipping_keeps_line_starts_and_whole_characters():
    text = "".join(f"line {i}\n" for i in range(1000))
    assert clip_tail(text, len(text)) == text and clip_head(text, len(text)) == text
    tail, head = clip_tail(text, 100), clip_head(text, 100)
    assert text.endswith(tail) and tail.startswith("line ") and 50 <= len(tail) <= 100
    assert text.startswith(head) and head.endswith("\n") and 50 <= len(head) <= 100
    assert clip_tail("é" * 100, 51) == "é" * 25 and clip_head("é" * 100, 51) == "é" * 25  # 2-byte characters
    assert clip_tail("x" * 100, 10) == "x" * 10  # no newline: cut at the byte count
    chunks = [ExtraChunk("a" * 50, "a"), ExtraChunk("b" * 50, "b"), ExtraChunk("c" * 50, "c")]
    kept = clip_chunks(chunks, 80)
    assert [(c.filename, c.text) for c in kept] == [("b", "b" * 30), ("c", "c" * 50)]
    assert clip_chunks(chunks, 0) == [] and clip_chunks(chunks, 150) == chunks


@pytest.mark.parametrize("fim", [("pre", "suf", "mid"), ()], ids=["fim", "prefix-completion"])
def test_huge_infill_texts_are_clipped_before_they_are_tokenized(fim):
    class Spy(FimVocab):
        sizes: list[int] = []

        def tokenize(self, text, add_special=False, parse_special=False):
            Spy.sizes.append(len(text.encode()))
            return super().tokenize(text, add_special, parse_special)

    huge = "x\n" * 500_000
    b = build_infill_prompt(Spy(fim), huge + "end", "start" + huge, "typed", [ExtraChunk(huge), ExtraChunk("e")],
                            n_ctx=4096, n_predict=16, window=1024)  # fmt: skip
    # the prefix (+ typed text) and the suffix: 8 bytes per token of the window; the extra chunks
    # together 8 per token of the context
    assert max(Spy.sizes) <= 8 * 4096 and sum(n > 2 * 8 * 1024 for n in Spy.sizes) <= 1
    assert ("endtyped<2>start" if fim else "endtyped") in txt(b.tokens)
    assert len(b.tokens) > 1024 // 2 and b.n_prefix_dropped > 0


# -- editor stops -------------------------------------------------------------------------------


def run_stops(chunks, n_indent=0, tmax=0, times=None):
    s = EditorStops(n_indent, tmax)
    out = ""
    for i, c in enumerate(chunks):
        r = s.push(c, times[i] if times else 0.0)
        out += c[: r.keep]
        if r.stop:
            return out, r.reason
    return out, None


@pytest.mark.parametrize(
    "chunks, n_indent, expect",
    [
        (["x = 1", "\n", "    y", " = 2\n", "z"], 4, ("x = 1\n    y = 2\n", "indent")),
        (["x = 1\n    y = 2\nz = 3"], 4, ("x = 1\n    y = 2\n", "indent")),
        (["a", "\n", "  ", "  b\n", "  c"], 4, ("a\n    b\n  ", "indent")),
        (["a", "\n", "\n", "    b"], 4, ("a\n", "indent")),  # a blank line ends it, as in llama.cpp
        (["a", "\n", "    b"], 0, ("a\n    b", None)),
        (["  a"], 4, ("  a", None)),  # the first line is never checked
    ],
)
def test_n_indent(chunks, n_indent, expect):
    assert run_stops(chunks, n_indent) == expect


def test_t_max_predict_ms_stops_at_a_newline_after_the_limit():
    assert run_stops(["a", "b\n", "c", "d\n", "e"], tmax=10, times=[0, 5, 8, 12, 20]) == ("ab\ncd\n", "time")
    assert run_stops(["a", "b", "c"], tmax=10, times=[0, 50, 100]) == ("abc", None)


# -- responses ----------------------------------------------------------------------------------


def test_response_fields_and_compact_json():
    obj = {"content": "x", "timings": {"prompt_n": 3, "predicted_ms": 1.5}, "truncated": False}
    assert select_fields(["content", "timings/prompt_n", "missing", "timings/nope"], obj) == {
        "content": "x",
        "timings/prompt_n": 3,
    }
    assert select_fields([""], obj) == {}
    s = dumps({"content": "é"})
    assert s == '{"content":"é"}'  # llama.vim matches '"content"\s*:"'
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
