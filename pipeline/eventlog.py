"""Emitting event records: to the application's structlog logger, to a JSON-lines trace file, to memory.

The library never configures logging. Records go to ``structlog.get_logger("attn_setup")`` bound
with ``run_id``/``rank`` (the application decides where that goes), and — when the caller asks for
a trace file — to a per-run structlog ``BytesLogger`` that writes exactly one msgspec-encoded JSON
line per record and flushes it (so a crash loses nothing already emitted). Secret values given in
``SetupRequest.secrets`` are replaced by ``"<redacted>"`` in both outputs.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import IO, Any, Optional

import msgspec
import structlog

from pipeline import events as ev

REDACTED = "<redacted>"


class EventLog:
    """The sink for one run's events.

    Parameters
    ----------
    run_id, rank: bound into every record.
    path: JSON-lines trace file (parent folders are created); None = no file.
    secrets: values that must never appear in any output.
    """

    def __init__(self, run_id: str, rank: int = 0, path: Optional[str | os.PathLike] = None,
                 secrets: tuple[str, ...] = ()) -> None:
        self.run_id = run_id
        self.rank = rank
        self.path = Path(path) if path is not None else None
        self.records: list[ev.Event] = []
        self._secrets = tuple(s for s in secrets if s)
        self._lock = threading.Lock()
        self._app = structlog.get_logger("attn_setup").bind(run_id=run_id, rank=rank)
        self._fh: Optional[IO[bytes]] = None
        self._file_log: Any = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")
            self._file_log = structlog.wrap_logger(
                structlog.BytesLogger(self._fh), processors=[self._render], wrapper_class=structlog.BoundLogger,
                cache_logger_on_first_use=False)

    def _render(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> bytes:
        return self._redact_bytes(ev.encode(event_dict["record"]))

    def _redact_bytes(self, data: bytes) -> bytes:
        for s in self._secrets:
            data = data.replace(msgspec.json.encode(s)[1:-1], REDACTED.encode())
        return data

    def emit(self, cls: type[ev.Event], *, state: str, outcome: ev.Outcome = "ok", **fields: Any) -> ev.Event:
        """Build a record of type ``cls`` (timestamped now), store it, and send it to both outputs."""
        record = cls(ts_ns=time.time_ns(), run_id=self.run_id, rank=self.rank, state=state, outcome=outcome, **fields)
        with self._lock:
            self.records.append(record)
            if self._file_log is not None:
                self._file_log.msg(ev.event_name(cls), record=record)
        payload = msgspec.json.decode(self._redact_bytes(ev.encode(record)))
        name = payload.pop("event")
        for k in ("run_id", "rank"):
            payload.pop(k, None)
        getattr(self._app, cls.level)(name, **payload)
        return record

    def close(self) -> None:
        """Close the trace file (records stay in memory)."""
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None
                self._file_log = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
