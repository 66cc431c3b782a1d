"""Emitting event records: to the application's structlog logger, to a JSON-lines trace file, to memory
(docs/internals.md)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, IO, Iterator, Mapping, Optional

import msgspec
import structlog

from pipeline.core import events as ev, wire
from pipeline.core.contracts import SetupRequest
from pipeline.core.files import ends_mid_line, open_regular


def versions(installed: Mapping[str, bool]) -> dict[str, Optional[str]]:
    """Versions recorded in the trace: attn-setup, Python, each package of ``installed`` (distribution → present)
    and CUDA (torch's, when torch is installed)."""
    return dict(_versions(tuple(installed.items())))


@functools.lru_cache(maxsize=8)
def _versions(installed_items: tuple[tuple[str, bool], ...]) -> tuple[tuple[str, Optional[str]], ...]:
    """Cached per process: reading distribution metadata costs milliseconds and cannot change mid-run."""
    installed = dict(installed_items)
    import platform as _p

    def ver(d: str) -> Optional[str]:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            return None

    out = {"attn-setup": ver("attn-setup"), "python": _p.python_version()}
    out.update({p: ver(p) for p in installed})
    if installed.get("torch"):
        import torch

        out["cuda"] = torch.version.cuda
    return tuple(out.items())


def shared_run_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``ATTN_SETUP_RUN_ID``, else ``TORCHELASTIC_RUN_ID`` (``none`` = unset), or None: the launch's shared run id.
    Raises UsageError for a value that cannot name a file."""
    import os

    import re

    env = os.environ if env is None else env
    for var in ("ATTN_SETUP_RUN_ID", "TORCHELASTIC_RUN_ID"):
        shared = env.get(var)
        if not shared or shared == "none":
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", shared) or ".." in shared:
            from pipeline.core.errors import UsageError

            raise UsageError(f"{var}={shared!r} is not a usable run id (it names log files)", code="usage",
                             flags=[(var, shared)], allowed=["1-128 of A-Z a-z 0-9 . _ -, not starting with . or -"],
                             remedy=f"set {var} to a plain identifier such as job-42")
        return shared
    return None


def new_run_id() -> str:
    """A fresh run id, or the shared one (:func:`shared_run_id`) when set, so the ranks of one launch share a run id
    and their traces merge by (run_id, rank)."""
    return shared_run_id() or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def redacted_request(request: SetupRequest) -> dict[str, Any]:
    """The request as builtins with every secret value replaced."""
    data = msgspec.to_builtins(request)
    data["secrets"] = {k: "<redacted>" for k in request.secrets}
    return data


REDACTED = "<redacted>"
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
SECRET_ENV_PREFIX = "ATTN_SETUP_SECRET_"


def secrets_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``ATTN_SETUP_SECRET_<NAME>=value`` → ``{NAME: value}`` (kept off the command line); empty values ignored."""
    return {k[len(SECRET_ENV_PREFIX):]: v for k, v in sorted(environ.items())
            if k.startswith(SECRET_ENV_PREFIX) and len(k) > len(SECRET_ENV_PREFIX) and v}


def new_launch_id() -> str:
    """A fresh per-launch id (12 hex digits): one per :class:`EventLog`, written in every record."""
    return uuid.uuid4().hex[:12]


def redactor(secrets: tuple[str, ...]) -> Optional[Callable[[str], str]]:
    """``f(text)`` replacing every secret by ``"<redacted>"`` (None without secrets); longer secrets first, matched in
    :func:`pipeline.core.wire.clean_str`'s escaped form."""
    secrets = tuple(sorted({wire.clean_str(s) for s in secrets if s}, key=len, reverse=True))
    if not secrets:
        return None
    pattern = re.compile("|".join(re.escape(s) for s in secrets))
    return lambda text: pattern.sub(REDACTED, text) if text else text


class EventLog:
    """The sink for one run's events.

    ``run_id``, ``rank``, ``launch_id`` (default :func:`new_launch_id`): in every record. ``path``: JSON-lines trace,
    appended to (after a newline when cut mid-line), a regular file (:func:`open_regular`); None = no file. ``secrets``:
    redacted from string values (:func:`pipeline.core.wire.to_wire`). ``flag``: the name errors give ``path``.
    ``raise_write_errors``: :meth:`emit` raises the first write failure (attribute, may be turned off later).

    Raises :class:`pipeline.core.errors.UsageError` when ``path`` cannot be opened. Later write failures by default stop
    the file only: records stay in memory, one ``trace_write_failed`` warning, :attr:`write_error`
    (``log_write_failed``).
    """

    def __init__(self, run_id: str, rank: int = 0, path: Optional[str | os.PathLike] = None,
                 secrets: tuple[str, ...] = (), *, launch_id: Optional[str] = None, flag: str = "log_file",
                 raise_write_errors: bool = False) -> None:
        self.run_id = run_id
        self.rank = rank
        self.launch_id = launch_id if launch_id is not None else new_launch_id()
        self.path = Path(path) if path is not None else None
        self.flag = flag
        self.records: list[ev.Event] = []
        # called with each record after it was stored and written (``slow_phase`` as phases end); never per layer
        self.observers: list[Callable[[ev.Event], None]] = []
        self.write_error: Any = None
        self.raise_write_errors = raise_write_errors
        self._redact = redactor(tuple(secrets))
        self._lock = threading.RLock()  # re-entrant: a signal handler may emit while the main thread holds it
        self._app = structlog.get_logger("attn_setup").bind(run_id=run_id, rank=rank)
        self._fh: Optional[IO[bytes]] = None
        self._file_log: Any = None
        self._prev_handlers: dict[int, Any] = {}
        self._prev_hook: Any = None
        self._lead = b""  # a newline before the first record when the file's last line was cut short
        if self.path is not None:
            self._fh = open_regular(self.path, "ab", flag=flag, what="the log file")
            self._lead = b"\n" if ends_mid_line(self.path) else b""
            self._file_log = structlog.wrap_logger(
                structlog.BytesLogger(self._fh), processors=[self._render], wrapper_class=structlog.BoundLogger,
                cache_logger_on_first_use=False).bind()  # a concrete logger: a lazy proxy would re-bind per record

    def _render(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> bytes:
        lead, self._lead = self._lead, b""
        return lead + wire.encode(event_dict["record"], self._redact)

    def _write(self, record: ev.Event) -> None:
        """One line to the trace file; a failing write turns the file output off (see the class doc)."""
        try:
            self._file_log.msg(ev.event_name(type(record)), record=record)
        except (OSError, ValueError) as e:  # ValueError: a file closed under us
            from pipeline.core.errors import UsageError

            fh, self._fh, self._file_log = self._fh, None, None
            try:
                fh.close()
            except (OSError, ValueError):
                pass
            self.write_error = UsageError(
                f"writing the log file {str(self.path)!r} failed: {getattr(e, 'strerror', None) or e}",
                code="log_write_failed", flags=[(self.flag, str(self.path))],
                remedy=f"free space on its filesystem or pick another path for {self.flag}")
            self._app.warning("trace_write_failed", path=str(self.path), error=str(self.write_error.info.message))
            if self.raise_write_errors:
                raise self.write_error

    def emit(self, cls: type[ev.Event], *, state: str, outcome: ev.Outcome = "ok", **fields: Any) -> ev.Event:
        """Build a record of type ``cls`` (timestamped now), store it and send it to both outputs; raises a trace I/O
        failure only with ``raise_write_errors`` (once)."""
        record = cls(ts_ns=time.time_ns(), run_id=self.run_id, rank=self.rank, launch_id=self.launch_id, state=state,
                     outcome=outcome, **fields)
        with self._lock:
            self.records.append(record)
            if self._file_log is not None:
                self._write(record)
        if self._app_enabled(cls.level):
            payload = wire.to_wire(record, self._redact) if self._redact is not None else msgspec.to_builtins(record)
            name = payload.pop("event")
            for k in ("run_id", "rank", "launch_id"):
                payload.pop(k, None)
            getattr(self._app, cls.level)(name, **payload)
        for observe in self.observers:
            observe(record)
        return record

    def _app_enabled(self, level: str) -> bool:
        """Whether the application's logger would keep this level (skips building the payload if not)."""
        check = getattr(self._app, "is_enabled_for", None)
        return True if check is None else bool(check(_LEVELS[level]))

    @property
    def current_state(self) -> str:
        """The state of the last record emitted (``device-init`` before any), not counting records about a phase
        that already ended (``slow_phase``: tagged with that phase, not with the state the run is in)."""
        for r in reversed(self.records):
            if not getattr(r, "retrospective", False):
                return r.state
        return "device-init"

    @contextmanager
    def heartbeat(self, what: str, every_s: float = 10.0) -> Iterator[None]:
        """Emit a ``heartbeat`` record ("still in <state>: <what> after N s") every ``every_s``
        seconds from a daemon thread while the body runs (JIT compiles, CUDA graph capture)."""
        from pipeline.core.heartbeat import beating

        state, start_ns = self.current_state, time.time_ns()

        def beat(n: float) -> None:
            self.emit(ev.Heartbeat, state=state, what=what, elapsed_s=round(n, 3), started_ns=start_ns,
                      message=f"still in {state}: {what} after {n:.0f} s")

        with beating(every_s, beat, name=f"attn-setup-heartbeat-{what}"):
            yield

    def _interrupted(self, reason: str, sig: Optional[str], info: Any) -> None:
        with self._lock:
            if any(isinstance(r, (ev.RunFailed, ev.RunInterrupted)) for r in self.records):
                return
            self.emit(ev.RunInterrupted, state=self.current_state, outcome="failed", reason=reason, signal=sig,
                      error=info)

    def install_signal_handlers(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> bool:
        """Write a last ``run_interrupted`` record on SIGTERM, SIGINT and an uncaught exception (the CLI calls it). The
        previous handler runs afterwards (SIGINT: KeyboardInterrupt, exit 130); an ignored signal stays ignored; a
        returning handler is followed by KeyboardInterrupt. Returns False off the main thread (the exception hook is
        set)."""
        from pipeline.core.contracts import ErrorInfo
        from pipeline.core.errors import INTERRUPTED_REMEDY, error_info_from

        prev_hook = self._prev_hook = sys.excepthook

        def hook(tp: Any, exc: BaseException, tb: Any) -> None:
            try:
                self._interrupted("uncaught_exception", None, error_info_from(exc, self.current_state))
                self.close()
            finally:
                prev_hook(tp, exc, tb)

        def on_signal(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            self._interrupted("signal", name, ErrorInfo(
                code="interrupted", state=self.current_state, message=f"received {name} in state {self.current_state}",
                remedy=INTERRUPTED_REMEDY))
            prev = self._prev_handlers.get(signum, signal.SIG_DFL)
            if callable(prev):  # e.g. Python's SIGINT handler: raises KeyboardInterrupt, the process goes on
                prev(signum, frame)
                raise KeyboardInterrupt(name)  # a handler that returned: run_interrupted is logged, never go on
            self.close()  # the default action ends the process: close the file first
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        sys.excepthook = hook
        self._prev_handlers = {}
        try:
            for s in signals:
                if signal.getsignal(s) == signal.SIG_IGN:
                    continue  # ignored when the process started (a background job): stays ignored, as Python does
                self._prev_handlers[s] = signal.signal(s, on_signal)
        except ValueError:  # not the main thread
            return False
        return True

    def restore_signal_handlers(self) -> None:
        """Put back the handlers and exception hook :meth:`install_signal_handlers` replaced."""
        if self._prev_hook is not None:
            sys.excepthook, self._prev_hook = self._prev_hook, None
        for s, prev in list(self._prev_handlers.items()):
            try:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            except ValueError:  # not the main thread
                break
        self._prev_handlers = {}

    def close(self) -> None:
        """Close the trace file (records stay in memory). Never raises."""
        with self._lock:
            if self._fh is not None:
                fh, self._fh, self._file_log = self._fh, None, None
                try:
                    fh.close()
                except (OSError, ValueError):
                    pass

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

