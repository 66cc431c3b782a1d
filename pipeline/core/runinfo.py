"""What a run records about its environment: package versions, the run id, the redacted request.

Package presence is the backends' question (:mod:`pipeline.backends.packages`). Torch-free, except that
:func:`versions` reads torch's CUDA version when torch is installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time
import uuid
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.contracts import SetupRequest

def versions(installed: Mapping[str, bool]) -> dict[str, Optional[str]]:
    """Versions recorded in the trace: attn-setup, Python, each package of ``installed`` (distribution → present)
    and CUDA (torch's, when torch is installed)."""
    return dict(_versions(tuple(installed.items())))


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
    out.update({p: ver(p) for p in installed})
    if installed.get("torch"):
        import torch

        out["cuda"] = torch.version.cuda
    return tuple(out.items())


def shared_run_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``ATTN_SETUP_RUN_ID``, else torchrun's ``TORCHELASTIC_RUN_ID`` (``none`` counts as unset), or None: the run
    id every rank of a launch shares, known before the run starts (``--log-file``'s ``{run_id}`` is checked with
    it, :mod:`pipeline.cli.paths`). Raises UsageError naming the variable for a value that cannot name a file."""
    import os

    import re

    env = os.environ if env is None else env
    for var in ("ATTN_SETUP_RUN_ID", "TORCHELASTIC_RUN_ID"):
        shared = env.get(var)
        if not shared or shared == "none":
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", shared) or ".." in shared:
            from pipeline.core.errors import UsageError

            raise UsageError(f"{var}={shared!r} is not a usable run id (it names log files)", code="usage",
                             flags=[(var, shared)], allowed=["1-128 of A-Z a-z 0-9 . _ -, not starting with . or -"],
                             remedy=f"set {var} to a plain identifier such as job-42")
        return shared
    return None


def new_run_id() -> str:
    """A fresh run id, or the shared one (:func:`shared_run_id`) when set, so the ranks of one launch share a run id
    and their traces merge by (run_id, rank)."""
    return shared_run_id() or time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def redacted_request(request: SetupRequest) -> dict[str, Any]:
    """The request as builtins with every secret value replaced."""
    data = msgspec.to_builtins(request)
    data["secrets"] = {k: "<redacted>" for k in request.secrets}
    return data
