"""Checking the LOG paths given to ``inspect``, ``replay`` and ``graph`` before any is read.

Every named log must be there: a missing or unreadable one among several was silently skipped
(``replay good.jsonl nope.jsonl`` exited 0 without a word), and a missing one alone was reported
as merely "unreadable". Now each is refused up front, with the operating system's reason, the same
way (exit 2) whether it is the only log or one of several, and the same way a directory or FIFO is
(:mod:`pipeline.core.files`). Nothing here imports torch.
"""

from __future__ import annotations

import os
from typing import Iterable

from pipeline.core.errors import UsageError

__all__ = ["check_log_paths"]


def check_log_paths(paths: Iterable[str | os.PathLike]) -> None:
    """Raise :class:`UsageError` (exit 2, naming ``LOG``) for the first path that cannot be read.

    ``trace_unreadable`` for a missing path or one ``stat``/``access`` refuses (message: the OS
    reason, e.g. "No such file or directory"); ``not_a_regular_file`` for a FIFO, device or
    directory. Readable regular files pass; their content is the readers' business (bad lines are
    counted and skipped).
    """
    from pipeline.core.files import _refuse_irregular

    for path in paths:
        p = os.fspath(path)
        try:
            mode = os.stat(p).st_mode
        except OSError as e:
            raise UsageError(f"cannot read the trace {p!r}: {e.strerror or e}", code="trace_unreadable",
                             flags=[("LOG", p)], allowed=["an existing, readable regular file"],
                             remedy="check the path (every LOG named must exist; 'attn-setup run' prints the log "
                                    "path it wrote)") from None
        _refuse_irregular(mode, p, flag="LOG", what="the trace")
        if not os.access(p, os.R_OK):
            raise UsageError(f"cannot read the trace {p!r}: permission denied", code="trace_unreadable",
                             flags=[("LOG", p)], allowed=["a readable regular file"],
                             remedy=f"make {p!r} readable (chmod) or pass a copy you can read")
