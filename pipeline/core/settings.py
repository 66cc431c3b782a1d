"""Settings sglang also reads from the environment: explicit field > env var > default, logged as ``setting_resolved``.

``zbal_local_mem_size`` ↔ ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` (bytes, default 0 = off); ``flashinfer_workspace_size`` ↔
``SGLANG_FLASHINFER_WORKSPACE_SIZE`` (default :func:`pipeline.backends.flashinfer.rules.flashinfer_workspace_size`). An
env value is checked like the field (:func:`check_env`, up front).
"""

from __future__ import annotations

import os
import re
from typing import Literal, Mapping, Optional

import msgspec

from pipeline.core.contracts import AttentionArgs
from pipeline.core.errors import ConfigError
from pipeline.core.hf_config import CACHE_ENV
from pipeline.core.shard import PARTITION_ENV
from pipeline.core.validation import check_size

Source = Literal["field", "env", "default"]


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    """One resolved setting: ``field`` (the AttentionArgs name), ``value`` (bytes), the ``source`` that won
    (``field`` > ``env`` > ``default``) and the environment variable behind it (logged as ``setting_resolved``)."""

    field: str
    value: int
    source: Source
    env_var: Optional[str] = None


ENV_VARS = {"zbal_local_mem_size": "SGLANG_ZBAL_LOCAL_MEM_SIZE",
            "flashinfer_workspace_size": "SGLANG_FLASHINFER_WORKSPACE_SIZE"}
# 0 turns zbal lazy memory off; a FlashInfer workspace of 0 bytes cannot hold any plan.
_ALLOW_ZERO = {"zbal_local_mem_size": True, "flashinfer_workspace_size": False}


def _from_env(env: Mapping[str, str], field: str) -> Optional[int]:
    """The env var's value for ``field`` (None when unset or empty), checked as the field is."""
    name = ENV_VARS[field]
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,30}", text, re.ASCII):
        what = "an integer of more than 30 digits" if re.fullmatch(r"[+-]?[0-9]+", text, re.ASCII) else repr(raw)
        raise ConfigError(f"environment variable {name}={what[:80]} is not a byte count", code="invalid_value",
                          flags=[(name, raw[:80])], allowed=[f"an integer (bytes) as for --{field.replace('_', '-')}"],
                          remedy=f"unset {name} or set it to a byte count")
    check_size(field, int(text), allow_zero=_ALLOW_ZERO[field], source=name)
    return int(text)


def check_env(env: Mapping[str, str] = os.environ) -> None:
    """Check every size env var sglang also reads; ConfigError (``invalid_value``) naming variable, value and range."""
    for field in ENV_VARS:
        _from_env(env, field)


def explicit_or_env(args: AttentionArgs, field: str,
                    env: Mapping[str, str] = os.environ) -> Optional[tuple[int, Source]]:
    """``(value, source)`` of ``field`` when the field is set or its environment variable is, else None (the
    caller's default applies). Raises ConfigError for an env value that is not an allowed byte count."""
    if getattr(args, field) is not None:
        return getattr(args, field), "field"
    v = _from_env(env, field)
    return None if v is None else (v, "env")


def setting(field: str, value: int, source: Source) -> Setting:
    """The :class:`Setting` record of ``field`` (with its environment variable)."""
    return Setting(field=field, value=value, source=source, env_var=ENV_VARS.get(field))


def zbal_local_mem_size(args: AttentionArgs, env: Mapping[str, str] = os.environ) -> tuple[int, Source]:
    """Bytes of NPU zbal lazy memory and where the value came from."""
    return explicit_or_env(args, "zbal_local_mem_size", env) or (0, "default")


# Every environment variable attn-setup reads by exact name (ATTN_SETUP_SECRET_<NAME> is a prefix, any name).
KNOWN_ENV_VARS = (*ENV_VARS.values(), PARTITION_ENV, CACHE_ENV, "ATTN_SETUP_RUN_ID", "ATTN_SETUP_SLOW_PHASE_S")
SECRET_PREFIX = "ATTN_SETUP_SECRET_"
LOOKALIKE_DISTANCE = 2  # edits (insert, delete, substitute, swap two neighbours) from a known name


def _edit_distance(a: str, b: str, cap: int) -> int:
    """Optimal-string-alignment distance of ``a`` and ``b`` (adjacent swaps cost 1), or ``cap + 1`` when above ``cap``."""
    if abs(len(a) - len(b)) > cap:
        return cap + 1
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return min(prev[-1], cap + 1)


def env_lookalikes(env: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """``(name, known)`` for each set variable that looks like one attn-setup reads (other case, or within
    :data:`LOOKALIKE_DISTANCE` edits), sorted; ``run`` warns ``env_var_lookalike``, nothing is refused."""
    out = []
    for name in env:
        if name in KNOWN_ENV_VARS or name.startswith(SECRET_PREFIX):
            continue
        up = name.upper()  # the length test in _edit_distance skips most names at once
        best = min(KNOWN_ENV_VARS, key=lambda k: _edit_distance(up, k, LOOKALIKE_DISTANCE))
        if _edit_distance(up, best, LOOKALIKE_DISTANCE) <= LOOKALIKE_DISTANCE:
            out.append((name, best))
    return sorted(out)
