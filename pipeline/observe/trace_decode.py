"""One trace line → one typed record, never raising: the decoder behind :mod:`pipeline.observe.trace`.

:func:`decode_record` returns the record or the reason the line is skipped (``not_json``, ``too_deep``,
``line_too_long``, ``unknown_event``, ``newer_schema``, ``invalid_record``) and how many unknown fields it dropped;
older ``schema_version`` records pass through :data:`UPGRADERS` first. The schema policy it follows is written in
:mod:`pipeline.observe.trace`'s docstring, which re-exports every name here. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import SCHEMA_VERSION

UPGRADERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_BY_TAG = {ev.event_name(c): c for c in ev.EVENT_TYPES}
MAX_LINE_BYTES = 4 << 20   # a run_started line of a 4096-layer model with a draft model is ~0.2 MB
MAX_DEPTH = ev.MAX_DEPTH   # our records nest 6 deep; the writer never writes deeper than this


def _upgrade(obj: dict[str, Any]) -> dict[str, Any]:
    for v in sorted(UPGRADERS):
        if obj.get("schema_version", 1) <= v:
            obj = UPGRADERS[v](obj)
            obj["schema_version"] = v + 1
    return obj


def _depth(obj: Any) -> int:
    """Nesting depth of decoded JSON (iterative: a hostile line must not exhaust the stack)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def _may_be_deep(line: bytes) -> bool:
    return line.count(b"[") + line.count(b"{") > MAX_DEPTH


def decode_record(line: bytes) -> tuple[Optional[ev.Event], str, int]:
    """(record or None, skip reason or "", number of unknown fields dropped) for one line.

    Never raises for any input: every failure is a skip reason (see the module docstring).
    """
    if len(line) > MAX_LINE_BYTES:
        return None, "line_too_long", 0
    if not _may_be_deep(line):
        try:  # the fast path: a current record as written
            rec = ev._decoder.decode(line)
            if rec.schema_version == SCHEMA_VERSION:
                return rec, "", 0
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None, "not_json", 0
    except RecursionError:
        return None, "too_deep", 0
    if not isinstance(obj, dict) or type(obj.get("event")) is not str or obj["event"] not in _BY_TAG:
        return None, "unknown_event", 0
    if _depth(obj) > MAX_DEPTH:
        return None, "too_deep", 0
    version = obj.get("schema_version", 1)
    if type(version) is not int:
        return None, "invalid_record", 0
    if version > SCHEMA_VERSION:
        return None, "newer_schema", 0
    if version < 1:
        return None, "invalid_record", 0
    try:
        obj = ev.restore_floats(_upgrade(obj))
        try:
            return msgspec.convert(obj, ev.AnyEvent), "", 0
        except msgspec.ValidationError:
            cls = _BY_TAG[obj["event"]]
            known = set(cls.__struct_encode_fields__) | {"event"}
            kept = {k: v for k, v in obj.items() if k in known}
            if len(kept) == len(obj):
                return None, "invalid_record", 0
            try:
                return msgspec.convert(kept, ev.AnyEvent), "", len(obj) - len(kept)
            except msgspec.ValidationError:
                return None, "invalid_record", 0
    except RecursionError:
        return None, "too_deep", 0
    except Exception:  # noqa: BLE001 - an upgrader choking on a hostile record: skip it, never crash
        return None, "invalid_record", 0
