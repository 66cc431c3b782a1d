"""The packages the backends need: names, import and install names, supported versions, and installed presence.

Presence by metadata (``plan``, ``backends``) or by import (a run; resolve compares both,
:func:`states.resolve.decide_for_run`). :data:`Presence`: False, the installed version, or True (version not read).
Names and ranges: :data:`pipeline.backends.records.PACKAGES`. Torch-free unless checked by import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Optional, Sequence, Union

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from pipeline.backends.records import PACKAGES as _PACKAGES

Presence = Union[bool, str]


def names() -> tuple[str, ...]:
    """Every distribution a backend needs (``torch``, ``triton``, ``flashinfer-python``), in record order."""
    return tuple(_PACKAGES)


def import_name(dist: str) -> str:
    """The module a distribution is imported as (``flashinfer-python`` → ``flashinfer``)."""
    return _PACKAGES[dist][0] if dist in _PACKAGES else dist


def supported_versions(dist: str) -> SpecifierSet:
    """The versions of ``dist`` attn-setup supports (the tested ones), e.g. ``==0.7.2``; any for an unknown one."""
    return SpecifierSet(_PACKAGES[dist][1] if dist in _PACKAGES else "")


def requirement(dist: str) -> str:
    """``dist`` with its supported versions, as pip takes it: ``flashinfer-python==0.7.2``, ``torch>=2.11,<2.16``."""
    return f"{dist}{_PACKAGES[dist][1]}" if dist in _PACKAGES else dist


def install_hint(dist: str) -> str:
    """How to install a supported version of a distribution (``pip install 'flashinfer-python==0.7.2'``), for a reason
    or remedy."""
    return f"pip install '{requirement(dist)}'" if dist in _PACKAGES else f"pip install {dist}"


def is_supported(dist: str, version: str) -> bool:
    """Whether ``version`` (as its metadata spells it: ``2.13.0+cpu``) is in :func:`supported_versions`; a version that
    is not PEP 440 is not. Pre-releases (a torch nightly) are not, unless the range names one."""
    try:
        return supported_versions(dist).contains(Version(version), prereleases=False)
    except InvalidVersion:
        return False


def unsupported(dist: str, presence: Presence) -> Optional[str]:
    """The installed version of ``dist`` when it is present at a version outside its supported range, else None
    (absent, supported, or a presence whose version was not read)."""
    if isinstance(presence, str) and not is_supported(dist, presence):
        return presence
    return None


def canonical(name: str) -> Optional[str]:
    """The distribution a user-given name means: a distribution name or its import name, any case; None if
    none (``flashinfer`` and ``flashinfer_python`` → ``flashinfer-python``)."""
    low = name.strip().lower()
    for dist in _PACKAGES:
        if low in (dist, import_name(dist), dist.replace("-", "_")):
            return dist
    return None


def metadata_version(dist: str) -> Optional[str]:
    """The installed version of ``dist`` by its distribution metadata (no import), or None when absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_by_metadata(packages: Optional[Sequence[str]] = None) -> dict[str, Presence]:
    """Presence by distribution metadata (no import) of ``packages`` (default: :func:`names`): the version, or
    False."""
    return {p: metadata_version(p) or False for p in (packages if packages is not None else names())}


def installed_by_import(packages: Optional[Sequence[str]] = None,
                        errors: Optional[dict[str, str]] = None) -> dict[str, Presence]:
    """Presence by import of ``packages`` (default :func:`names`): metadata version (True without one) or False;
    ``errors`` receives each failed import's text."""
    out: dict[str, Presence] = {}
    for p in packages if packages is not None else names():
        mod = import_name(p)
        try:
            importlib.import_module(mod)
            out[p] = metadata_version(p) or True
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            out[p] = False
            if errors is not None and importlib.util.find_spec(mod) is not None:
                errors[p] = f"{type(e).__name__}: {e}"
    return out
