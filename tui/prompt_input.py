"""The message box: several lines, enter sends."""

from __future__ import annotations

import re

from textual import events
from textual.message import Message
from textual.widgets import TextArea


# What a paste must not put in a message (ECMA-48): control sequences (CSI, e.g. colours copied
# from a terminal), operating-system commands with their text (OSC, e.g. a window title), other
# escape sequences (ESC c, ESC ( B, ...) or a lone ESC, and the C0 and C1 control characters but
# tab and new line (BEL, NUL, 8-bit CSI, ...), which the model would see as text.
_PASTE_JUNK = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI (7- or 8-bit)
    r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, ended by BEL or ST
    r"|\x1b[ -/]*[0-~]?"  # the other escape sequences, or a lone ESC
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # C0 but tab and new line, DEL, C1
)


def clean_paste(text: str) -> str:
    """``text`` with Windows / old Mac line ends as new lines and without ``_PASTE_JUNK``."""
    return _PASTE_JUNK.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


class PromptInput(TextArea):
    """A compact, growing text box. Enter sends (``Submitted``); ctrl+j inserts a new line
    (so do shift+enter and alt+enter in terminals that report them); pasted text keeps its
    new lines and loses terminal escape sequences and control characters (``clean_paste``)."""

    DEFAULT_CSS = """
    PromptInput { height: auto; min-height: 1; max-height: 8; }
    """
    NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")

    class Submitted(Message):
        """The user pressed enter; ``value`` is the whole text."""

        def __init__(self, prompt_input: "PromptInput", value: str) -> None:
            super().__init__()
            self.input = prompt_input
            self.value = value

        @property
        def control(self) -> "PromptInput":
            return self.input

    def __init__(self, *, placeholder: str = "", id: str | None = None) -> None:
        super().__init__("", soft_wrap=True, compact=True, placeholder=placeholder, id=id, tab_behavior="focus")

    @property
    def value(self) -> str:
        return self.text

    @value.setter
    def value(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    async def _on_paste(self, event: events.Paste) -> None:
        event.prevent_default()  # instead of TextArea's, which inserts the text as it came
        if self.read_only:
            return
        if result := self._replace_via_keyboard(clean_paste(event.text), *self.selection):
            self.move_cursor(result.end_location)
            self.focus()

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)
