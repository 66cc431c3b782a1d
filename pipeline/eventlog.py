"""Emitting event records: to the application's structlog logger, to a JSON-lines trace file, to memory.

The library never configures logging. Records go to ``structlog.get_logger("attn_setup")`` bound
with ``run_id``/``rank`` (the application decides where that goes), and — when the caller asks for
a trace file — to a per-run structlog ``BytesLogger`` that writes exactly one msgspec-encoded JSON
line per record and flushes it (so a crash loses nothing already emitted). Secret values given in
``SetupRequest.secrets`` are replaced by ``"<redacted>"`` in both outputs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Optional

import msgspec
import structlog

from pipeline import events as ev

REDACTED = "<redacted>"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
SECRET_ENV_PREFIX = "ATTN_SETUP_SECRET_"


def secrets_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Secrets passed to the CLI as ``ATTN_SETUP_SECRET_<NAME>=value`` → ``{NAME: value}``.

    An engine's secret arguments (API keys, hub tokens) go into ``SetupRequest.secrets`` this way
    rather than on the command line, where ``ps`` would show them; empty values are ignored.
    """
    return {k[len(SECRET_ENV_PREFIX):]: v for k, v in sorted(environ.items())
            if k.startswith(SECRET_ENV_PREFIX) and len(k) > len(SECRET_ENV_PREFIX) and v}


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
                cache_logger_on_first_use=False).bind()  # a concrete logger: a lazy proxy would re-bind per record

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
        if self._app_enabled(cls.level):
            payload = (msgspec.json.decode(self._redact_bytes(ev.encode(record))) if self._secrets
                       else msgspec.to_builtins(record))
            name = payload.pop("event")
            for k in ("run_id", "rank"):
                payload.pop(k, None)
            getattr(self._app, cls.level)(name, **payload)
        return record

    def _app_enabled(self, level: str) -> bool:
        """Whether the application's logger would keep this level (skips building the payload if not)."""
        check = getattr(self._app, "is_enabled_for", None)
        return True if check is None else bool(check(_LEVELS[level]))

    @property
    def current_state(self) -> str:
        """The state of the last record emitted (``device-init`` before any)."""
        return self.records[-1].state if self.records else "device-init"

    @contextmanager
    def heartbeat(self, what: str, every_s: float = 10.0) -> Iterator[None]:
        """Emit a ``heartbeat`` record ("still in <state>: <what> after N s") every ``every_s``
        seconds from a daemon thread while the body runs (JIT compiles, CUDA graph capture)."""
        from pipeline.heartbeat import beating

        state, start_ns = self.current_state, time.time_ns()

        def beat(n: float) -> None:
            self.emit(ev.Heartbeat, state=state, what=what, elapsed_s=round(n, 3), started_ns=start_ns,
                      message=f"still in {state}: {what} after {n:.0f} s")

        with beating(every_s, beat, name=f"attn-setup-heartbeat-{what}"):
            yield

    def _interrupted(self, reason: str, sig: Optional[str], info: Any) -> None:
        if any(isinstance(r, (ev.RunFailed, ev.RunInterrupted)) for r in self.records):
            return
        self.emit(ev.RunInterrupted, state=self.current_state, outcome="failed", reason=reason, signal=sig,
                  error=info)

    def install_signal_handlers(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> bool:
        """Write a last ``run_interrupted`` record on SIGTERM and on an uncaught exception.

        Never done on import: the CLI calls it. The previous handlers run afterwards (a default
        SIGTERM still terminates the process). Returns False when not called from the main thread
        (Python only lets the main thread set signal handlers); the exception hook is set anyway.
        """
        from pipeline.contracts import ErrorInfo
        from pipeline.errors import error_info_from

        prev_hook = sys.excepthook

        def hook(tp: Any, exc: BaseException, tb: Any) -> None:
            self._interrupted("uncaught_exception", None, error_info_from(exc, self.current_state))
            self.close()
            prev_hook(tp, exc, tb)

        def on_signal(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            self._interrupted("signal", name, ErrorInfo(
                code="interrupted", state=self.current_state, message=f"received {name} in state {self.current_state}",
                remedy="the process was stopped from outside (scheduler, timeout, operator); rerun the start"))
            self.close()
            prev = self._prev_handlers.get(signum, signal.SIG_DFL)
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        sys.excepthook = hook
        self._prev_handlers: dict[int, Any] = {}
        try:
            for s in signals:
                self._prev_handlers[s] = signal.signal(s, on_signal)
        except ValueError:  # not the main thread
            return False
        return True

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
