"""One wording for remedies: field names in the library, the flags the user typed on the command line.

The library (resolve, build-mode, the contracts' checks) writes remedies with field names and
assignments — ``set attention_backend='<name>' and disable_cuda_graph=True``, ``drop
enable_pdmux``, ``raise max_reqs to at least 113`` — because an engine calling it sets fields, not
flags. The command line shows the same remedy with the flags it accepted: ``set --attention-backend
<name> and --disable-cuda-graph``, ``drop --enable-pdmux``, ``raise --max-reqs to at least
113``. :func:`to_cli` does that rewrite for the known flag destinations (:func:`cli_dests`) only, so
prose is never touched: a snake_case name is rewritten wherever it stands alone, a one-word field
(``device``, ``strict`` …) only as ``field=value`` (or ``strict`` on its own, which reads as a flag).
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
_VALUE = r"""'[^']*'|"[^"]*"|True|False|-?\d+(?:\.\d+)?"""


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


def cli_error(info: ErrorInfo) -> ErrorInfo:
    """The ErrorInfo as the command line shows it: its remedy in flags (:func:`to_cli`)."""
    return msgspec.structs.replace(info, remedy=to_cli(info.remedy))
