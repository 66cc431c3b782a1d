"""When this process began running attn-setup's code: read once, when ``pipeline`` is first imported.

Linux records when a process was *created* (``/proc/self/stat`` ``starttime``, the ``fork``), not when it
``exec``'d the interpreter; a shell that forks a subshell for ``( pip install … && attn-setup run … )`` runs the
earlier commands in that process and ``exec``'s Python last, so the creation time can be long before Python
started. What the kernel does keep across ``exec`` is how long the process has run: :func:`active_ns` (its
main thread's time on a CPU plus its time waiting for one, ``/proc/self/schedstat``). Taken here, at the first
line of ours to run, next to the wall clock, it bounds the time the process spent *not running* since it was
created (sleeping: a subshell waiting for its earlier commands; blocked: the interpreter reading files), which
:func:`pipeline.observe.startup.process_start` leaves out of the startup phase. Torch-free, and reads one
small file: nothing else happens on import.
"""

from __future__ import annotations

import time
from typing import Optional

__all__ = ["FIRST_CODE_NS", "FIRST_CODE_ACTIVE_NS", "active_ns"]


def active_ns() -> Optional[int]:
    """Nanoseconds this process's main thread has run or waited runnable since the process was created
    (``/proc/self/schedstat``: time on a CPU + run-queue wait; it survives ``exec``); without that file the
    process's CPU time (``time.process_time_ns()``: run-queue waits then count as not running). None when neither
    can be read."""
    try:
        with open("/proc/self/schedstat", "rb") as f:
            run, wait = f.read().split()[:2]
        return int(run) + int(wait)
    except (OSError, ValueError):
        try:
            return time.process_time_ns()
        except (OSError, AttributeError):  # pragma: no cover - every supported platform has it
            return None


FIRST_CODE_NS: int = time.time_ns()  # wall clock at the first line of attn-setup that ran in this process
FIRST_CODE_ACTIVE_NS: Optional[int] = active_ns()  # active_ns() then
