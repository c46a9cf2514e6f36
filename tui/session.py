"""A chat session: the conversation, how it becomes prompts, and what each turn produced.

``ChatSession`` holds no UI and runs no threads. The app calls ``begin_turn`` on its own
thread (it only tokenises and validates; errors such as a full context come back at once),
iterates the returned ``GenerationStream`` in a worker thread, and hands the stream's
``result`` back to ``end_turn``. A turn that cannot start leaves the conversation as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from localspec.engine import Engine, GenerationResult, GenerationStream
from localspec.errors import ContextOverflowError, LocalSpecError
from localspec.sampling import SamplingParams
from localspec.stats import GenerationStats

from .chat_format import ChatFormat, Message, TranscriptFormat, chat_format_for, display_text
from .prompt import PromptBuilder


@dataclass
class TurnRecord:
    """One exchange: the user's message and what the model answered.

    Attributes:
        user: the user's message.
        answer: the generated text (partial when stopped).
        finish_reason: the engine's (``"stop"``, ``"length"``, ``"cancelled"``, ...), or
            ``"error"`` when generation failed part way.
        drafter: the drafter that produced it (``"none"`` = plain decoding).
        stats: the engine's statistics of the turn.
        note: what the user should know (context full, the error that ended the turn).
        token_ids: the generated ids.
    """

    user: str
    answer: str
    finish_reason: str
    drafter: str
    stats: GenerationStats
    note: str | None = None
    token_ids: list[int] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "cancelled"


class ChatSession:
    """A multi-turn conversation with one engine at a time.

    Args:
        engine: the ``Engine`` (None until a model is loaded).
        system: an optional system message (the preamble of the plain transcript).
        sampling: ``SamplingParams`` of every turn.
        max_tokens: most tokens per answer.
        transcript: use the plain transcript format even when the model has a chat template.
    Raises:
        ChatTemplateError: the model's chat template does not compile.
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        system: str | None = None,
        sampling: SamplingParams | None = None,
        max_tokens: int = 512,
        transcript: bool = False,
    ) -> None:
        self.system = system
        self.sampling = sampling or SamplingParams()
        self.max_tokens = max_tokens
        self.force_transcript = transcript
        self.messages: list[Message] = []
        self.turns: list[TurnRecord] = []
        self.engine: Engine | None = None
        self.format: ChatFormat | None = None
        self.builder: PromptBuilder | None = None
        self._pending: tuple[str, tuple] | None = None  # (user text, builder state before the turn)
        if engine is not None:
            self.attach(engine)

    # -- model ----------------------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """Use ``engine`` from the next turn on; the conversation is kept (its prompt is
        rendered in the new model's format and prefilled on the next turn).

        Raises:
            ChatTemplateError: the model's chat template does not compile (the session then
                keeps its previous engine).
        """
        fmt = TranscriptFormat() if self.force_transcript else chat_format_for(engine.model)
        self.engine, self.format, self.builder = engine, fmt, PromptBuilder(engine.model)

    @property
    def model_name(self) -> str:
        if self.engine is None:
            return "no model"
        m = self.engine.model
        return m.meta("general.name") or m.path.name

    @property
    def n_context_tokens(self) -> int:
        """Tokens of the conversation so far (last prompt and answer)."""
        return len(self.builder.tokens) if self.builder is not None else 0

    # -- turns ----------------------------------------------------------------------------------

    def _all_messages(self, extra: list[Message]) -> list[Message]:
        head = [Message("system", self.system)] if self.system else []
        return head + self.messages + extra

    def begin_turn(self, user_text: str) -> GenerationStream:
        """Start generating the answer to ``user_text``.

        Raises:
            LocalSpecError: no model, a template error, a full context, bad sampling
                parameters. The conversation is unchanged.
        """
        if self.engine is None or self.format is None or self.builder is None:
            raise LocalSpecError("no model is loaded: load one with ctrl+o (or start with -m PATH)")
        if self._pending is not None:
            raise LocalSpecError("an answer is still being generated")
        text = self.format.render(self._all_messages([Message("user", user_text)]))
        ids = self.builder.build(text)
        if len(ids) >= self.engine.n_ctx:
            raise ContextOverflowError(
                f"the conversation ({len(ids)} tokens) no longer fits in the context "
                f"({self.engine.n_ctx} tokens): start a new chat (ctrl+n) or restart with a larger --n-ctx"
            )
        stream = self.engine.stream(ids, max_tokens=self.max_tokens, sampling=self.sampling, stop=self.format.stop)
        self._pending = (user_text, self.builder.snapshot())
        self.builder.commit(text, ids)
        self.messages.append(Message("user", user_text))
        return stream

    def end_turn(self, result: GenerationResult | None, error: BaseException | None = None) -> TurnRecord | None:
        """Record the answer of the turn started last (``result`` of its stream).

        With ``error`` and no result the turn is undone (the user's message is removed and
        returned to the caller through ``TurnRecord`` = None).
        """
        if self._pending is None:
            raise RuntimeError("end_turn without begin_turn")
        user_text, before = self._pending
        self._pending = None
        if result is None:  # failed before producing anything: undo the turn
            self.messages.pop()
            self.builder.restore(before)
            return None
        answer = result.text
        self.messages.append(Message("assistant", answer))
        self.builder.record_answer(answer, result.token_ids)
        note = None
        finish = result.finish_reason
        if error is not None:
            finish = "error"
            note = f"generation failed: {error}"
        elif finish == "length" and len(result.token_ids) < self.max_tokens:
            note = (
                f"the context is full ({self.engine.n_ctx} tokens): start a new chat (ctrl+n) "
                "or restart with a larger --n-ctx"
            )
        rec = TurnRecord(
            user=user_text,
            answer=answer,
            finish_reason=finish,
            drafter=result.stats.drafter,
            stats=result.stats,
            note=note,
            token_ids=list(result.token_ids),
        )
        self.turns.append(rec)
        return rec

    @property
    def generating(self) -> bool:
        return self._pending is not None

    def new_chat(self) -> None:
        """Forget the conversation (the engine keeps its cache until the next prompt differs)."""
        if self._pending is not None:
            raise LocalSpecError("stop the answer being generated first (esc)")
        self.messages.clear()
        self.turns.clear()
        if self.builder is not None:
            self.builder.reset()

    @property
    def last_answer(self) -> str | None:
        return display_text(self.turns[-1].answer) if self.turns else None

    # -- transcript -----------------------------------------------------------------------------

    def to_markdown(self) -> str:
        """The conversation as Markdown: a header (model, format, date), then each turn with
        its statistics."""
        fmt = self.format.description if self.format is not None else "none"
        lines = [
            "# localspec chat",
            "",
            f"- model: {self.model_name}",
            f"- format: {fmt}",
            f"- saved: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        ]
        if self.system:
            lines += ["", "## System", "", self.system.strip()]
        for t in self.turns:
            answer = display_text(t.answer) or "*(no text)*"
            lines += ["", "## User", "", t.user.strip(), "", "## Assistant", "", answer, ""]
            s = t.stats
            meta = (
                f"*{s.n_generated_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, drafter {t.drafter}, "
                f"mean acceptance length {s.mean_acceptance_length:.2f}, finish {t.finish_reason}*"
            )
            lines.append(meta)
            if t.note:
                lines += ["", f"> {t.note}"]
        return "\n".join(lines) + "\n"
