"""Numbers as the command line reads them and as the remedies search them.

Flag and ``ATTN_SETUP_*`` numbers take ASCII decimal only (``int()`` would take ``٣``, ``３``, ``8_0``); anything else is
ValueError, which :func:`pipeline.cli.flags.parser_refusal` makes the flag's typed refusal. :func:`largest_fitting`: the
memory remedies' binary search, bounded by :data:`REMEDY_MAX_BS`.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.IGNORECASE)


def ascii_int(text: str) -> int:
    """``text`` as an int when it is an optional sign and ASCII digits (surrounding blanks allowed), else
    ValueError."""
    s = text.strip(" \t")
    if not _INT.fullmatch(s):
        raise ValueError(f"not a decimal ASCII integer: {text!r}")
    return int(s)


def ascii_float(text: str) -> float:
    """``text`` as a float when written in ASCII (sign, digits, point, exponent, inf, nan), else ValueError."""
    s = text.strip(" \t")
    if not _FLOAT.fullmatch(s):
        raise ValueError(f"not an ASCII number: {text!r}")
    return float(s)


ascii_int.__name__ = "int"  # argparse names the type in its message: "invalid int value: '٣'"
ascii_float.__name__ = "float"


# Remedies never name a largest captured batch above this: its series (1027 sizes) is estimated in about a second.
REMEDY_MAX_BS = 8192


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> Optional[int]:
    """The largest of ``candidates`` (ascending) with ``fits`` (which holds on a prefix), or None: the largest first,
    then a binary search."""
    if not candidates or not fits(candidates[0]):
        return None
    if fits(candidates[-1]):
        return candidates[-1]
    lo, hi = 0, len(candidates) - 1  # fits(candidates[lo]) holds, fits(candidates[hi]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo]
