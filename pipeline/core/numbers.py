"""Numbers as the command line reads them and as the remedies search them.

The number parsers of the integer and float flags and of the ``ATTN_SETUP_*`` variables that stand for them take
decimal ASCII only: Python's ``int()`` and ``float()`` take any Unicode decimal digit and underscores between
digits, so ``--max-reqs ٣`` (Arabic-Indic three), ``３`` (fullwidth) and ``8_0`` would be 3, 3 and 80 — values no
one typed as such. A flag's number is an optional sign and the digits 0-9 (a float also a point, an exponent,
``inf`` and ``nan``, which each flag's domain then checks). Anything else raises ValueError, which argparse reports
as ``invalid int value`` / ``invalid float value``, and :func:`pipeline.cli.flags.parser_refusal` turns into the
flag's typed refusal (exit 2, naming the flag, the value and what it takes).

:func:`largest_fitting` is the binary search every memory remedy uses (the pools, the graphs, the workspaces),
bounded by :data:`REMEDY_MAX_BS`.
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


# A remedy never names a largest captured batch above this (the pool, graph and FlashInfer workspace remedies all
# use it): its series (1, 2, 4, 8, 16, 24, … 8192: 1027 sizes) is estimated in about a second, so a remedy search
# stays within seconds, while a workspace fitting 2**48 bytes would fit ~850M captured requests, a series no plan or
# capture gets through.
REMEDY_MAX_BS = 8192


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> Optional[int]:
    """The largest of ``candidates`` (ascending) with ``fits``, or None: the largest is tried first (a lowered top
    often fits at once), then a binary search, O(log n) calls — valid because ``fits`` holds on a prefix (the
    estimate is nondecreasing in the top, :class:`pipeline.memory.pools.GraphTrial`)."""
    if not candidates or not fits(candidates[0]):
        return None
    if fits(candidates[-1]):
        return candidates[-1]
    lo, hi = 0, len(candidates) - 1  # fits(candidates[lo]) holds, fits(candidates[hi]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo]
