"""The number parsers of the command line's integer and float flags and of the ``ATTN_SETUP_*`` variables that
stand for them: ASCII only (s13; the variables since adversarial pass #5).

Python's ``int()`` and ``float()`` take any Unicode decimal digit and underscores between digits, so ``--max-reqs
٣`` (Arabic-Indic three), ``３`` (fullwidth) and ``8_0`` were accepted as 3, 3 and 80 — values no one typed as such.
A flag's number is decimal ASCII: an optional sign and the digits 0-9 (a float also a point, an exponent, ``inf``
and ``nan``, which each flag's domain then checks). Anything else raises ValueError, which argparse reports as
``invalid int value`` / ``invalid float value``, and :func:`pipeline.cli.domains.parser_refusal` turns into the
flag's typed refusal (exit 2, naming the flag, the value and what it takes).
"""

from __future__ import annotations

import re

__all__ = ["ascii_float", "ascii_int"]

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
