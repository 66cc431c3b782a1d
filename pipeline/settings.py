"""Settings sglang also reads from the environment: explicit field > env var > default.

- ``zbal_local_mem_size`` ↔ ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` (bytes; default 0 = off).
- ``flashinfer_workspace_size`` ↔ ``SGLANG_FLASHINFER_WORKSPACE_SIZE`` (bytes; default 384 MiB as
  in sglang's FlashInfer backend, 512 MiB for the architectures sglang raises it for: see
  :data:`WORKSPACE_512_MIB_ARCHITECTURES`).

The resolved value and the source that won are logged as a ``setting_resolved`` event. A value
from the environment passes the same check as the field (:func:`pipeline.validation.check_size`),
so ``SGLANG_FLASHINFER_WORKSPACE_SIZE=0`` is refused like ``--flashinfer-workspace-size 0``;
:func:`check_env` runs both checks up front, before anything is allocated.
"""

from __future__ import annotations

import os
import re
from typing import Literal, Mapping, Optional

from pipeline.contracts import AttentionArgs, ModelSpec
from pipeline.errors import ConfigError
from pipeline.validation import check_size

MiB = 1 << 20
FLASHINFER_WORKSPACE_DEFAULT = 384 * MiB
FLASHINFER_WORKSPACE_QWEN = 512 * MiB
# sglang's FlashInferAttnBackend.__init__ (python/sglang/srt/layers/attention/flashinfer_backend.py,
# sgl-project/sglang at 0005834c, "Qwen2/Qwen3 models require higher flashinfer workspace size")
# raises the workspace to 512 MiB when hf_config.architectures contains one of these names, and
# keys on nothing else: not model_type, so Qwen2-MoE, Qwen3-MoE, Qwen2-VL and Qwen2.5-VL keep 384 MiB
# while MiMo gets 512 MiB. sglang assigns the value inside the backend, so there it also beats an
# env var; here explicit field > env var > this default, so an explicit value is never replaced.
WORKSPACE_512_MIB_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM",
                                   "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")

Source = Literal["field", "env", "default"]


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
    """Check every size env var sglang also reads (set or not), as its field is checked.

    Raises ConfigError (``invalid_value``) naming the variable, its value and the allowed range.
    """
    for field in ENV_VARS:
        _from_env(env, field)


def zbal_local_mem_size(args: AttentionArgs, env: Mapping[str, str] = os.environ) -> tuple[int, Source]:
    """Bytes of NPU zbal lazy memory and where the value came from."""
    if args.zbal_local_mem_size is not None:
        return args.zbal_local_mem_size, "field"
    v = _from_env(env, "zbal_local_mem_size")
    return (v, "env") if v is not None else (0, "default")


def flashinfer_workspace_size(args: AttentionArgs, model: ModelSpec,
                              env: Mapping[str, str] = os.environ) -> tuple[int, Source]:
    """Bytes of the FlashInfer workspace buffer and where the value came from.

    ``flashinfer_workspace_size`` when set, else ``SGLANG_FLASHINFER_WORKSPACE_SIZE``, else 512 MiB
    when ``model.architectures`` names one of :data:`WORKSPACE_512_MIB_ARCHITECTURES` (sglang's
    rule, matched on the architecture name exactly as sglang does) and 384 MiB otherwise.
    Raises ConfigError for an env value that is not a byte count.
    """
    if args.flashinfer_workspace_size is not None:
        return args.flashinfer_workspace_size, "field"
    v = _from_env(env, "flashinfer_workspace_size")
    if v is not None:
        return v, "env"
    big = any(a in WORKSPACE_512_MIB_ARCHITECTURES for a in model.architectures)
    return (FLASHINFER_WORKSPACE_QWEN if big else FLASHINFER_WORKSPACE_DEFAULT), "default"


# Every environment variable attn-setup reads by exact name (ATTN_SETUP_SECRET_<NAME> is a prefix, any name).
KNOWN_ENV_VARS = (*ENV_VARS.values(), "ATTN_SETUP_RUN_ID", "ATTN_SETUP_SLOW_PHASE_S")
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
    """``(name, known)`` for every set variable that is not one attn-setup reads but looks like one: the
    same letters in another case, or within :data:`LOOKALIKE_DISTANCE` edits of a known name (a typo such
    as ``SGLANG_FLASHINFER_WORKSPACE_SIZ``, which would otherwise be ignored without a word). Sorted by name.
    ``run`` logs each as an ``env_var_lookalike`` warning; nothing is refused (the variable may be another tool's).
    """
    out = []
    for name in env:
        if name in KNOWN_ENV_VARS or name.startswith(SECRET_PREFIX):
            continue
        up = name.upper()  # the length test in _edit_distance skips most names at once
        best = min(KNOWN_ENV_VARS, key=lambda k: _edit_distance(up, k, LOOKALIKE_DISTANCE))
        if _edit_distance(up, best, LOOKALIKE_DISTANCE) <= LOOKALIKE_DISTANCE:
            out.append((name, best))
    return sorted(out)
