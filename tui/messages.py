"""The widgets of the conversation: the user's messages, the model's answers, notices."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from localspec.tree import TokenSource

from .provenance import render_spans
from .session import TurnRecord


class UserMessage(Static):
    """A message the user sent."""

    DEFAULT_CSS = """
    UserMessage { margin-top: 1; padding: 0 1; background: $boost; border-left: outer $accent; }
    """

    def __init__(self, text: str) -> None:
        super().__init__(Text(text.strip()), markup=False)
        self.text = text


class Notice(Static):
    """A line from the app (the chat format in use, an error, a model switch).

    ``kind`` is ``"info"``, ``"warning"`` or ``"error"`` (a CSS class)."""

    DEFAULT_CSS = """
    Notice { margin-top: 1; padding: 0 1; color: $text-muted; text-style: italic; }
    Notice.warning { color: $text-warning; text-style: none; border-left: outer $warning; }
    Notice.error { color: $text-error; text-style: none; border-left: outer $error; }
    """

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(Text(text), markup=False, classes=kind)
        self.kind = kind
        self.text = text


class AnswerView(Static):
    """The model's answer, drawn token by token in provenance colours.

    ``append(text, source)`` adds a streamed chunk; ``finish(record)`` adds the turn's
    summary line. ``colour`` toggles the provenance colouring.
    """

    DEFAULT_CSS = """
    AnswerView { padding: 0 1; border-left: outer $success 60%; }
    """

    def __init__(self, *, colour: bool = True, dark: bool = True, no_color: bool = False) -> None:
        super().__init__(Text("…", style="dim"), markup=False)
        self.spans: list[tuple[str, TokenSource]] = []
        self.colour = colour
        self.dark = dark
        self.no_color = no_color
        self.record: TurnRecord | None = None

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.spans)

    def append(self, text: str, source: TokenSource) -> None:
        self.extend([(text, source)])

    def extend(self, chunks) -> None:
        """Add streamed ``(text, source)`` chunks and redraw once."""
        new = [(t, TokenSource(s)) for t, s in chunks if t]
        if new:
            self.spans.extend(new)
            self.redraw()

    def set_colour(self, colour: bool, *, dark: bool | None = None) -> None:
        self.colour = colour
        if dark is not None:
            self.dark = dark
        self.redraw()

    def finish(self, record: TurnRecord) -> None:
        self.record = record
        self.redraw()

    def redraw(self) -> None:
        body = render_spans(self.spans, colour=self.colour, dark=self.dark, no_color=self.no_color)
        if self.record is None:
            if not body:
                body = Text("…", style="dim")
        else:
            if not body:
                body = Text("(no text)", style="dim italic")
            body.append("\n")
            body.append(summary_line(self.record), style="dim")
        self.update(body)


def summary_line(rec: TurnRecord) -> str:
    """``42 tokens · 31.2 tokens/s · ngram · 2.31 tokens/step`` (+ ``· stopped``, ``· failed``
    or ``· token limit``)."""
    s = rec.stats
    parts = [
        f"{s.n_generated_tokens} tokens",
        f"{s.tokens_per_s:.1f} tokens/s",
        rec.drafter,
        f"{s.mean_acceptance_length:.2f} tokens/step",
    ]
    if rec.stopped:
        parts.append("stopped")
    elif rec.finish_reason == "length" and rec.note is None:
        parts.append("token limit")
    elif rec.finish_reason == "error":
        parts.append("failed")
    return " · ".join(parts)
