"""Typed-value checks the library and the command line share: value domains and device spellings.

A :class:`Domain` says which values one setting takes (an integer or number range, a closed set of names,
non-empty text) and words it for errors (:meth:`Domain.allowed`); :func:`device_spelling` reads a device as
a user may write it (``CUDA:0``, ``gpu``, ``Cpu``) into its canonical form and what was written. The command
line's table of flag domains is :data:`pipeline.cli.domains.FLAG_DOMAINS`; nothing here imports torch.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.core.errors import ConfigError

# Accepted device spellings: any case, ``gpu`` for ``cuda``; an optional ASCII index (0-9 digits, at most 6).
_DEVICE_ANY_CASE = re.compile(r"(auto|cpu)|(cuda|gpu|musa|npu|xpu|mps)(?::([0-9]{1,6}))?", re.ASCII | re.IGNORECASE)
DEVICE_ALIASES = {"gpu": "cuda"}
DEVICE_ALLOWED = ("auto", "cpu", "cuda[:N]", "musa[:N]", "npu[:N]", "xpu[:N]",
                  "any letter case (CUDA:0 = cuda:0)", "gpu[:N] = cuda[:N]")


def nearest_name(name: str, known: Any) -> Optional[str]:
    """The name in ``known`` nearest ``name`` for a "did you mean": difflib's ratio over lower-cased names (cutoff
    0.6), returned as spelled in ``known``; None when nothing is near enough. Raises nothing."""
    lower = {k.lower(): k for k in known}
    hit = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return lower[hit[0]] if hit else None


@dataclass(frozen=True)
class DeviceSpelling:
    """A device as written and as meant: ``canonical`` (``cuda:0``) and ``spelled_as`` (``CUDA:0``, None when
    the user wrote the canonical form)."""

    canonical: str
    spelled_as: Optional[str] = None


def device_spelling(text: Any) -> Optional[DeviceSpelling]:
    """The canonical device of an accepted spelling (``CUDA:0`` → ``cuda:0``, ``gpu`` → ``cuda``), or None when
    ``text`` is no device (``""``, ``cuda:x``, ``cuda:²``, ``tpu``)."""
    if not isinstance(text, str):
        return None
    m = _DEVICE_ANY_CASE.fullmatch(text)
    if m is None:
        return None
    if m.group(1):
        canonical = m.group(1).lower()
    else:
        kind = m.group(2).lower()
        canonical = DEVICE_ALIASES.get(kind, kind) + (f":{m.group(3)}" if m.group(3) is not None else "")
    return DeviceSpelling(canonical, None if canonical == text else text)


def check_spelling(device: str, spelled_as: Optional[str]) -> None:
    """Raise ConfigError (``invalid_value``, field ``device_spelled_as``) unless ``spelled_as`` is None or an
    accepted spelling of ``device`` (a request never records another device's spelling)."""
    if spelled_as is None:
        return
    spelled = device_spelling(spelled_as)
    if spelled is None or spelled.canonical != device:
        raise ConfigError(f"device_spelled_as={spelled_as!r} does not spell device={device!r}", code="invalid_value",
                          flags=[("device_spelled_as", spelled_as), ("device", device)],
                          allowed=[f"None, or a spelling of {device!r} (CUDA:0 for cuda:0)"],
                          remedy="pass device_spelled_as=None, or the text the user wrote for this device")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1 << 53 else repr(v)


@dataclass(frozen=True)
class Domain:
    """The values one setting takes.

    ``kind``: ``int`` (``lo``..``hi``, inclusive), ``float`` (finite; ``lo``/``hi`` inclusive unless
    ``lo_open``/``hi_open``), ``choice`` (``choices``; ``any_case`` ignores letter case and blanks around),
    ``text`` (non-empty), ``device`` (:func:`device_spelling`), ``packages`` (a comma-separated subset of
    ``choices``, ``''`` = none).
    ``hidden`` choices are admitted but not listed (known names refused later with a more specific error).
    ``example`` is a value inside the domain, offered by remedies.
    """

    kind: str
    example: Any
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()  # admitted, not offered (names with their own, more specific refusal later)
    any_case: bool = False
    unit: str = ""

    def admits(self, v: Any) -> bool:
        """Whether ``v`` (as argparse converted it) is inside the domain."""
        if self.kind in ("int", "float"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.kind == "int" and isinstance(v, float)):
                return False
            if isinstance(v, float) and not math.isfinite(v):
                return False
            return self._above_lo(v) and self._below_hi(v)
        if self.kind == "choice":
            if not isinstance(v, str):
                return False
            return (v.strip().lower() if self.any_case else v) in self._choices() or v in self.hidden
        if self.kind == "text":
            return isinstance(v, str) and v.strip() != ""
        if self.kind == "device":
            return device_spelling(v) is not None
        if self.kind == "packages":
            names = [p.strip().lower() for p in v.split(",") if p.strip()] if isinstance(v, str) else [None]
            return all(n in self._choices() for n in names)
        raise ValueError(f"unknown domain kind {self.kind!r}")

    def nearest(self, v: Any) -> Optional[str]:
        """The listed choice nearest ``v`` (difflib, ignoring letter case), for "did you mean"; for ``packages`` the
        one nearest the first name of ``v`` that is not a choice. None when ``v`` is admitted, nothing is near
        enough, or the domain holds no names. Raises nothing."""
        if self.kind not in ("choice", "packages") or not isinstance(v, str) or self.admits(v):
            return None
        names = [p.strip() for p in v.split(",") if p.strip()] if self.kind == "packages" else [v.strip()]
        lowered = [c.lower() for c in self.choices]
        for name in names:
            if name.lower() not in lowered:
                return nearest_name(name, self.choices)
        return None

    def _choices(self) -> tuple[str, ...]:
        return tuple(c.lower() for c in self.choices) if self.any_case or self.kind == "packages" else self.choices

    def _above_lo(self, v: float) -> bool:
        return self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)

    def _below_hi(self, v: float) -> bool:
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def allowed(self) -> str:
        """The domain in words: ``an integer in [1, 4096]``, ``a finite number in (0, 1]``, ``one of: …``."""
        unit = f" ({self.unit})" if self.unit else ""
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a finite number"
            if self.lo is not None and self.hi is not None:
                return (f"{what} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                        f"{')' if self.hi_open else ']'}{unit}")
            if self.lo is not None:
                return f"{what} {'>' if self.lo_open else '>='} {_num(self.lo)}{unit}"
            return what + unit
        if self.kind == "choice":
            return "one of: " + ", ".join(self.choices) + (" (any letter case)" if self.any_case else "")
        if self.kind == "text":
            return "a non-empty value"
        if self.kind == "device":
            return ", ".join(DEVICE_ALLOWED)
        return f"a comma-separated list of {', '.join(self.choices)} ('' = none)"
