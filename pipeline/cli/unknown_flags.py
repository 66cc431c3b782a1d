"""argparse's ``unrecognized arguments: …`` in the command line's words: each unknown flag with the value that
followed it, a "did you mean" over the subcommand's flags and the other subcommands that have the flag.

argparse lists only the tokens it could not place: on a subcommand with positional arguments (``inspect LOG …``)
the word after an unknown flag is taken as one of them (``inspect --device cpu run.jsonl``: ``cpu`` became a LOG),
so the value is read from the command line itself — the word after the flag there, unless it is itself a flag —
and the message names it as ``plan --device cpu`` does (``unrecognized arguments: --device cpu``).
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Sequence

_MARK = "unrecognized arguments:"


def _value_after(argv: Sequence[str], opt: str, nth: int) -> str:
    """The word after the ``nth`` (0-based) ``opt`` in ``argv`` when it is not a flag, else ``""``."""
    spots = [i for i, a in enumerate(argv) if a == opt]
    if nth >= len(spots) or spots[nth] + 1 >= len(argv):
        return ""
    nxt = argv[spots[nth] + 1]
    return "" if nxt.startswith("-") else nxt


def unknown_flags(message: str, argv: Sequence[str], known: set[str], by_command: Mapping[str, set[str]],
                  command: Any, prog: str) -> tuple[str, list[tuple[str, Any]], list[str]]:
    """``(message, flags, hints)`` for argparse's ``unrecognized arguments`` ``message``; ``flags`` empty (and the
    message as given) when it is another error. ``known``: the long options of the subcommand typed (``command``,
    None at the top level); ``by_command``: every subcommand's long options."""
    if _MARK not in message:
        return message, [], []
    toks = message.split(_MARK, 1)[1].split()
    words, flags, hints, seen = [], [], [], {}  # type: ignore[var-annotated]
    for i, tok in enumerate(toks):
        words.append(tok)
        if not tok.startswith("--"):
            continue
        opt, eq, val = tok.partition("=")
        nth = seen[opt] = seen.get(opt, -1) + 1
        if not eq:
            val = _value_after(argv, opt, nth)
            if val and (i + 1 >= len(toks) or toks[i + 1] != val):  # argparse placed it elsewhere (a positional)
                words.append(val)
        prefix = [o for o in known if o.startswith(opt) and o != opt]
        near = prefix or difflib.get_close_matches(opt, [o for o in known if o != opt], n=2, cutoff=0.75)
        flags.append((opt, val))
        owners = [c for c, opts in by_command.items() if opt in opts and c != command]
        if owners:
            hints.append(f"{opt} is a flag of {' and '.join(f'attn-setup {c}' for c in owners)}"
                         + (f", not of {prog}" if command else ""))
        if near:
            hints.append(f"{opt}: did you mean {' or '.join(near[:2])}?"
                         + (" (abbreviations are not accepted)" if prefix else ""))
    return f"{message.split(_MARK, 1)[0]}{_MARK} {' '.join(words)}", flags, hints
