"""What a run records about its environment: package presence, versions, the run id, the redacted request.

Torch-free unless a package's presence is checked by import (``installed_by_import``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import time
import uuid
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.contracts import SetupRequest

PACKAGES = ("torch", "triton", "flashinfer-python")
_IMPORT_NAME = {"torch": "torch", "triton": "triton", "flashinfer-python": "flashinfer"}


def installed_by_metadata(packages: tuple[str, ...] = PACKAGES) -> dict[str, bool]:
    """Package presence from distribution metadata (no import; what ``attn-setup plan`` uses)."""
    out = {}
    for p in packages:
        try:
            importlib.metadata.version(p)
            out[p] = True
        except importlib.metadata.PackageNotFoundError:
            out[p] = False
    return out


def installed_by_import(packages: tuple[str, ...] = PACKAGES,
                        errors: Optional[dict[str, str]] = None) -> dict[str, bool]:
    """Package presence by a real import (what a run uses; a broken install counts as absent).

    ``errors``, when given, receives the import error text of each package that failed.
    """
    out = {}
    for p in packages:
        try:
            importlib.import_module(_IMPORT_NAME[p])
            out[p] = True
        except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
            out[p] = False
            if errors is not None and importlib.util.find_spec(_IMPORT_NAME[p]) is not None:
                errors[p] = f"{type(e).__name__}: {e}"
    return out


def versions(installed: Mapping[str, bool]) -> dict[str, Optional[str]]:
    """Versions recorded in the trace (attn-setup, Python, torch, CUDA, triton, flashinfer)."""
    return dict(_versions(tuple(sorted(installed.items()))))


@functools.lru_cache(maxsize=8)
def _versions(installed_items: tuple[tuple[str, bool], ...]) -> tuple[tuple[str, Optional[str]], ...]:
    """Cached per process: reading distribution metadata costs milliseconds and cannot change mid-run."""
    installed = dict(installed_items)
    import platform as _p

    def ver(d: str) -> Optional[str]:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            return None

    out = {"attn-setup": ver("attn-setup"), "python": _p.python_version()}
    out.update({p: ver(p) for p in PACKAGES})
    if installed.get("torch"):
        import torch

        out["cuda"] = torch.version.cuda
    return tuple(out.items())


def new_run_id() -> str:
    """A fresh run id, or ``ATTN_SETUP_RUN_ID`` / torchrun's ``TORCHELASTIC_RUN_ID`` when set, so the
    ranks of one launch share a run id and their traces merge by (run_id, rank)."""
    import os

    import re

    for var in ("ATTN_SETUP_RUN_ID", "TORCHELASTIC_RUN_ID"):
        shared = os.environ.get(var)
        if not shared or shared == "none":
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", shared) or ".." in shared:
            from pipeline.core.errors import UsageError

            raise UsageError(f"{var}={shared!r} is not a usable run id (it names log files)", code="usage",
                             flags=[(var, shared)], allowed=["1-128 of A-Z a-z 0-9 . _ -, not starting with . or -"],
                             remedy=f"set {var} to a plain identifier such as job-42")
        return shared
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def redacted_request(request: SetupRequest) -> dict[str, Any]:
    """The request as builtins with every secret value replaced."""
    data = msgspec.to_builtins(request)
    data["secrets"] = {k: "<redacted>" for k in request.secrets}
    return data
