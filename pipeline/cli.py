"""The ``attn-setup`` command line: ``run`` (the main job), ``plan``, ``inspect``, ``replay``, ``graph``.

Every subcommand uses one exit-code table: 0 success · 1 the start failed (runtime error, failed
verification, incomplete) · 2 usage error (bad flags, unreadable file) · 3 configuration refused
(typed error, nothing allocated). Errors print one :class:`ErrorInfo` (as JSON with ``--json``).
This module configures logging for the application; the library never does.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from typing import Any, Optional, Sequence

import msgspec

from pipeline.contracts import AttentionArgs
from pipeline.errors import EXIT_USAGE, AttnSetupError, UsageError


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default after its help unless the help already states it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text.lower() or default in (None, argparse.SUPPRESS)
                or isinstance(default, bool)):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (exit 2, one ErrorInfo) instead of printing and exiting.

    Abbreviated long options are off (``allow_abbrev=False``): ``--device`` must never be taken
    for ``--device-profile``, nor ``--js`` for ``--json``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        flags, hints = [], []
        if "unrecognized arguments:" in message:
            import difflib

            known = sorted(self._all_options(getattr(self, "argv", [])))
            for tok in message.split("unrecognized arguments:", 1)[1].split():
                if not tok.startswith("--"):
                    continue
                opt = tok.split("=", 1)[0]
                prefix = [o for o in known if o.startswith(opt) and o != opt]
                near = prefix or difflib.get_close_matches(opt, [o for o in known if o != opt], n=2, cutoff=0.75)
                flags.append((opt, tok))
                if near:
                    hints.append(f"{opt}: did you mean {' or '.join(near[:2])}?"
                                 + (" (abbreviations are not accepted)" if prefix else ""))
        remedy = "; ".join(hints + [f"see '{self.prog} --help'"])
        raise UsageError(f"{self.prog}: {message}", code="usage", flags=flags, remedy=remedy)

    def _all_options(self, argv: Sequence[str] = ()) -> set[str]:
        """Long options of this parser and of the subcommand named in ``argv`` (of all, if none is)."""
        out: set[str] = set()
        for action in self._actions:
            out.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                chosen = [action.choices[a] for a in argv if a in action.choices][:1] or action.choices.values()
                for sub in chosen:
                    out |= sub._all_options() if isinstance(sub, _Parser) else set()
        return out


def field_docs(cls: type) -> dict[str, str]:
    """``{field: one-line doc}`` from the ``Fields`` section of a contract's docstring
    (``name: text`` lines, as :class:`~pipeline.contracts.AttentionArgs` writes them)."""
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Fields") + 2
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    for line in lines[start:]:
        name, sep, text = line.strip().partition(": ")
        if sep and name.isidentifier():
            out[name] = text.strip()
    return out


def attention_choices(name: str) -> Optional[list[str]]:
    """The values a field accepts, where it is a closed set (backend names, dtypes, algorithms)."""
    from pipeline import validation

    if name.endswith("attention_backend"):
        from pipeline.backends import registry

        return registry.names()
    return {"kv_cache_dtype": list(validation.KV_CACHE_DTYPES), "dtype": list(validation.MODEL_DTYPES),
            "speculative_algorithm": list(validation.SPECULATIVE_ALGORITHMS)}.get(name)


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def attention_flag_help(name: str, docs: dict[str, str]) -> str:
    """``--help`` text of one AttentionArgs flag: its field doc, default and choices."""
    default = next(f.default for f in msgspec.structs.fields(AttentionArgs) if f.name == name)
    text = f"{docs.get(name, name.replace('_', ' '))} (default: {_default_text(default)}"
    choices = attention_choices(name)
    if choices:
        text += f"; choices: {', '.join(choices)}"
    return (text + ")").replace("%", "%%")


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
    docs = field_docs(AttentionArgs)
    for name in AttentionArgs.__struct_fields__:
        kind, elem = _flag_type(hints[name])
        flag = "--" + name.replace("_", "-")
        text = attention_flag_help(name, docs)
        if kind == "bool":
            g.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=text)
        elif kind == "list":
            g.add_argument(flag, dest=name, nargs="+", type=elem, default=argparse.SUPPRESS, metavar="N", help=text)
        else:
            g.add_argument(flag, dest=name, type=elem, default=argparse.SUPPRESS,
                           metavar=name.split("_")[-1].upper(), help=text)


def attention_args_from(ns: argparse.Namespace) -> AttentionArgs:
    """Build AttentionArgs from only the flags the user gave (Struct defaults for the rest)."""
    given = {f: getattr(ns, f) for f in AttentionArgs.__struct_fields__ if hasattr(ns, f)}
    return msgspec.convert(given, AttentionArgs)


def add_setup_flags(p: argparse.ArgumentParser, *, device: bool = True) -> None:
    """Flags shared by run/plan: model, draft worker, pool sizes, log file, --json."""
    p.add_argument("--model", metavar="CONFIG_JSON", default=None,
                   help="Hugging Face config.json (default: the bundled Llama-3.1-8B)")
    p.add_argument("--draft-worker", action="store_true", help="initialize a speculative-decoding draft worker")
    p.add_argument("--draft-model", metavar="CONFIG_JSON", default=None,
                   help="the draft model's config.json (default: the draft worker serves --model)")
    if device:
        p.add_argument("--device", default="auto",
                       help="auto (a GPU when torch sees one, else cpu) | cpu | cuda[:N] | musa|npu|xpu[:N] (default: auto)")
    p.add_argument("--max-reqs", type=int, default=None, help="rows of req_to_token (default 8)")
    p.add_argument("--max-context-len", type=int, default=None, help="columns of req_to_token (default 1024)")
    p.add_argument("--num-token-slots", type=int, default=None,
                   help="KV slots per layer (default 1024 on CPU, 65536 on GPU)")
    p.add_argument("--rank", type=int, default=0, help="this process's rank (default 0; RANK under torchrun)")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables (errors too)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="print each event as a short line on stderr (the log file keeps the JSON)")
    add_attention_flags(p)


# Subcommand modules: each defines ``add_parser(subparsers)`` and ``cmd(ns) -> int`` (exit code).
# A new subcommand is one module and one line here.
COMMANDS: list[str] = [
    "pipeline.cli_run",
    "pipeline.cli_plan",
    "pipeline.cli_warmup",
    "pipeline.cli_inspect", "pipeline.cli_replay", "pipeline.cli_graph",
    "pipeline.cli_backends",
]


def _modules() -> list[Any]:
    import importlib

    return [importlib.import_module(m) for m in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    from pipeline import __version__

    p = _Parser(prog="attn-setup", description="Initialize an inference engine's attention backends as an observable "
                "state machine: run, plan, warmup, inspect, replay, graph, backends.")
    p.add_argument("--version", action="version", version=f"attn-setup {__version__}")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each event as a short line on stderr (the log file keeps the JSON)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _modules():
        mod.add_parser(sub).set_defaults(_cmd=mod.cmd)
    return p


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

    def drop_reported(_logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        # run/plan print these as their one warning line; the full records stay in the trace (and with -v)
        if not verbose and event_dict.get("event") in REPORTED_WARNINGS:
            raise structlog.DropEvent
        return event_dict

    structlog.configure(
        processors=[human_line],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.CRITICAL),
        logger_factory=lambda *_: structlog.PrintLogger(file=sys.stderr),  # the stderr of now, not of import
        cache_logger_on_first_use=False,
    )


def print_error(err: AttnSetupError, as_json: bool) -> None:
    """One ErrorInfo, its remedy in the command line's flags (:func:`pipeline.wording.cli_error`)."""
    from pipeline.wording import cli_error

    info = cli_error(err.info)
    if as_json:
        sys.stdout.write(msgspec.json.encode({"ok": False, "error": info}).decode() + "\n")
    else:
        from pipeline.report import render_error

        render_error(info)


def _quiet_stdout(stream: Any = None) -> None:
    """After a closed pipe (``attn-setup inspect big.jsonl | head``): send what is left to /dev/null,
    so the interpreter's final flush does not print a second error."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (stream or sys.stdout).fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (in-process callers)
        pass


class _ReaderMayLeave:
    """stdout for a reader that may leave early (``attn-setup backends | head -1``): the first write or flush that
    meets a closed pipe sends the rest of the report to /dev/null, and the command carries on, so its exit code
    says how the command ended, not whether anyone read all of its output (``yes | head`` style tools die of
    SIGPIPE instead; our exit codes are a contract, README's table)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self.gone = True
        _quiet_stdout(self.stream)

    def __getattr__(self, name: str) -> Any:   # isatty, fileno, encoding, … of the real stream
        return getattr(self.stream, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one subcommand; returns its exit code (README's table).

    Every way out is an exit code with one ErrorInfo, never a traceback: typed errors keep their
    code; SIGINT (Ctrl-C, KeyboardInterrupt) is 130 with ``interrupted``; a closed stdout pipe
    changes nothing (the rest of the output is dropped, :class:`_ReaderMayLeave`); any other
    exception is 1 with ``internal_error`` naming it.
    """
    real_stdout = sys.stdout
    sys.stdout = _ReaderMayLeave(real_stdout)
    try:
        return _main(argv)
    finally:
        sys.stdout = real_stdout


def _main(argv: Optional[Sequence[str]]) -> int:
    from pipeline.errors import EXIT_FAILED, EXIT_INTERRUPTED, error_info_from

    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        parser = build_parser()
        parser.argv = argv  # type: ignore[attr-defined]  # for "did you mean" hints on unknown flags
        ns = parser.parse_args(argv)
        if not ns.verbose and "torch" not in sys.modules:  # read when torch is first imported (not yet here)
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # torch's C++ logs (c10d frames) only with -v
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


def entry() -> None:  # pragma: no cover - ends the process
    """The program's entry point (``attn-setup``, ``python -m pipeline.cli``): :func:`main`, then a fast exit.

    After the command has written its report, its log and its metrics file, the interpreter's own
    teardown (clearing ~1400 modules, torch's among them, and a final garbage collection) takes ~0.9 s
    on a 2-core CPU machine — time no phase of the run can name. So the exit handlers run
    (``atexit``: logging's flush among them), stdout and stderr are flushed, and the process ends with
    ``os._exit`` and the exit code. In-process callers (tests, engines) call :func:`main` and keep
    their interpreter.
    """
    import atexit

    code = main()
    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except BaseException:  # noqa: BLE001 - a closed pipe at exit: keep the exit code
        pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
