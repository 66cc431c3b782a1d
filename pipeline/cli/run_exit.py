"""How ``attn-setup run`` ends, on every exit it controls: the terminal records and the exit code.

:func:`_ended_by` turns what stopped the run (a typed refusal, SIGINT, any other crash) into its ErrorInfo and exit
code and logs ``run_failed`` / ``run_interrupted`` unless one was written; :func:`_close_run` then stops the
progress line, reads the JIT variants before the runner's ``close()`` releases the backends that know them, closes
the runner and the rank group, and — even when a close raised — writes the startup summary and
``command_finished`` with the exit code, closes the log and restores the signal handlers.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from pipeline.core import events as ev
from pipeline.core.contracts import ErrorInfo
from pipeline.core.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, AttnSetupError, error_info_from


def _summary(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], start_ns: Optional[int]) -> Any:
    """``startup_summary`` (and ``slow_phase`` warnings, the ``--metrics-file``); never raises (an exit path)."""
    from pipeline.cli.startup import finish_startup

    return finish_startup(ns, log, jit, start_ns)


def _jit(runner: Any) -> list[dict[str, Any]]:
    """The FlashInfer JIT variants the runner's backends loaded, read before ``close()`` releases them."""
    from pipeline.cli.startup import jit_reports

    try:
        return jit_reports(runner)
    except Exception:  # noqa: BLE001 - an exit path: the summary goes on without them
        return []


def _ended(log: Any) -> bool:
    return any(isinstance(r, (ev.RunFailed, ev.RunInterrupted)) for r in log.records)


def _close_run(ns: argparse.Namespace, log: Any, runner: Any, group: Any, progress: Any, error: Optional[ErrorInfo],
               code: int, t0: float, t_start: Optional[int]) -> tuple[Optional[ErrorInfo], int, Any]:
    """:func:`cmd`'s ending, on every exit it controls: the progress line stopped, the JIT variants read (before
    ``close()`` releases the backends that know them), the runner and the rank group closed, then — even when a
    close raised — a failed trace write turned into the exit (``log_write_failed``, exit 2) of a run that was
    otherwise ok, the startup summary and the signal handlers restored. The log stays open for
    :func:`finish_log` (after the report is printed, so that ``command_finished`` carries the exit code the output's
    fate decided); when a close raised, :func:`finish_log` is done here before the exception goes on.
    Returns ``(error, exit code, startup summary)``."""
    if progress is not None:
        progress.__exit__(None, None, None)
    jit = _jit(runner)  # before close(): closing releases the backends that know what they loaded
    try:
        if runner is not None:
            runner.close()
        if group is not None:
            group.close()
    except BaseException:
        error, code, _ = _wrap_up(ns, log, jit, error, code, t_start)
        finish_log(log, code, t0)
        raise
    return _wrap_up(ns, log, jit, error, code, t_start)


def _wrap_up(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], error: Optional[ErrorInfo], code: int,
             t_start: Optional[int]) -> tuple[Optional[ErrorInfo], int, Any]:
    if log.write_error is not None and code == EXIT_OK:
        error, code = log.write_error.info, log.write_error.exit_code
    error, code = _interrupted_ends(log, error, code)
    summary = _summary(ns, log, jit, t_start)
    log.restore_signal_handlers()
    return error, code, summary


def finish_log(log: Any, code: int, t0: float) -> None:
    """``command_finished`` with the exit code and ``duration_ms`` (ms since ``t0``, ``time.perf_counter()``
    seconds), then the log closed: the trace's last record, on every exit :func:`cmd` controls."""
    import time

    log.emit(ev.CommandFinished, state=log.current_state, command="run", exit_code=code,
             duration_ms=(time.perf_counter() - t0) * 1e3)
    log.close()


def _ended_by(e: BaseException, log: Any) -> tuple[ErrorInfo, int]:
    """The ErrorInfo and exit code of what stopped the run, logged as its terminal record unless one was written:
    a typed refusal (its exit code; refused in preflight when nothing was logged yet), SIGINT (exit 130: the
    handler wrote ``run_interrupted``, the unwinding released), any other crash (exit 1)."""
    if isinstance(e, AttnSetupError):
        error, code = e.info, e.exit_code
    elif isinstance(e, KeyboardInterrupt):
        # report the state the signal arrived in (the handler's record), not 'failed', where the unwinding ended
        seen = next((r for r in reversed(log.records) if isinstance(r, ev.RunInterrupted)), None)
        error = seen.error if seen is not None else error_info_from(e, next(
            (r.state for r in reversed(log.records) if r.state != "failed"), log.current_state))
        code = EXIT_INTERRUPTED
    else:
        error, code = error_info_from(e, log.current_state), EXIT_FAILED
    if not _ended(log):
        if isinstance(e, KeyboardInterrupt):
            log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal", signal="SIGINT",
                     error=error)
        else:
            log.emit(ev.RunFailed, state=error.state if isinstance(e, AttnSetupError) else log.current_state,
                     outcome="failed", error=error)
    return error, code


def _interrupted_ends(log: Any, error: Optional[ErrorInfo], code: int) -> tuple[Optional[ErrorInfo], int]:
    """Once ``run_interrupted`` is logged for a signal, the run ends with 130 and that record's error, whatever
    else happened after it (a handler that returned, an exception swallowed on the way out): never a run that
    logs an interruption and then says it succeeded."""
    seen = next((r for r in log.records if isinstance(r, ev.RunInterrupted) and r.reason == "signal"), None)
    if seen is None or code == EXIT_INTERRUPTED:
        return error, code
    return seen.error, EXIT_INTERRUPTED
