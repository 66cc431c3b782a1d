"""The command line's text streams, whatever the terminal's encoding.

Human output uses a few non-ASCII glyphs (``└`` in the startup summary, ``→``, ``…``, ``—``) and prints text read
from configs and logs. On a stream that cannot encode them (``PYTHONIOENCODING=ascii``, a ``C`` locale, a name
with undecodable bytes) a write would raise ``UnicodeEncodeError`` and turn a run into exit 1. :class:`SafeText`
wraps such a stream: a write that cannot be encoded is written again with ASCII stand-ins for our glyphs and
``?`` for anything else, so exit codes never depend on the terminal's encoding.
"""

from __future__ import annotations

from typing import Any

# ASCII stand-ins for the glyphs human output uses; anything else that cannot be encoded becomes "?".
GLYPHS = str.maketrans({
    "└": "`-", "├": "|-", "│": "|", "─": "-", "━": "-", "═": "=", "→": "->", "←": "<-", "…": "...", "—": "--",
    "–": "-", "·": "-", "×": "x", "≥": ">=", "≤": "<=", "≈": "~", "✓": "ok", "✗": "x", "µ": "u", "•": "*",
})


def degrade(text: str, encoding: str) -> str:
    """``text`` as ``encoding`` can write it: our glyphs in ASCII, the rest replaced (``?``)."""
    text = text.translate(GLYPHS)
    return text.encode(encoding, "replace").decode(encoding, "replace")


class SafeText:
    """A text stream whose writes never raise ``UnicodeEncodeError`` (every other attribute is the stream's)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text``; what the stream cannot encode is degraded (:func:`degrade`) and written instead."""
        try:
            return self.stream.write(text)
        except UnicodeEncodeError:
            self.stream.write(degrade(text, getattr(self.stream, "encoding", None) or "ascii"))
            return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, … of the real stream
        return getattr(self.stream, name)


def safe(stream: Any) -> Any:
    """``stream`` wrapped in :class:`SafeText` (once; None stays None)."""
    return stream if stream is None or isinstance(stream, SafeText) else SafeText(stream)
