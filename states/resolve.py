"""resolve: the backend pair, the rule that chose each half, and every candidate refused.

Precedence per half (recorded as the rule): ``draft_override`` (draft worker with
``speculative_draft_attention_backend`` set: it serves both halves, ``is_draft_override=True``, as
sglang) > ``phase_flag`` (``prefill_attention_backend`` / ``decode_attention_backend``) >
``global_flag`` (``attention_backend``) > ``auto``. An explicit choice is never replaced: it
passes the capability check or is refused with every reason and the backends that would work.
Auto-selection walks a per-device priority list and takes the first candidate with no reason
against it, recording the others with their reasons (vLLM's approach). Registry lookups read
only the resolved strings (the seed reviewer's ``attention_backend=None`` bug cannot recur).
Mode checks that need no backend (PD-mux with TBO, PD-mux on CPU or an arch outside the SM
partition table) also happen here, before anything is allocated.
"""

from __future__ import annotations

from typing import Mapping, Optional

from pipeline.backends import registry
from pipeline.contracts import (
    AttentionArgs, DeviceFacts, ModelSpec, Rejection, Resolution, ResolvedAttentionBackendStr, Rule, Skip,
)
from pipeline.errors import CapabilityMismatch, ConflictingOptions
from states.capability_check import reasons

# Arches whose SMs sglang's PD-multiplexing can partition into groups (green contexts need sm80+
# and a per-arch SM table; sglang's table covers Ampere, Ada, Hopper and Blackwell datacenter).
PDMUX_SM_PARTITION_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100")

# Auto-selection priority (backend-rules.md: sglang prefers fa3/flashinfer on NVIDIA, then triton;
# vLLM SM 8-9: FLASH_ATTN > FLASHINFER > TRITON). Capability records prune the list per request.
AUTO_PRIORITY: dict[str, list[str]] = {
    "cuda": ["flashinfer", "triton", "torch_native"],
}
DEFAULT_PRIORITY = ["torch_native"]


def check_modes(args: AttentionArgs, device: DeviceFacts, is_draft_worker: bool) -> None:
    """Refuse mode combinations that no backend can fix (raises ConflictingOptions/CapabilityMismatch)."""
    if args.enable_pdmux and args.enable_two_batch_overlap:
        raise ConflictingOptions(
            "PD-multiplexing and two-batch overlap cannot be combined (sglang silently lets PD-mux win)",
            state="resolve", flags=[("enable_pdmux", True), ("enable_two_batch_overlap", True)],
            remedy="drop one of --enable-pdmux / --enable-two-batch-overlap")
    if args.enable_pdmux and device.type == "cpu":
        raise CapabilityMismatch(
            "PD-multiplexing partitions GPU SMs into groups; a CPU device has none",
            state="resolve", flags=[("enable_pdmux", True), ("device", device.device_str)],
            allowed=list(PDMUX_SM_PARTITION_ARCHS), remedy="drop --enable-pdmux, or run on a supported GPU")
    if args.enable_pdmux and device.arch not in PDMUX_SM_PARTITION_ARCHS:
        raise CapabilityMismatch(
            f"PD-multiplexing has no SM partition table for {device.arch or device.type}",
            state="resolve", flags=[("enable_pdmux", True), ("device.arch", device.arch)],
            allowed=list(PDMUX_SM_PARTITION_ARCHS), remedy="drop --enable-pdmux on this GPU")


def _explicit(args: AttentionArgs, half: str, is_draft_worker: bool) -> Optional[tuple[Rule, str, str]]:
    """(rule, name, flag) of the explicit choice for ``half``, or None for auto."""
    if is_draft_worker and args.speculative_draft_attention_backend:
        return "draft_override", args.speculative_draft_attention_backend, "speculative_draft_attention_backend"
    phase_flag = f"{half}_attention_backend"
    if getattr(args, phase_flag):
        return "phase_flag", getattr(args, phase_flag), phase_flag
    if args.attention_backend:
        return "global_flag", args.attention_backend, "attention_backend"
    return None


def _candidates(device: DeviceFacts) -> list[str]:
    known = set(registry.names())
    return [n for n in AUTO_PRIORITY.get(device.type, DEFAULT_PRIORITY) if n in known]


def _pick(half: str, explicit: Optional[tuple[Rule, str, str]], *, args: AttentionArgs, model: ModelSpec,
          device: DeviceFacts, installed: Mapping[str, bool], is_draft_worker: bool) -> tuple[str, Rule, list[Rejection]]:
    def why(name: str) -> list[str]:
        return reasons(registry.get(name).capability, args=args, model=model, device=device,
                       installed=installed, is_draft_worker=is_draft_worker)

    working = [n for n in registry.names() if not why(n)]
    if explicit is not None:
        rule, name, flag = explicit
        entry = registry.get(name, flag=flag)
        bad = why(entry.name)
        if bad:
            remedy = (f"set {flag} to one of {working}" if working else "no registered backend can serve this; "
                      "change the model, dtype or flags named in the reasons")
            if rule != "draft_override" and is_draft_worker:
                remedy = f"the draft model cannot use the inherited {name!r}: set speculative_draft_attention_backend" + (
                    f" to one of {working}" if working else "")
            raise CapabilityMismatch(
                f"{flag}={name!r} cannot serve {half} here: " + "; ".join(bad),
                state="resolve", flags=[(flag, name), ("device", device.arch or device.type),
                                        ("model", model.source or model.model_type)],
                allowed=working, remedy=remedy)
        return name, rule, []
    rejected: list[Rejection] = []
    for name in _candidates(device):
        bad = why(name)
        if not bad:
            return name, "auto", rejected
        rejected.append(Rejection(backend=name, reasons=bad))
    raise CapabilityMismatch(
        f"auto-selection found no backend for {half} on {device.arch or device.type}: "
        + "; ".join(f"{r.backend}: {', '.join(r.reasons)}" for r in rejected),
        state="resolve", flags=[(f"{half}_attention_backend", None), ("device", device.arch or device.type)],
        allowed=working, remedy="install a backend's package, change the model/dtype, or use another device")


def decide(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
           installed: Mapping[str, bool]) -> Resolution:
    """Resolve the (prefill, decode) pair for the model this worker serves.

    ``model`` is the served model (the draft model on a draft worker); ``installed`` maps
    distribution names (``torch``, ``triton``, ``flashinfer-python``) to presence.
    Raises BackendUnknown / BackendUnavailable / CapabilityMismatch / ConflictingOptions.
    """
    check_modes(args, device, is_draft_worker)
    picks, rules, rejected = {}, {}, {}
    for half in ("prefill", "decode"):
        name, rule, rej = _pick(half, _explicit(args, half, is_draft_worker), args=args, model=model,
                                device=device, installed=installed, is_draft_worker=is_draft_worker)
        picks[half], rules[half] = name, rule
        if rej:
            rejected[half] = rej
    skips = []
    if not args.disable_cuda_graph:
        cap = registry.get(picks["decode"]).capability
        if device.type == "cpu":
            skips.append(Skip(what="cuda_graph", reason="CUDA graphs need a CUDA device; this run is on cpu"))
        elif not cap.has("cuda_graph"):
            skips.append(Skip(what="cuda_graph", reason=f"decode backend {picks['decode']!r} cannot be captured "
                              "in a CUDA graph (as sglang turns graphs off for torch_native)"))
    pair = ResolvedAttentionBackendStr(prefill=picks["prefill"], decode=picks["decode"],
                                       is_draft_override=rules["prefill"] == "draft_override")
    return Resolution(pair=pair, rules=rules, rejected=rejected, skips=skips)
