"""The envelope every event record carries (:class:`Event`) and its field types; the records themselves are in
:mod:`pipeline.core.events_setup`, :mod:`pipeline.core.events_runner` and :mod:`pipeline.core.events_observe`, the
wire codec in :mod:`pipeline.core.event_wire`, and :mod:`pipeline.core.events` gathers them (import from there).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from pipeline.core.contracts import SCHEMA_VERSION

Outcome = Literal["ok", "skipped", "failed"]
Ns = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # wall-clock ns (time.time_ns() fits int64)


class Event(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="event"):
    """Fields every record carries. ``level`` (class attribute) is the log level it is emitted at.

    ``launch_id`` identifies one process's :class:`~pipeline.core.eventlog.EventLog` (a launch): two
    launches that share a ``run_id`` and a log file (``ATTN_SETUP_RUN_ID`` reused, a retried start)
    stay separate runs when read back. ``""`` in traces written before the field existed.
    The reader refuses ``schema_version < 1``, ``ts_ns`` outside ``[0, 2**63)`` and ``rank < 0``
    (values the writer never produces).
    """

    level: ClassVar[str] = "info"
    schema_version: Annotated[int, msgspec.Meta(ge=1)] = SCHEMA_VERSION
    ts_ns: Ns
    run_id: str
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    launch_id: str = ""
    state: str
    outcome: Outcome = "ok"
