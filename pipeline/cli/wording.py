"""One wording for remedies: field names in the library, the flags the user typed on the command line.

The library (resolve, build-mode, the contracts' checks) writes remedies with field names and
assignments — ``set attention_backend='<name>' and disable_cuda_graph=True``, ``drop
enable_pdmux``, ``raise max_reqs to at least 113`` — because an engine calling it sets fields, not
flags. The command line shows the same remedy with the flags it accepted: ``set --attention-backend
<name> and --disable-cuda-graph``, ``drop --enable-pdmux``, ``raise --max-reqs to at least
113``. :func:`to_cli` does that rewrite for the known flag destinations (:func:`cli_dests`) only, so
prose is never touched: a snake_case name is rewritten wherever it stands alone, a one-word field
(``device``, ``strict`` …) only as ``field=value`` (or ``strict`` on its own, which reads as a flag).
The whole error speaks the command line's vocabulary (:func:`cli_error`): the flag entries, the message and
the remedy name flags (``pool.max_reqs`` → ``--max-reqs``, ``args.page_size`` → ``--page-size``,
``attention_backend`` → ``--attention-backend``) wherever a flag sets that field, and no Python value leaks
(``X=None`` → ``X not set``, ``str | None`` → ``str or not set``; a flag entry without a value is printed as
``not set``). Names no flag sets (a config key, an environment variable, a trace's run id) stay as they are, and so
does a field a ``derived`` entry names (``rank_divergence``'s capture list that follows ``--max-reqs``: no flag to
change), whose sources become flags.
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Mapping

import msgspec

from pipeline.core.contracts import ErrorInfo

# One-word fields rewritten when they stand alone (the others — device, model, rank — are words of prose too).
BARE_ONE_WORD = ("strict",)
_VALUE = r"""'[^']*'|"[^"]*"|<[^<>]*>|True|False|-?\d+(?:\.\d+)?"""  # <…>: a value too long to print


def flag_of(field: str) -> str:
    """``attention_backend`` → ``--attention-backend``."""
    return "--" + field.replace("_", "-")


@functools.lru_cache(maxsize=1)
def cli_dests() -> frozenset[str]:
    """Every destination of a ``--long-option`` of every ``attn-setup`` subcommand (whose flag is its kebab case)."""
    import argparse

    from pipeline.cli.flags import build_parser

    out: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:  # argparse keeps no public list of actions
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)
            elif any(o == flag_of(a.dest) for o in a.option_strings):
                out.add(a.dest)

    walk(build_parser())
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def command_dests(command: str | None) -> frozenset[str]:
    """The flag destinations of one subcommand (``plan`` has no ``--device``), plus the main parser's;
    every subcommand's (:func:`cli_dests`) when ``command`` is None or unknown."""
    import argparse

    from pipeline.cli.flags import build_parser

    parser = build_parser()
    out = {a.dest for a in parser._actions if any(o == flag_of(a.dest) for o in a.option_strings)}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) and command in a.choices:
            sub = a.choices[command]
            return frozenset(out | {b.dest for b in sub._actions if any(o == flag_of(b.dest) for o in b.option_strings)})
    return cli_dests()


def _value(raw: str) -> str:
    return raw[1:-1] if raw[:1] in "'\"" else raw


def to_cli(text: str, dests: Iterable[str] | None = None) -> str:
    """Rewrite the field names of a library remedy into the command line's flags.

    ``field='x'`` → ``--field x``; ``field=True`` → ``--field``; ``field=3`` → ``--field 3``; a bare
    snake_case ``field`` (or ``strict``) → ``--field``. Names inside dotted paths (``pool.max_reqs``),
    environment variables and words that are not flag destinations are left alone.
    """
    names = sorted(set(cli_dests() if dests is None else dests), key=len, reverse=True)
    if not names or not text:
        return text
    alt = "|".join(re.escape(n) for n in names)
    lead = r"(?<![\w.$\-])"

    def assign(m: re.Match) -> str:
        field, raw = m.group(1), m.group(2)
        if raw == "True":
            return flag_of(field)
        if raw == "False":
            return f"drop {flag_of(field)}"
        return f"{flag_of(field)} {_value(raw)}"

    text = re.sub(rf"{lead}({alt})=({_VALUE})", assign, text)
    bare = [n for n in names if "_" in n or n in BARE_ONE_WORD]
    if bare:
        text = re.sub(rf"{lead}({'|'.join(re.escape(n) for n in bare)})(?![\w(=\-]|\.\w)",
                      lambda m: flag_of(m.group(1)), text)
    return text


def cli_flags(fix: Mapping[str, Any]) -> str:
    """Field assignments as the flags that make them: ``--attention-backend torch_native --disable-cuda-graph``.

    A ``False`` boolean is dropping the flag: ``drop --enable-two-batch-overlap``.
    """
    parts = []
    for k, v in fix.items():
        if v is True:
            parts.append(flag_of(k))
        elif v is False:
            parts.append(f"drop {flag_of(k)}")
        else:
            parts.append(f"{flag_of(k)} {v}")
    return " ".join(parts)


# Entries of the library's flags list that no flag or field sets: the message already names them (``missing_package``:
# "package 'flashinfer-python' is not installed"; ``unsupported_package`` / ``installed_version`` /
# ``supported_versions``: "package 'flashinfer-python' is 0.6.13, a version attn-setup does not support (it supports
# flashinfer-python==0.7.2 …)"), and the command line lists only what the user can change.
NOT_FLAGS = frozenset({"missing_package", "unsupported_package", "installed_version", "supported_versions"})
_PATH = re.compile(r"(?<![\w.$\-])(?:pool|args)\.([a-z_][a-z0-9_]*)\b")
_NONE_ASSIGN = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\s*(?:=|is|:)\s*None\b")
_OPTIONAL = re.compile(r"\s*\|\s*None\b")


def flag_name(name: str, dests: Iterable[str] | None = None) -> str:
    """One ErrorInfo flag entry's name on the command line: ``pool.max_reqs`` / ``args.max_reqs`` / ``max_reqs``
    → ``--max-reqs`` when a flag sets that field; any other name (``--model``, ``MASTER_ADDR``, a config key
    such as ``num_attention_heads``, ``run_id``) is returned unchanged."""
    known = cli_dests() if dests is None else frozenset(dests)
    field = name.split(".", 1)[1] if name.startswith(("pool.", "args.")) else name
    return flag_of(field) if field in known and "." not in field else name


def cli_text(text: str, dests: Iterable[str] | None = None) -> str:
    """A message or remedy in the command line's words: field paths and names that a flag sets become that
    flag (:func:`to_cli`), ``X=None`` becomes ``X not set`` and ``T | None`` becomes ``T or not set``."""
    if not text:
        return text
    known = cli_dests() if dests is None else frozenset(dests)
    text = _PATH.sub(lambda m: m.group(1) if m.group(1) in known else m.group(0), text)
    text = _NONE_ASSIGN.sub(lambda m: f"{m.group(1)} not set", text)
    text = _OPTIONAL.sub(" or not set", text)
    return to_cli(text, known)


def cli_error(info: ErrorInfo, dests: Iterable[str] | None = None) -> ErrorInfo:
    """The ErrorInfo as the command line shows it, in one vocabulary (see the module docstring).

    Flag entries are renamed by :func:`flag_name`, those in :data:`NOT_FLAGS` left out, and deduplicated (the same name twice keeps its first
    value: ``--model`` given and the loader's own ``path`` entry for the same file); the message, the
    allowed values and the remedy go through :func:`cli_text`. ``dests``: the flag destinations to use
    (default: every subcommand's, :func:`cli_dests`).
    """
    from pipeline.core.errors import Flag

    known = cli_dests() if dests is None else frozenset(dests)
    flags: list[Flag] = []
    seen: set[str] = set()
    derived = next((f.value for f in info.flags if f.name == "derived" and isinstance(f.value, dict)), {})
    for f in info.flags:
        name = f.name if f.name in derived else flag_name(f.name, known)  # a derived field is no flag to change
        if f.name == "derived" and derived:
            f = Flag(name=f.name, value={k: flag_name(str(v), known) for k, v in derived.items()})
        if name in NOT_FLAGS:
            continue
        if name not in seen:
            seen.add(name)
            flags.append(Flag(name=name, value=f.value))
    return msgspec.structs.replace(info, flags=flags, message=cli_text(info.message, known),
                                   allowed=[cli_text(a, known) for a in info.allowed],
                                   remedy=cli_text(info.remedy, known))
