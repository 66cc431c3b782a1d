"""The ``attn-setup`` console script: a Ctrl-C or SIGTERM from the first instruction on is a clean exit.

Imports nothing but the standard library's ``os``/``signal``/``sys`` before it sets its handlers: until the command
line's own handling takes over (:func:`pipeline.cli.main`), SIGINT or SIGTERM prints one ``interrupted`` error (JSON
with ``--json``) and exits 128 + the signal's number (130, 143), never a KeyboardInterrupt traceback from an import.
Nothing has run and no log was written then.
"""

import os
import signal
import sys

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _starting(signum: int, _frame: object) -> None:
    name = signal.Signals(signum).name
    msg = f"interrupted ({name}) while attn-setup was starting, before the command ran; no log was written"
    remedy = "the process was stopped from outside (Ctrl-C, scheduler, timeout); rerun the command"
    if "--json" in sys.argv[1:]:
        import json

        line = json.dumps({"ok": False, "error": {"code": "interrupted", "state": "args", "flags": [],
                                                  "json_path": None, "message": msg, "allowed": [],
                                                  "remedy": remedy}}) + "\n"
        fd = 1
    else:
        line, fd = f"error [interrupted] in state args: {msg}\n  remedy: {remedy}\n", 2
    try:
        os.write(fd, line.encode())
    except OSError:
        pass
    os._exit(128 + signum)


def _install() -> None:
    """The early handlers, an ignored signal left ignored; only the console script imports this module, and its
    first act is this (so there is no gap before :func:`main` runs)."""
    for s in _SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _starting)


def main() -> None:  # pragma: no cover - ends the process
    """The early handlers (set on import, again here), then :func:`pipeline.cli.entry`, which puts Python's own
    handling back once it can turn an interrupt into its ErrorInfo."""
    _install()
    from pipeline.cli import entry

    entry(started=take_over)


def take_over() -> None:
    """Python's SIGINT handling (KeyboardInterrupt) and the default SIGTERM back where :func:`main` set its own: the
    command line catches interrupts from here on."""
    for s, default in zip(_SIGNALS, (signal.default_int_handler, signal.SIG_DFL)):
        if signal.getsignal(s) is _starting:
            signal.signal(s, default)


_install()
