"""When this process began running attn-setup's code, read once when ``pipeline`` is first imported.

The kernel's creation time predates ``exec`` (a subshell's earlier commands); :func:`active_ns` beside the wall clock
bounds the time not running, which :func:`pipeline.observe.startup.process_start` leaves out. Reads one small file.
"""

from __future__ import annotations

import time
from typing import Optional

__all__ = ["FIRST_CODE_NS", "FIRST_CODE_ACTIVE_NS", "active_ns"]


def active_ns() -> Optional[int]:
    """Nanoseconds the main thread ran or waited runnable (``/proc/self/schedstat``), else ``time.process_time_ns()``,
    else None."""
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
