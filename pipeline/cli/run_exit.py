"""How ``attn-setup run`` ends, on every exit it controls: the terminal records and the exit code.

:func:`_ended_by` turns what stopped the run (a typed refusal, SIGINT, any other crash) into its ErrorInfo and exit
code and logs ``run_failed`` / ``run_interrupted`` unless one was written; :func:`_close_run` then stops the
progress line, reads the JIT variants before the runner's ``close()`` releases the backends that know them, closes
the runner and the rank group, and — even when a close raised — writes the startup summary (SIGINT held meanwhile:
:func:`sigint_held`) and restores the signal handlers; :func:`finish_log`, last on every way out of ``cmd``, writes
``command_finished`` with the exit code and closes the log.
"""

from __future__ import annotations

import argparse
import signal
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from pipeline.core import events as ev
from pipeline.core.contracts import ErrorInfo
from pipeline.core.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, AttnSetupError, error_info_from


def _summary(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], start_ns: Optional[int]) -> Any:
    """``(startup_summary, metrics error)`` (and ``slow_phase`` warnings, the ``--metrics-file``); never raises (an
    exit path)."""
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
               code: int, t_start: Optional[int]) -> tuple[Optional[ErrorInfo], int, Any]:
    """:func:`cmd`'s ending, on every exit it controls: the progress line stopped, the JIT variants read (before
    ``close()`` releases the backends that know them), the runner and the rank group closed, then — even when a
    close raised, whose exception then goes on — :func:`_wrap_up`. The log stays open for :func:`finish_log`, which
    :func:`cmd` calls last on every way out (after the report is printed, so that ``command_finished`` carries the
    exit code the output's fate decided). Returns ``(error, exit code, startup summary)``."""
    if progress is not None:
        progress.__exit__(None, None, None)
    jit = _jit(runner)  # before close(): closing releases the backends that know what they loaded
    try:
        if runner is not None:
            runner.close()
        if group is not None:
            group.close()
    finally:
        error, code, summary = _wrap_up(ns, log, jit, error, code, t_start)
    return error, code, summary


def _wrap_up(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]], error: Optional[ErrorInfo], code: int,
             t_start: Optional[int]) -> tuple[Optional[ErrorInfo], int, Any]:
    """The startup summary and the ``--metrics-file`` written with SIGINT held (:func:`sigint_held`: a Ctrl-C there
    is logged as ``run_interrupted`` after them, exit 130), the signal handlers restored; a run that was otherwise ok
    ends 2 when its log stopped taking writes (``log_write_failed``, also while the summary was written) or its
    metrics file could not be written (``output_write_failed``). Never raises."""
    summary = None
    try:
        with sigint_held() as got:
            error, code = _interrupted_ends(log, *_log_failed(log, error, code))
            raising, log.raise_write_errors = log.raise_write_errors, False  # the summary goes on in memory
            try:
                summary, lost = _summary(ns, log, jit, t_start)
            finally:
                log.raise_write_errors = raising
            error, code = _metrics_failed(lost, *_log_failed(log, error, code))
        if got:
            error, code = _deliver_sigint(log, error, code)
    finally:
        log.restore_signal_handlers()
    return error, code, summary


def _log_failed(log: Any, error: Optional[ErrorInfo], code: int) -> tuple[Optional[ErrorInfo], int]:
    if log.write_error is not None and code == EXIT_OK:
        return log.write_error.info, log.write_error.exit_code
    return error, code


def _metrics_failed(lost: Optional[AttnSetupError], error: Optional[ErrorInfo],
                    code: int) -> tuple[Optional[ErrorInfo], int]:
    """A ``--metrics-file`` that could not be written: the error of a run that was otherwise ok (exit 2); a failed
    run keeps its own, and the metrics error is one line on stderr."""
    if lost is None:
        return error, code
    if code == EXIT_OK:
        return lost.info, lost.exit_code
    import sys

    print(f"attn-setup: {lost.info.message}", file=sys.stderr)
    return error, code


@contextmanager
def sigint_held() -> Iterator[list[int]]:
    """SIGINT held while the body runs: a Ctrl-C there only appends to the yielded list (the body — the last records,
    a file written whole — is never cut), and the handler it replaced is back afterwards. Does nothing off the main
    thread (Python only lets the main thread set handlers) or when SIGINT is ignored (it stays ignored)."""
    got: list[int] = []
    prev = signal.getsignal(signal.SIGINT)
    if prev in (signal.SIG_IGN, None):  # ignored since the process started (a background job): stays ignored
        prev = None
    else:
        try:
            signal.signal(signal.SIGINT, lambda signum, _frame: got.append(signum))
        except ValueError:  # not the main thread
            prev = None
    try:
        yield got
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)


def _deliver_sigint(log: Any, error: Optional[ErrorInfo], code: int) -> tuple[Optional[ErrorInfo], int]:
    """A Ctrl-C held by :func:`sigint_held` handed to the handler it held it from (the log's: ``run_interrupted``),
    whose KeyboardInterrupt is exit 130 here, not an exception — as a Ctrl-C anywhere else in the run."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        if callable(handler):
            handler(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass
    error, code = _interrupted_ends(log, error, code)
    if code != EXIT_INTERRUPTED:  # the handler logged nothing (the run had failed already): still a Ctrl-C's exit
        error, code = error_info_from(KeyboardInterrupt("SIGINT"), log.current_state), EXIT_INTERRUPTED
    return error, code


def exit_code_of(e: BaseException, log: Any) -> int:
    """The exit code :func:`pipeline.cli.main` gives an exception that leaves ``cmd`` after the run was wrapped up
    (while the report is printed, or from a close): 130 for a Ctrl-C — logged as ``run_interrupted`` unless the run
    already ended with a terminal record —, a typed error's own code, else 1."""
    if isinstance(e, KeyboardInterrupt):
        try:
            if not _ended(log):
                log.emit(ev.RunInterrupted, state=log.current_state, outcome="failed", reason="signal",
                         signal="SIGINT", error=error_info_from(e, log.current_state))
        except AttnSetupError:  # the log stopped taking writes just now: the Ctrl-C's exit stands
            pass
        return EXIT_INTERRUPTED
    return getattr(e, "exit_code", EXIT_FAILED)


def finish_log(log: Any, code: int, t0: float) -> None:
    """``command_finished`` with the exit code and ``duration_ms`` (ms since ``t0``, ``time.perf_counter()``
    seconds), then the log closed: the trace's last record, on every exit :func:`cmd` controls. From here on SIGINT
    is ignored in the main thread (the exit code is the one logged; :func:`pipeline.cli.main` gives an in-process
    caller its handler back)."""
    import time

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
    try:
        log.emit(ev.CommandFinished, state=log.current_state, command="run", exit_code=code,
                 duration_ms=(time.perf_counter() - t0) * 1e3)
    finally:
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
