"""The packages the backends need: distribution names, how each is imported and installed, and whether it is.

Presence is read two ways: by distribution metadata (no import: what ``attn-setup plan`` and
``attn-setup backends`` use) and by a real import (what a run uses: a broken install counts as absent);
resolve compares the two so that a run never silently decides differently from ``plan``
(:func:`states.resolve.decide_for_run`). The names come from :data:`pipeline.backends.records.PACKAGES`,
next to the capability records that list them. Torch-free unless a presence is checked by import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Optional, Sequence

from pipeline.backends.records import PACKAGES as _PACKAGES


def names() -> tuple[str, ...]:
    """Every distribution a backend needs (``torch``, ``triton``, ``flashinfer-python``), in record order."""
    return tuple(_PACKAGES)


def import_name(dist: str) -> str:
    """The module a distribution is imported as (``flashinfer-python`` → ``flashinfer``)."""
    return _PACKAGES[dist][0] if dist in _PACKAGES else dist


def install_hint(dist: str) -> str:
    """How to install a distribution, for a "package missing" reason (``pip install 'flashinfer-python>=0.6.13,<0.7'``: the
    pins of attn-setup's ``cuda`` extra, a command that works whether attn-setup came from PyPI or a clone)."""
    return _PACKAGES[dist][1] if dist in _PACKAGES else f"pip install {dist}"


def canonical(name: str) -> Optional[str]:
    """The distribution a user-given name means: a distribution name or its import name, any case; None if
    none (``flashinfer`` and ``flashinfer_python`` → ``flashinfer-python``)."""
    low = name.strip().lower()
    for dist in _PACKAGES:
        if low in (dist, import_name(dist), dist.replace("-", "_")):
            return dist
    return None


def installed_by_metadata(packages: Optional[Sequence[str]] = None) -> dict[str, bool]:
    """Presence by distribution metadata (no import) of ``packages`` (default: :func:`names`)."""
    out = {}
    for p in packages if packages is not None else names():
        try:
            importlib.metadata.version(p)
            out[p] = True
        except importlib.metadata.PackageNotFoundError:
            out[p] = False
    return out


def installed_by_import(packages: Optional[Sequence[str]] = None,
                        errors: Optional[dict[str, str]] = None) -> dict[str, bool]:
    """Presence by a real import of ``packages`` (default: :func:`names`); a broken install counts as absent.

    ``errors``, when given, receives the import error text of each package that is there but failed.
    """
    out = {}
    for p in packages if packages is not None else names():
        mod = import_name(p)
        try:
            importlib.import_module(mod)
            out[p] = True
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            out[p] = False
            if errors is not None and importlib.util.find_spec(mod) is not None:
                errors[p] = f"{type(e).__name__}: {e}"
    return out
