"""How a conversation becomes prompt text: the model's own chat template, or a plain transcript.

A GGUF may carry its chat template (``tokenizer.chat_template``, Jinja source). We read it
through llama.cpp (``Model.chat_template()``) and render it with jinja2 through
llama-cpp-python's ``Jinja2ChatFormatter`` (a sandboxed environment with the extensions and
filters Hugging Face templates expect: ``tojson``, ``raise_exception``, ``loopcontrols``,
``{% generation %}``). We never fall back to another family's template: llama.cpp's own
``llama_chat_apply_template`` would silently use ChatML for a model without a template, which
is wrong for Gemma and most others.

A model without a template (the embedded default, the *base* Gemma 3 270M) gets a plain,
documented transcript instead (see ``TranscriptFormat`` and docs/chat.md)::

    The following is a conversation between a curious user and a helpful assistant.

    User: Hello!
    Assistant: Hi, how can I help?
    User: What is 2 + 2?
    Assistant:

The model continues after ``Assistant:``; the stop strings ``"\\nUser:"`` and
``"\\nAssistant:"`` end its turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec.errors import LocalSpecError

ROLES = ("system", "user", "assistant")


class ChatTemplateError(LocalSpecError):
    """The model's chat template failed to render this conversation (the message says why,
    e.g. the template rejects a system message)."""


@dataclass
class Message:
    """One message of a conversation. ``role`` is ``"system"``, ``"user"`` or ``"assistant"``;
    ``content`` is kept exactly as typed or generated (templates may trim it)."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {ROLES}")


class TemplateFormat:
    """The model's own Jinja chat template.

    Args:
        template: Jinja source (from ``Model.chat_template()``).
        bos_token / eos_token: the texts of the model's BOS / EOS tokens, which templates
            insert themselves (``{{ bos_token }}``).
    Raises:
        ChatTemplateError: the template does not compile.
    """

    uses_template = True
    stop: tuple[str, ...] = ()  # the template's end-of-turn token is an end-of-generation token

    def __init__(self, template: str, *, bos_token: str, eos_token: str) -> None:
        import jinja2
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.template = template
        try:
            self._with_prompt = Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt=True)
            self._without_prompt = Jinja2ChatFormatter(template, eos_token, bos_token, add_generation_prompt=False)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e

    @property
    def name(self) -> str:
        return "chat template"

    @property
    def description(self) -> str:
        return "the model's own chat template (from its GGUF)"

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (special tokens as text, e.g. ``<start_of_turn>``).

        Raises:
            ChatTemplateError: the template raised (e.g. roles must alternate) or failed.
        """
        import jinja2

        fmt = self._with_prompt if add_generation_prompt else self._without_prompt
        try:
            return fmt(messages=[{"role": m.role, "content": m.content} for m in messages]).prompt
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the model's chat template rejected the conversation: {e}") from e


class TranscriptFormat:
    """A plain transcript for models without a chat template (base models).

    The text is the system message (or ``DEFAULT_PREAMBLE``), a blank line, then one
    ``User: ...`` / ``Assistant: ...`` line per message; the prompt ends with
    ``Assistant:``. An assistant message is written exactly as generated (it usually starts
    with a space), so the next turn's prompt extends the previous prompt and its answer and
    the engine reuses their KV cache entirely.
    """

    uses_template = False
    DEFAULT_PREAMBLE = "The following is a conversation between a curious user and a helpful assistant."
    stop: tuple[str, ...] = ("\nUser:", "\nAssistant:")
    name = "plain transcript"
    description = "no chat template in this model: plain 'User: ... / Assistant:' transcript"

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        system = [m.content for m in messages if m.role == "system"]
        parts = [(system[0] if system else self.DEFAULT_PREAMBLE).strip(), "\n\n"]
        for m in messages:
            if m.role == "user":
                parts.append(f"User: {m.content.strip()}\n")
            elif m.role == "assistant":
                body = m.content if m.content[:1] in (" ", "\n") else " " + m.content
                parts.append(f"Assistant:{body}\n")
        if add_generation_prompt:
            parts.append("Assistant:")
        return "".join(parts)


ChatFormat = TemplateFormat | TranscriptFormat


def display_bounds(answer: str) -> tuple[int, int]:
    """``(start, end)`` of the part of an answer to show: without the space the transcript
    format puts after ``Assistant:``, blank lines before the text, and trailing whitespace.
    The indentation of the first line stays (code)."""
    start = 1 if answer.startswith(" ") else 0
    while start < len(answer) and answer[start] == "\n":
        start += 1
    return start, max(start, len(answer.rstrip()))


def display_text(answer: str) -> str:
    """The answer as shown, copied and saved (see ``display_bounds``)."""
    start, end = display_bounds(answer)
    return answer[start:end]


def special_text(model, token: int) -> str:
    """The text of a special token (e.g. ``"<bos>"``), or "" when the model has none."""
    if token is None or token < 0:
        return ""
    return model.token_bytes(token, special=True).decode("utf-8", errors="replace")


def chat_format_for(model) -> ChatFormat:
    """The model's own template when its GGUF has one, else the plain transcript.

    Raises:
        ChatTemplateError: the model's template does not compile (no silent fallback).
    """
    template = model.chat_template()
    if template:
        bos, eos = special_text(model, model.bos), special_text(model, model.eos)
        return TemplateFormat(template, bos_token=bos, eos_token=eos)
    return TranscriptFormat()


def chat_prompt_tokens(model, prompt: str) -> list[int]:
    """``prompt`` as one user turn of a conversation, as ``chat``/``serve`` would give it to
    ``model``: its chat template, or the plain transcript (``tui.chat_format``), tokenised
    with BOS where the model adds one and special tokens parsed."""
    fmt = chat_format_for(model)
    text = fmt.render([Message("user", prompt)])
    toks = model.tokenize(text, add_special=True, parse_special=True)
    if model.add_bos and toks[:2] == [model.bos, model.bos]:
        toks = toks[1:]
    return toks
