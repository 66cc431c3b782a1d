"""The ``attn-setup`` parser: every subcommand's flags, the ``AttentionArgs`` flags generated from the Struct.

:func:`build_parser` loads the subcommand modules of :data:`COMMANDS` by name; each adds its own flags
(:func:`add_setup_flags` for the ones run, plan and warmup share) and its ``cmd``.
"""

from __future__ import annotations

import argparse
import re
import typing
from typing import Any, Optional, Sequence

import msgspec

from pipeline.cli.domains import parser_refusal
from pipeline.cli.unknown_flags import unknown_flags
from pipeline.core.contracts import AttentionArgs
from pipeline.core.errors import UsageError
from pipeline.core.numbers import ascii_float, ascii_int


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

    last_argv: list[str] = []  # the command line the top-level parse_args got (subparsers report its errors)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        import sys

        _Parser.last_argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        """Raise the usage error: named for the subcommand the user typed (``attn-setup plan: …``), each unknown
        flag with the value that followed it, a "did you mean" over this subcommand's flags, the other
        subcommands that have the flag, and ``attn-setup <subcommand> --help``."""
        argv = list(getattr(self, "argv", []))
        command = next((a for a in argv if a in command_names()), None) if self.prog == "attn-setup" else None
        prog = f"{self.prog} {command}" if command else self.prog
        message, flags, hints = unknown_flags(message, argv, set(self._all_options(argv)),
                                              self._options_by_command(), command, prog)
        allowed: list[str] = []
        if not flags:
            flags, allowed, hint = self._argument_error(message, argv or list(getattr(_Parser, "last_argv", [])))
            hints += [hint] if hint else []
        remedy = "; ".join(hints + [f"see '{prog} --help'"])
        refused = parser_refusal(command or self.prog.split()[-1], flags[0][0], flags[0][1], message) \
            if re.match(r"argument \S+: invalid (\w+ value|choice)", message) else None
        if refused is not None:  # a value of the wrong type or an unknown choice: the flag's domain (exit 2)
            raise refused
        raise UsageError(f"{prog}: {message}", code="usage", flags=flags, allowed=allowed, remedy=remedy)

    @staticmethod
    def _argument_error(message: str, argv: list[str]) -> tuple[list[tuple[str, Any]], list[str], str]:
        """The flag, its value, what it allows and a hint, from argparse's own ``argument X: …`` and
        ``the following arguments are required: …`` messages (argparse words them; the ErrorInfo must
        name the flag in ``flags`` too, not only in the text)."""
        import re

        m = re.match(r"argument (\S+): (.*)", message, re.S)
        if m is None:
            req = re.match(r"the following arguments are required: (.*)", message)
            names = [n.strip() for n in req.group(1).split(",")] if req else []
            return ([(n.split("/")[-1], "") for n in names],
                    [f"{n.split('/')[-1]} given" for n in names], "")
        flag, why = m.group(1).split("/")[-1], m.group(2)
        spelled = [o for o in m.group(1).split("/")]
        value: Any = ""
        for i, tok in enumerate(argv):
            name, eq, rest = tok.partition("=")
            if name in spelled:
                value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        got = re.search(r"invalid (\w+) value: '(.*)'$", why, re.S)
        allowed, hint = [], ""
        if got is not None:
            value = got.group(2)
            allowed = [{"int": "an integer (decimal digits, e.g. 8)", "float": "a number (e.g. 0.5)"}.get(
                got.group(1), f"a {got.group(1)} value")]
            hint = f"pass {flag} {allowed[0].split(' (')[0].replace('an integer', 'a whole number')}"
        elif why.startswith("invalid choice"):
            from pipeline.core.validation import nearest_name

            allowed = re.findall(r"'([^']*)'", why.split("choose from", 1)[-1])
            given = re.match(r"invalid choice: '(.*)' \(choose from", why, re.S)
            value = given.group(1) if given else value  # a positional (the subcommand) is not found in argv by name
            near = nearest_name(value, allowed) if given else None
            hint = (f"did you mean {near!r}? " if near else "") + f"pass {flag} with one of: {', '.join(allowed)}"
        elif why.startswith("expected"):
            allowed = ["a value after the flag"]
            hint = (f"a value that starts with '-' must be attached: {flag}=VALUE" if str(value).startswith("-") else f"give {flag} its value")
        elif why.startswith("ignored explicit argument"):  # --json=1: a switch takes no value
            allowed, hint = [f"{flag} alone (a switch takes no value)"], f"pass {flag} without ={value}"
        elif "not allowed with argument" in why:
            other = why.split("not allowed with argument", 1)[1].strip().split("/")[-1]
            allowed = [f"{flag} or {other}, not both"]
            hint = f"drop {flag} or {other}"
        return [(flag, value)], allowed, hint

    def _options_by_command(self) -> dict[str, set[str]]:
        """``{subcommand: its long options}`` (empty for a subcommand's own parser)."""
        out: dict[str, set[str]] = {}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out[name] = {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
        return out

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
    """``{field: doc}`` from the ``Fields`` section of a contract's docstring (``name: text`` lines, as
    :class:`~pipeline.core.contracts.AttentionArgs` writes them); a line indented deeper than the field's continues
    its text (a doc cut at its first line ended ``--help`` mid-sentence)."""
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Fields") + 2
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    last, indent = None, 0
    for line in lines[start:]:
        name, sep, text = line.strip().partition(": ")
        depth = len(line) - len(line.lstrip())
        if sep and name.isidentifier() and (last is None or depth <= indent):
            out[name], last, indent = text.strip(), name, depth
        elif last is not None and line.strip() and depth > indent:
            out[last] += " " + line.strip()
        else:
            last = None
    return out


def attention_choices(name: str) -> Optional[list[str]]:
    """The values a field accepts, where it is a closed set (backend names, dtypes, algorithms)."""
    from pipeline.core import validation

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


def _ascii(t: Any) -> Any:
    """The parser of a flag of type ``t``: ASCII-only for int and float (:mod:`pipeline.core.numbers`)."""
    return {int: ascii_int, float: ascii_float}.get(t, t)


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
            g.add_argument(flag, dest=name, nargs="+", type=_ascii(elem), default=argparse.SUPPRESS, metavar="N",
                           help=text)
        else:
            g.add_argument(flag, dest=name, type=_ascii(elem), default=argparse.SUPPRESS,
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
    p.add_argument("--max-reqs", type=ascii_int, default=None, help="rows of req_to_token (default 8)")
    p.add_argument("--max-context-len", type=ascii_int, default=None, help="columns of req_to_token (default 1024)")
    p.add_argument("--num-token-slots", type=ascii_int, default=None,
                   help="KV slots per layer (default 1024 on CPU, 65536 on GPU)")
    p.add_argument("--rank", type=ascii_int, default=0, help="this process's rank (default 0; RANK under torchrun)")
    p.add_argument("--world-size", type=ascii_int, default=1, help="number of ranks (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables (errors too)")
    add_attention_flags(p)


# Subcommand modules: each defines ``add_parser(subparsers)`` and ``cmd(ns) -> int`` (exit code). A new
# subcommand is one module and one line here. They are named, not imported here, as the backend registry names
# its factories: each command imports this module for the shared flags, so the parser loads them by name.
COMMANDS: list[str] = [
    "pipeline.cli.run",
    "pipeline.cli.plan",
    "pipeline.cli.warmup",
    "pipeline.cli.inspect", "pipeline.cli.replay", "pipeline.cli.graph",
    "pipeline.cli.backends",
]


def command_names() -> list[str]:
    """The subcommand names (``run``, ``plan`` …), from :data:`COMMANDS` without importing them."""
    return [m.rsplit(".", 1)[1] for m in COMMANDS]


def _modules() -> list[Any]:
    import importlib

    return [importlib.import_module(m) for m in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    from pipeline import __version__

    p = _Parser(prog="attn-setup", description="Initialize an inference engine's attention backends as an observable "
                "state machine: run, plan, warmup, inspect, replay, graph, backends.")
    p.add_argument("--version", action="version", version=f"attn-setup {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _modules():
        cmd = mod.add_parser(sub)
        # every subcommand takes -v (after its name too), so that pipeline.cli.check_verbose refuses it in one
        # place, with its reason, for each command that logs no event — never argparse's "unrecognized arguments"
        cmd.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
        cmd.set_defaults(_cmd=mod.cmd)
    return p


_VERBOSE_HELP = ("run: print each event as a short line on stderr (the log file keeps the JSON); the other commands "
                 "log no event and refuse it (exit 2), before or after the subcommand")
