"""Replay and redaction (s13): a secret (``ATTN_SETUP_SECRET_*``) equal to ordinary text — ``torch_native``,
``cpu``, ``a`` — is replaced by ``"<redacted>"`` wherever it occurs in a trace's string values
(:func:`pipeline.core.eventlog.redactor`), decisions and the recorded request included. Replay then knows only the
text around each marker:

- a recorded decision holding the marker is compared *around* it (:func:`matches_around_redaction`: the value
  computed now must read the same with some non-empty text in place of each marker), never reported as diverged
  for the marker itself; the fields so compared are listed in the run's replay (``redacted``);
- a recorded request with the marker in a field that decides something cannot be rebuilt: ``request_redacted``
  (exit 2, like ``nothing_to_replay``: the trace reads fine, it holds no usable input), naming the fields — not
  ``trace_unreadable``. Fields that decide nothing (the secrets themselves, the run id, how the device was
  written, a model's ``source`` path, shown only in messages) may hold it.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.core.errors import UsageError
from pipeline.core.eventlog import REDACTED

__all__ = ["REDACTED", "has_redacted", "matches_around_redaction", "redacted_request_fields", "request_redacted"]

_IGNORED = {"secrets", "run_id", "device_spelled_as"}  # top-level request fields that decide nothing


def has_redacted(x: Any) -> bool:
    """Whether any string in ``x`` (nested lists and dicts) holds the redaction marker."""
    if isinstance(x, str):
        return REDACTED in x
    if isinstance(x, dict):
        return any(has_redacted(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(has_redacted(v) for v in x)
    return False


def matches_around_redaction(recorded: Any, now: Any) -> bool:
    """Whether ``now`` reads as ``recorded`` once each marker in ``recorded``'s strings stands for some non-empty
    text (structure, keys and every other value equal)."""
    if isinstance(recorded, str) and REDACTED in recorded:
        if not isinstance(now, str):
            return False
        pattern = "(?:.+)".join(re.escape(p) for p in recorded.split(REDACTED))
        return re.fullmatch(pattern, now, re.DOTALL) is not None
    if isinstance(recorded, dict):
        return (isinstance(now, dict) and recorded.keys() == now.keys()
                and all(matches_around_redaction(v, now[k]) for k, v in recorded.items()))
    if isinstance(recorded, (list, tuple)):
        return (isinstance(now, (list, tuple)) and len(recorded) == len(now)
                and all(matches_around_redaction(a, b) for a, b in zip(recorded, now)))
    return recorded == now


def redacted_request_fields(request: Any, path: str = "") -> list[str]:
    """The dotted paths of the recorded ``request``'s values that hold the marker and decide something (the
    secrets, the run id, the device's spelling and a model's ``source`` decide nothing)."""
    out: list[str] = []
    if isinstance(request, str):
        return [path] if REDACTED in request else []
    items = (request.items() if isinstance(request, dict) else enumerate(request)
             if isinstance(request, (list, tuple)) else ())
    for k, v in items:
        if (not path and k in _IGNORED) or k == "source":
            continue
        out += redacted_request_fields(v, f"{path}.{k}" if path else str(k))
    return out


def request_redacted(run_id: str, rank: int, where: str, fields: list[str]) -> UsageError:
    """``request_redacted`` (exit 2): the run's recorded request cannot be rebuilt, a secret having redacted
    ``fields``; names the run, its ``run_started`` record (``where``) and the fields."""
    shown = ", ".join(fields[:8]) + (f" and {len(fields) - 8} more" if len(fields) > 8 else "")
    return UsageError(
        f"run {run_id} rank {rank}: its run_started record{where} holds request values redacted because a secret "
        f"occurs in them ({shown}); replay cannot rebuild the request from them",
        code="request_redacted", flags=[("run_id", run_id), ("fields", fields)],
        allowed=["a recorded request whose deciding values hold no secret"],
        remedy="use secrets that do not occur in ordinary values (a device, a dtype, a backend or model name), "
               "rerun and replay that trace; 'attn-setup inspect' still shows what this run did")
