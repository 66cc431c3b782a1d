"""The ``attn-setup`` command line: ``run`` (the main job), ``plan``, ``inspect``, ``replay``, ``graph``.

Every subcommand uses one exit-code table: 0 success · 1 the start failed (runtime error, failed
verification, incomplete) · 2 usage error (bad flags, unreadable file; an output that cannot be written:
``log_write_failed``, ``output_write_failed``) · 3 configuration refused (typed error, nothing allocated).
Errors print one :class:`ErrorInfo` (as JSON with ``--json``).
This module configures logging for the application; the library never does.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional, Sequence

import msgspec

from pipeline.cli.flags import check_flags
from pipeline.cli.output import ReaderMayLeave, quiet
from pipeline.cli.flags import check_paths
from pipeline.cli.flags import (  # noqa: F401 (the parser's helpers, re-exported: this module held them)
    add_setup_flags, attention_args_from, build_parser, field_docs,
)
from pipeline.core.errors import EXIT_USAGE, AttnSetupError, UsageError


_QUIET_KEYS = ("schema_version", "ts_ns", "run_id", "rank", "launch_id", "state", "outcome", "event")


def _short(key: str, value: Any) -> str:
    """One field of a -v line: ms/s rounded, nested objects shown compactly or counted."""
    if isinstance(value, float):
        if key.endswith("_ms") or key == "capture_ms":
            return f"{value:.1f}ms"
        if key.endswith("_s"):
            return f"{value:.1f}s"
        return f"{value:.3g}"
    if isinstance(value, (dict, list)):
        text = msgspec.json.encode(value).decode()
        if len(text) <= 60:
            return text
        return f"{{{len(value)} keys}}" if isinstance(value, dict) else f"[{len(value)} items]"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def human_line(_logger: Any, level: str, event_dict: dict[str, Any]) -> str:
    """structlog renderer for ``-v``: ``HH:MM:SS.mmm LEVEL state event [outcome] key=value …`` (one short
    line per event; the log file keeps the full JSON record)."""
    import time

    ts = event_dict.get("ts_ns") or time.time_ns()
    clock = time.strftime("%H:%M:%S", time.localtime(ts / 1e9)) + f".{ts // 1_000_000 % 1000:03d}"
    outcome = event_dict.get("outcome", "ok")
    fields = " ".join(f"{k}={_short(k, v)}" for k, v in event_dict.items()
                      if k not in _QUIET_KEYS and v not in (None, [], {}, ""))
    line = (f"{clock} {level.upper():<7} {event_dict.get('state', ''):<19} {event_dict.get('event', '')}"
            + ("" if outcome == "ok" else f" [{outcome}]") + (f" {fields}" if fields else ""))
    return line if len(line) <= 240 else line[:237] + "..."


def configure_logging(verbose: bool) -> None:
    """Application logging. Without -v nothing from the event stream reaches the terminal (the
    report shows the states, skips, warnings and the one formatted error, each once); with -v every
    event is one short human line on stderr (:func:`human_line`). The log file keeps the JSON."""
    import logging

    import structlog

    structlog.configure(
        processors=[human_line],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.CRITICAL),
        logger_factory=lambda *_: structlog.PrintLogger(file=sys.stderr),  # the stderr of now, not of import
        cache_logger_on_first_use=False,
    )


def print_error(err: AttnSetupError, as_json: bool, command: Optional[str] = None) -> None:
    """One ErrorInfo in the command line's words: the flags of ``command`` (the subcommand) where a flag sets
    the field, no Python ``None`` (:func:`pipeline.cli.output.cli_error`)."""
    from pipeline.cli.output import cli_error, command_dests

    info = cli_error(err.info, command_dests(command))
    if as_json:
        sys.stdout.write(msgspec.json.encode({"ok": False, "error": info}).decode() + "\n")
    else:
        from pipeline.cli.output import render_error

        render_error(info)


# ``-v`` prints a start's events as they happen (:func:`human_line`); only ``run`` starts anything. The others log no
# event, so ``-v`` there would do nothing: it is refused, saying where their detail is (README, "Command line").
VERBOSE_COMMANDS = ("run",)
_NO_EVENTS = {
    "plan": "it decides without starting anything and logs no event; its report already lists every decision "
            "(resolved, rejected with reasons, plan, skips, warnings; --json has every field)",
    "warmup": "it compiles kernels and logs no event; its report lists every variant with its status and seconds",
    "backends": "it lists the capability records and starts nothing",
    "inspect": "it reads traces and starts nothing; it already prints what each run's events say",
    "replay": "it re-decides a trace and starts nothing; it prints each run's result and the first divergence",
    "graph": "it draws a machine and starts nothing",
}


def check_verbose(ns: Any) -> None:
    """Refuse ``-v`` (before or after the subcommand) where it has no effect: a UsageError (exit 2) naming ``-v``,
    why the command has no events to print, and where its detail is."""
    if not getattr(ns, "verbose", False) or ns.command in VERBOSE_COMMANDS:
        return
    why = _NO_EVENTS.get(ns.command, "it logs no event")
    raise UsageError(f"-v prints the events of a start as they happen, and 'attn-setup {ns.command}' has none: {why}",
                     code="usage", flags=[("-v", True)], allowed=[f"attn-setup {c} -v" for c in VERBOSE_COMMANDS],
                     remedy=f"drop -v from 'attn-setup {ns.command}' ('attn-setup run -v' prints a start's events; "
                            f"see '{help_command(ns.command)}')")


def subcommand_of(argv: Sequence[str]) -> Optional[str]:
    """The subcommand named in ``argv`` (the first argument that is one), or None."""
    from pipeline.cli.flags import command_names

    names = command_names()
    return next((a for a in argv if a in names), None)


def help_command(command: Optional[str]) -> str:
    """``attn-setup plan --help`` for a subcommand, ``attn-setup --help`` without one."""
    return f"attn-setup {command} --help" if command else "attn-setup --help"


def main(argv: Optional[Sequence[str]] = None, *, started: Optional[Callable[[], None]] = None) -> int:
    """Run one subcommand; returns its exit code (README's table). ``started`` (the console script's
    :func:`pipeline.launch.take_over`) is called once interrupts are caught here.

    Every way out is an exit code with one ErrorInfo, never a traceback: typed errors keep their
    code; SIGINT (Ctrl-C, KeyboardInterrupt) is 130 with ``interrupted``; a closed pipe on stdout, on
    stderr or on both (``2>&1 | head -1``) changes nothing (the rest of that output is dropped,
    :class:`ReaderMayLeave`; a failed command keeps its own code), nor does a stream that cannot encode the
    output (:class:`pipeline.cli.output.SafeText`: ASCII stand-ins); any other write error on stdout or stderr
    (``> /dev/full``) is exit 2 ``output_write_failed``, named on stderr when stderr works, unless the command
    failed anyway (its code wins; :mod:`pipeline.cli.output`); any other exception is 1 with
    ``internal_error`` naming it.
    """
    from pipeline.cli.output import open_std_fds, report, std_stream
    from pipeline.cli.output import safe
    from pipeline.core.errors import EXIT_FAILED

    closed = open_std_fds() if argv is None else frozenset()  # a process's own descriptors, not an in-process call's
    handlers = _handlers_now() if argv is not None else None  # ``run`` ignores SIGINT/SIGTERM once it logged its exit
    real_stdout, real_stderr = sys.stdout, sys.stderr
    out = ReaderMayLeave(safe(std_stream(real_stdout, 1, closed)), "stdout")
    err = ReaderMayLeave(safe(std_stream(real_stderr, 2, closed)), "stderr")
    sys.stdout, sys.stderr = out, err  # same exit code, any reader; a lost report is a failure
    code = EXIT_FAILED
    try:
        code = _main(argv, started)
    finally:
        try:  # buffered text meets a closed pipe or a full disk here, not in the caller's (or exit's) flush
            code = report(code, out, err)
        finally:
            sys.stdout, sys.stderr = real_stdout, real_stderr
            _restore_handlers(handlers)
    return code


def _handlers_now() -> Any:
    import signal

    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_handlers(handlers: Any) -> None:
    """An in-process caller's SIGINT and SIGTERM handlers back (``run`` raises SIGTERM as an interrupt while it
    unwinds and ignores both from its last record on, so that the process exits with the code it logged)."""
    import signal

    for s, handler in (handlers or {}).items():
        if handler is None or signal.getsignal(s) is handler:
            continue
        try:
            signal.signal(s, handler)
        except (ValueError, TypeError):  # not the main thread
            pass


def _flag_after(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value ``flag`` was given in ``argv`` (``--flag V`` or ``--flag=V``), None when absent."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def _main(argv: Optional[Sequence[str]], started: Optional[Callable[[], None]] = None) -> int:
    from pipeline.core.errors import EXIT_FAILED, error_info_from, interrupt_signal, signal_exit_code

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = any(a == "--json" or a.startswith("--json=") for a in argv)  # --json=1 is refused in JSON
    command = subcommand_of(argv)
    ns = None
    try:
        if started is not None:
            started()  # an interrupt from here on is caught below (before: the console script's clean exit)
        parser = build_parser()
        parser.argv = argv  # type: ignore[attr-defined]  # for "did you mean" hints on unknown flags
        ns = parser.parse_args(argv)
        if not ns.verbose and "torch" not in sys.modules:  # read when torch is first imported (not yet here)
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # torch's C++ logs (c10d frames) only with -v
        ns._argv = argv
        check_verbose(ns)
        check_flags(ns)  # every flag's domain (pipeline.cli.flags), before a command starts anything
        check_paths(ns)  # the path flags together: UTF-8, no output over an input (pipeline.cli.flags)
        configure_logging(ns.verbose)
        return int(ns._cmd(ns))
    except AttnSetupError as e:
        from pipeline.cli.flags import device_as_written

        e = device_as_written(e, _flag_after(argv, "--device"))
        if command == "run" and getattr(ns, "_log", None) is None:  # refused before its log: no run report
            from pipeline.cli.run import print_refused

            print_refused(e, as_json)
        else:
            print_error(e, as_json, command)
        return e.exit_code
    except msgspec.ValidationError as e:
        err = UsageError(f"invalid flag value: {e}", code="usage", remedy=f"see '{help_command(command)}'")
        print_error(err, as_json, command)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # run printed its own report; this is SIGINT (or run's SIGTERM) elsewhere
        _print_info(error_info_from(e, "args"), as_json)
        return signal_exit_code(interrupt_signal(e))
    except BrokenPipeError:  # a pipe other than stdout/stderr (both wrapped in main) stopped the command unfinished
        quiet()
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - a bug still ends in one ErrorInfo, not a traceback
        _print_info(error_info_from(e, "args", logged=False), as_json)  # no log holds it: run's own are logged
        return EXIT_FAILED


def _print_info(info: Any, as_json: bool) -> None:
    try:
        if as_json:
            sys.stdout.write(msgspec.json.encode({"ok": False, "error": info}).decode() + "\n")
        else:
            from pipeline.cli.output import render_error

            render_error(info)
    except (BrokenPipeError, OSError):
        pass


def entry(started: Optional[Callable[[], None]] = None) -> None:  # pragma: no cover - ends the process
    """The program's entry point (``attn-setup``, ``python -m pipeline.cli``): :func:`main`, then a fast exit.

    After the command has written its report, its log and its metrics file, the interpreter's own
    teardown (clearing ~1400 modules, torch's among them, and a final garbage collection) takes ~0.9 s
    on a 2-core CPU machine — time no phase of the run can name. So the exit handlers run
    (``atexit``: logging's flush among them), stdout and stderr are flushed, and the process ends with
    ``os._exit`` and the exit code. In-process callers (tests, engines) call :func:`main` and keep
    their interpreter. SIGINT is ignored from the moment :func:`main` returns: the command is over and its exit
    code decided (``run`` logged it in ``command_finished``), so a Ctrl-C in the exit handlers neither changes it
    nor prints a traceback.
    """
    import atexit
    import signal

    code = main(started=started)
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
    except (ValueError, OSError):  # pragma: no cover - entry() runs in the main thread
        pass
    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:  # noqa: BLE001 - a closed pipe at exit: keep the exit code
        pass
    os._exit(code)
