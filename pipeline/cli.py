"""The ``attn-setup`` command line: ``run`` (the main job), ``plan``, ``inspect``, ``replay``, ``graph``.

Every subcommand uses one exit-code table: 0 success · 1 the start failed (runtime error, failed
verification, incomplete) · 2 usage error (bad flags, unreadable file) · 3 configuration refused
(typed error, nothing allocated). Errors print one :class:`ErrorInfo` (as JSON with ``--json``).
This module configures logging for the application; the library never does.
"""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any, Optional, Sequence

import msgspec

from pipeline.contracts import AttentionArgs
from pipeline.errors import EXIT_USAGE, AttnSetupError, UsageError


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (exit 2, one ErrorInfo) instead of printing and exiting."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}", code="usage", remedy=f"see '{self.prog} --help'")


def _flag_type(tp: Any) -> tuple[str, Any]:
    """('bool'|'list'|'scalar', element type) for an AttentionArgs annotation."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    base = args[0]
    if base is bool:
        return "bool", bool
    if typing.get_origin(base) is list:
        return "list", typing.get_args(base)[0]
    return "scalar", base


def add_attention_flags(p: argparse.ArgumentParser) -> None:
    """One kebab-case flag per AttentionArgs field, generated from the Struct so none is forgotten."""
    g = p.add_argument_group("attention arguments (sglang's names)")
    hints = typing.get_type_hints(AttentionArgs)
    for name in AttentionArgs.__struct_fields__:
        kind, elem = _flag_type(hints[name])
        flag = "--" + name.replace("_", "-")
        if kind == "bool":
            g.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS)
        elif kind == "list":
            g.add_argument(flag, dest=name, nargs="+", type=elem, default=argparse.SUPPRESS, metavar="N")
        else:
            g.add_argument(flag, dest=name, type=elem, default=argparse.SUPPRESS,
                           metavar=name.split("_")[-1].upper())


def attention_args_from(ns: argparse.Namespace) -> AttentionArgs:
    """Build AttentionArgs from only the flags the user gave (Struct defaults for the rest)."""
    given = {f: getattr(ns, f) for f in AttentionArgs.__struct_fields__ if hasattr(ns, f)}
    return msgspec.convert(given, AttentionArgs)


def add_setup_flags(p: argparse.ArgumentParser, *, device: bool = True) -> None:
    """Flags shared by run/plan: model, draft worker, pool sizes, log file, --json."""
    p.add_argument("--model", metavar="CONFIG_JSON", default=None,
                   help="Hugging Face config.json (default: the bundled Llama-3.1-8B)")
    p.add_argument("--draft-worker", action="store_true", help="initialize a speculative-decoding draft worker")
    p.add_argument("--draft-model", metavar="CONFIG_JSON", default=None, help="the draft model's config.json")
    if device:
        p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--max-reqs", type=int, default=None, help="rows of req_to_token (default 8)")
    p.add_argument("--max-context-len", type=int, default=None, help="columns of req_to_token (default 1024)")
    p.add_argument("--num-token-slots", type=int, default=None,
                   help="KV slots per layer (default 1024 on CPU, 65536 on GPU)")
    p.add_argument("--rank", type=int, default=0, help="this process's rank (default 0; RANK under torchrun)")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show info-level log events on stderr")
    add_attention_flags(p)


# Subcommand modules: each defines ``add_parser(subparsers)`` and ``cmd(ns) -> int`` (exit code).
# A new subcommand is one module and one line here.
COMMANDS: list[str] = [
    "pipeline.cli_run",
    "pipeline.cli_plan",
    "pipeline.cli_warmup",
    "pipeline.cli_inspect", "pipeline.cli_replay", "pipeline.cli_graph",
]


def _modules() -> list[Any]:
    import importlib

    return [importlib.import_module(m) for m in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="attn-setup", description="Initialize an inference engine's attention backends as an observable "
                "state machine: run, plan, warmup, inspect, replay, graph.")
    p.add_argument("-v", "--verbose", action="store_true", help="show info-level log events on stderr")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _modules():
        mod.add_parser(sub).set_defaults(_cmd=mod.cmd)
    return p


def configure_logging(verbose: bool) -> None:
    """Application logging: structlog's console view on stderr, warnings and up unless -v."""
    import logging

    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.WARNING),
        logger_factory=lambda *_: structlog.PrintLogger(file=sys.stderr),  # the stderr of now, not of import
        cache_logger_on_first_use=False,
    )


def print_error(err: AttnSetupError, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode({"ok": False, "error": err.info}).decode() + "\n")
    else:
        from pipeline.report import render_error

        render_error(err.info)


def _quiet_stdout() -> None:
    """After a closed pipe (``attn-setup inspect big.jsonl | head``): send what is left to /dev/null,
    so the interpreter's final flush does not print a second error."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (in-process callers)
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; returns its exit code (README's table).

    Every way out is an exit code with one ErrorInfo, never a traceback: typed errors keep their
    code; SIGINT (Ctrl-C, KeyboardInterrupt) is 130 with ``interrupted``; a closed stdout pipe is
    1; any other exception is 1 with ``internal_error`` naming it.
    """
    from pipeline.errors import EXIT_FAILED, EXIT_INTERRUPTED, error_info_from

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        ns = build_parser().parse_args(argv)
        ns._argv = argv
        configure_logging(ns.verbose)
        return int(ns._cmd(ns))
    except AttnSetupError as e:
        print_error(e, as_json)
        return e.exit_code
    except msgspec.ValidationError as e:
        err = UsageError(f"invalid flag value: {e}", code="usage", remedy="see 'attn-setup --help'")
        print_error(err, as_json)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        _print_info(error_info_from(e, "args"), as_json)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - a bug still ends in one ErrorInfo, not a traceback
        _print_info(error_info_from(e, "args"), as_json)
        return EXIT_FAILED


def _print_info(info: Any, as_json: bool) -> None:
    try:
        if as_json:
            sys.stdout.write(msgspec.json.encode({"ok": False, "error": info}).decode() + "\n")
        else:
            from pipeline.report import render_error

            render_error(info)
    except (BrokenPipeError, OSError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
