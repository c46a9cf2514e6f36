"""Chat formats (the model's own template, the plain transcript) and exact prompt building."""

import pytest

from localspec import Engine, SamplingParams

pytest.importorskip("jinja2")

from conftest import GEMMA_CHAT_TEMPLATE, frozen_cost_model  # noqa: E402

from localspec.tui.chat_format import (  # noqa: E402
    ChatTemplateError,
    Message,
    TemplateFormat,
    TranscriptFormat,
    chat_format_for,
    display_text,
)
from localspec.tui.prompt import PromptBuilder  # noqa: E402
from localspec.tui.session import ChatSession  # noqa: E402

U, A, S = "user", "assistant", "system"


@pytest.fixture(scope="module")
def template_model(chat_template_engine):
    return chat_template_engine.model


def test_gemma_template_renders_like_gemma():
    fmt = TemplateFormat(GEMMA_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>")
    msgs = [Message(S, "Be brief."), Message(U, " Hi "), Message(A, "Hello!\n"), Message(U, "2+2?")]
    assert fmt.render(msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert not fmt.render(msgs, add_generation_prompt=False).endswith("<start_of_turn>model\n")


def test_template_errors_are_chat_template_errors():
    fmt = TemplateFormat(GEMMA_CHAT_TEMPLATE, bos_token="<bos>", eos_token="<eos>")
    with pytest.raises(ChatTemplateError, match="alternate"):
        fmt.render([Message(U, "a"), Message(U, "b")])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        TemplateFormat("{% for x in %}", bos_token="", eos_token="")


def test_transcript_format_is_plain_and_extends_itself():
    fmt = TranscriptFormat()
    p1 = fmt.render([Message(U, "Hello")])
    assert p1 == f"{TranscriptFormat.DEFAULT_PREAMBLE}\n\nUser: Hello\nAssistant:"
    answer = " Hi there."
    p2 = fmt.render([Message(U, "Hello"), Message(A, answer), Message(U, "Bye")])
    assert p2.startswith(p1 + answer)  # the next prompt extends the previous prompt + answer
    assert fmt.render([Message(S, "Custom."), Message(U, "x")]).startswith("Custom.\n\nUser: x")
    assert "\nUser:" in fmt.stop


@pytest.mark.parametrize(
    "answer, shown",
    [(" Paris.\n", "Paris."), ("\n    def f():\n        pass\n", "    def f():\n        pass"),
     ("", ""), ("  two spaces", " two spaces"), (" \n\n", "")],
)  # fmt: skip
def test_display_text_keeps_the_first_lines_indentation(answer, shown):
    assert display_text(answer) == shown


def test_default_model_has_no_template_and_gets_the_transcript(model, template_model):
    assert model.chat_template() is None
    assert isinstance(chat_format_for(model), TranscriptFormat)
    fmt = chat_format_for(template_model)
    assert isinstance(fmt, TemplateFormat)
    assert fmt.render([Message(U, "Hi")]).startswith("<bos><start_of_turn>user\nHi<end_of_turn>\n")


def test_prompt_builder_tokenises_special_text_and_bos_once(template_model):
    b = PromptBuilder(template_model)
    text = chat_format_for(template_model).render([Message(U, "Hi")])
    ids = b.build(text)
    m = template_model
    assert ids[0] == m.bos and ids.count(m.bos) == 1
    start = m.tokenize("<start_of_turn>", add_special=False, parse_special=True)
    assert len(start) == 1 and start[0] in ids  # chat markup became special tokens
    assert m.detokenize(ids, special=True) == text


def test_prompt_builder_reuses_the_generated_ids_exactly(model):
    b = PromptBuilder(model)
    fmt = TranscriptFormat()
    p1 = fmt.render([Message(U, "Hello")])
    ids1 = b.build(p1)
    b.commit(p1, ids1)
    # ids a tokenizer would not produce for this text: still the ids the model generated
    answer_ids = model.tokenize(" Hi", add_special=False) + model.tokenize(" there.", add_special=False)
    answer = model.detokenize(answer_ids)
    b.record_answer(answer, answer_ids)
    p2 = fmt.render([Message(U, "Hello"), Message(A, answer), Message(U, "More")])
    ids2 = b.build(p2)
    assert ids2[: len(ids1) + len(answer_ids)] == ids1 + answer_ids
    assert b.n_reused_tokens == len(ids1) + len(answer_ids)
    assert model.detokenize(ids2) == p2


def test_prompt_builder_falls_back_when_the_text_changes(model):
    b = PromptBuilder(model)
    ids = b.build("Alpha beta")
    b.commit("Alpha beta", ids)
    b.record_answer(" gamma", model.tokenize(" gam", add_special=False))  # ids do not spell it: dropped
    new = b.build("Alpha beta gamma delta")
    assert new == b._tokenize_full("Alpha beta gamma delta") and model.detokenize(new) == "Alpha beta gamma delta"
    other = b.build("Something else")  # not an extension: whole text tokenised
    assert other == b._tokenize_full("Something else") and b.n_reused_tokens == 0


def test_template_session_two_turns_reuse_the_cache(chat_template_engine):
    """With the model's template: answers end at <end_of_turn> (an end-of-generation token) and
    the second turn prefills only its new text."""
    chat_template_engine.reset()
    s = ChatSession(chat_template_engine, sampling=SamplingParams.greedy(), max_tokens=16)
    assert s.format.uses_template
    r1 = _turn(s, "What is the capital of France?")
    assert r1.finish_reason in ("stop", "length") and "<end_of_turn>" not in r1.answer
    r2 = _turn(s, "And of Italy?")
    # the template trims answers, so the reuse may stop before an answer's trailing whitespace
    assert r2.stats.n_cached_tokens >= r1.stats.n_prompt_tokens
    assert r2.stats.n_prompt_tokens - r2.stats.n_cached_tokens < 40  # only the new turn's text
    assert [m.role for m in s.messages] == [U, A, U, A]


def test_failed_turn_leaves_the_conversation_unchanged(model):
    e = Engine(model, drafter="none", n_ctx=256, cost_model=frozen_cost_model())
    try:
        s = ChatSession(e, sampling=SamplingParams.greedy(), max_tokens=8)
        from localspec.errors import ContextOverflowError

        with pytest.raises(ContextOverflowError, match="new chat"):
            s.begin_turn("word " * 300)
        assert s.messages == [] and s.builder.tokens == []
        r = _turn(s, "Hi")  # still usable
        assert r.stats.n_generated_tokens > 0 and [m.role for m in s.messages] == [U, A]
    finally:
        e.close()


def _turn(session, text):
    stream = session.begin_turn(text)
    for _ in stream:
        pass
    return session.end_turn(stream.result)
