"""``localspec.tui``: the terminal chat app (``localspec chat``), built on Textual.

``ChatApp`` needs the ``tui`` extra (``pip install 'localspec[tui]'``). The chat formats
(``chat_format``), prompt building (``prompt``) and the session (``session``) do not need
Textual.
"""

from .chat_format import ChatTemplateError, Message, TemplateFormat, TranscriptFormat, chat_format_for
from .session import ChatSession, TurnRecord


def __getattr__(name: str):
    if name == "ChatApp":  # imported on first use: it needs Textual
        from .app import ChatApp

        return ChatApp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ChatApp",
    "ChatSession",
    "ChatTemplateError",
    "Message",
    "TemplateFormat",
    "TranscriptFormat",
    "TurnRecord",
    "chat_format_for",
]
