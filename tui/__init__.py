"""``localspec.tui``: the terminal chat app (``localspec chat``), built on Textual.

Needs the ``tui`` extra (``pip install 'localspec[tui]'``).
"""

from .app import ChatApp
from .chat_format import ChatTemplateError, Message, TemplateFormat, TranscriptFormat, chat_format_for
from .session import ChatSession, TurnRecord

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
