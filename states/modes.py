"""Mode combinations no backend can fix, refused in resolve before any backend is looked at.

PD-multiplexing with two-batch overlap (sglang silently lets PD-mux win), PD-mux on a CPU, more SM groups than the
device has SMs, and PD-mux on an arch outside sglang's SM-partition table. Each refusal carries its fixes as
alternatives (``err.fixes``, field assignments, and ``err.prose`` for one that is not a field), so that
:func:`states.resolve.decide` can extend each with what the rest of the request needs before writing the remedy.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.core.contracts import AttentionArgs, DeviceFacts
from pipeline.core.errors import CapabilityMismatch, ConfigError, ConflictingOptions
from states.fallback import assignments

# Arches whose SMs sglang's PD-multiplexing can partition into groups (green contexts need sm80+
# and a per-arch SM table; sglang's table covers Ampere, Ada, Hopper and Blackwell datacenter).
PDMUX_SM_PARTITION_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100")


def _refuse_mode(err: ConfigError, fixes: list[dict[str, Any]], prose: str = "") -> ConfigError:
    """``err`` with its remedy written from ``fixes`` (alternatives; kept on ``err.fixes`` so resolve can
    extend each with what the rest of the request needs) and an optional closing ``prose`` alternative."""
    err.fixes, err.prose = fixes, prose  # type: ignore[attr-defined]
    err.info = msgspec.structs.replace(err.info, remedy=" or ".join(
        [assignments(f) for f in fixes] + ([prose] if prose else [])))
    return err


def check_modes(args: AttentionArgs, device: DeviceFacts, is_draft_worker: bool) -> None:
    """Refuse mode combinations that no backend can fix (raises ConflictingOptions/CapabilityMismatch)."""
    if args.enable_pdmux and args.enable_two_batch_overlap:
        raise _refuse_mode(ConflictingOptions(
            "PD-multiplexing and two-batch overlap cannot be combined (sglang silently lets PD-mux win)",
            state="resolve", flags=[("enable_pdmux", True), ("enable_two_batch_overlap", True)]),
            [{"enable_pdmux": False}, {"enable_two_batch_overlap": False}])
    if args.enable_pdmux and device.type == "cpu":
        raise _refuse_mode(CapabilityMismatch(
            "PD-multiplexing partitions GPU SMs into groups; a CPU device has none",
            state="resolve", flags=[("enable_pdmux", True), ("device", device.device_str)],
            allowed=list(PDMUX_SM_PARTITION_ARCHS)), [{"enable_pdmux": False}],
            "run on a GPU whose arch is listed")
    if args.enable_pdmux and device.sm_count and args.sm_group_num > device.sm_count:
        raise _refuse_mode(CapabilityMismatch(
            f"sm_group_num={args.sm_group_num} SM groups cannot be carved from {device.sm_count} SMs",
            state="resolve", flags=[("sm_group_num", args.sm_group_num), ("device.sm_count", device.sm_count)],
            allowed=[f"1..{device.sm_count}"]), [{"sm_group_num": min(3, device.sm_count)}],
            f"another sm_group_num up to {device.sm_count} (sglang uses a handful of groups)")
    if args.enable_pdmux and device.arch not in PDMUX_SM_PARTITION_ARCHS:
        raise _refuse_mode(CapabilityMismatch(
            f"PD-multiplexing has no SM partition table for {device.arch or device.type}",
            state="resolve", flags=[("enable_pdmux", True), ("device.arch", device.arch or device.type)],
            allowed=list(PDMUX_SM_PARTITION_ARCHS)), [{"enable_pdmux": False}])
