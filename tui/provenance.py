"""Provenance colouring: each generated token drawn by how it was produced.

One style per ``TokenSource``; plain decoding keeps the normal text colour so that what
speculation contributed stands out. With ``NO_COLOR`` (Textual then draws in monochrome) the
styles become text attributes: accepted drafts are underlined, recovered tokens italic,
bonus tokens bold.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.style import Style
from rich.text import Text

from localspec.tree import TokenSource

from .chat_format import display_bounds

LABELS: dict[TokenSource, str] = {
    TokenSource.DECODE: "plain",
    TokenSource.NGRAM: "n-gram",
    TokenSource.DRAFT_MODEL: "draft model",
    TokenSource.EAGLE3: "EAGLE-3",
    TokenSource.MEDUSA: "Medusa",
    TokenSource.RECOVERED: "recovered",
    TokenSource.BONUS: "bonus",
}

DESCRIPTIONS: dict[TokenSource, str] = {
    TokenSource.DECODE: "plain decoding: nothing was drafted at this step",
    TokenSource.NGRAM: "accepted draft from the n-gram drafter",
    TokenSource.DRAFT_MODEL: "accepted draft from the draft model",
    TokenSource.EAGLE3: "accepted draft from the EAGLE-3 head",
    TokenSource.MEDUSA: "accepted draft from the Medusa heads",
    TokenSource.RECOVERED: "the target's token where a draft was rejected",
    TokenSource.BONUS: "the target's extra token after every draft was accepted",
}

# Foreground colours readable on dark and on light backgrounds.
_DARK = {
    TokenSource.NGRAM: "#5fd75f",
    TokenSource.DRAFT_MODEL: "#5fafff",
    TokenSource.EAGLE3: "#d787ff",
    TokenSource.MEDUSA: "#ff87af",
    TokenSource.RECOVERED: "#ffaf5f",
    TokenSource.BONUS: "#5fd7d7",
}
_LIGHT = {
    TokenSource.NGRAM: "#008700",
    TokenSource.DRAFT_MODEL: "#005fd7",
    TokenSource.EAGLE3: "#8700af",
    TokenSource.MEDUSA: "#af005f",
    TokenSource.RECOVERED: "#af5f00",
    TokenSource.BONUS: "#008787",
}
_NO_COLOR = {
    TokenSource.NGRAM: Style(underline=True),
    TokenSource.DRAFT_MODEL: Style(underline=True),
    TokenSource.EAGLE3: Style(underline=True),
    TokenSource.MEDUSA: Style(underline=True),
    TokenSource.RECOVERED: Style(italic=True),
    TokenSource.BONUS: Style(bold=True),
}


def source_style(source: TokenSource | int, *, dark: bool = True, no_color: bool = False) -> Style:
    """The style of tokens from ``source`` (an empty style for plain decoding)."""
    src = TokenSource(source)
    if no_color:
        return _NO_COLOR.get(src, Style())
    colour = (_DARK if dark else _LIGHT).get(src)
    return Style(color=colour) if colour else Style()


def legend(*, dark: bool = True, no_color: bool = False) -> Text:
    """One line naming every source in its own style: ``■ plain ■ n-gram ...`` (one space
    between entries: all seven fit an 80-column terminal)."""
    out = Text()
    for i, src in enumerate(TokenSource):
        if i:
            out.append(" ")
        style = source_style(src, dark=dark, no_color=no_color)
        out.append("■ " if not no_color else "", style=style)
        out.append(LABELS[src], style=style)
    return out


def render_spans(
    spans: Iterable[tuple[str, TokenSource]], *, colour: bool = True, dark: bool = True, no_color: bool = False
) -> Text:
    """Text of ``(text, source)`` spans, styled by source when ``colour`` is on, trimmed for
    display (see ``chat_format.display_bounds``)."""
    spans = list(spans)
    start, end = display_bounds("".join(t for t, _ in spans))
    out = Text()
    pos = 0
    for text, src in spans:
        a, b = max(start, pos), min(end, pos + len(text))
        if a < b:
            style = source_style(src, dark=dark, no_color=no_color) if colour else None
            out.append(text[a - pos : b - pos], style=style)
        pos += len(text)
    return out
