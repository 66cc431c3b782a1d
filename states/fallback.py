"""Warnings and strict mode: the reference fallback, downgrades, and their refusal under ``strict`` (docs/internals.md).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from pipeline.backends import registry
from pipeline.core.contracts import AttentionArgs, DeviceFacts, Resolution, SetupWarning, Skip
from pipeline.core.errors import CapabilityMismatch
from states.build_mode import decide_mode, decide_graphs


def one_of(names: Sequence[str]) -> str:
    """``a, b, c`` (never a Python list repr)."""
    return ", ".join(str(n) for n in names)


def assignments(fix: Mapping[str, Any]) -> str:
    """Library wording of field changes: ``set a='x' and b=True, and drop c`` (``c=False``/``None`` is "drop c"); the
    CLI rewrites each into its flag."""
    sets = [f"{k}={v!r}" for k, v in fix.items() if v is not False and v is not None]
    drops = [k for k, v in fix.items() if v is False or v is None]
    out = ("set " + " and ".join(sets)) if sets else ""
    if drops:
        out += (", and " if out else "") + "drop " + " and ".join(drops)
    return out


class StrictRefusal(CapabilityMismatch):
    """A fallback or downgrade refused under ``strict`` (``reference_fallback`` / ``downgrade_refused``); ``avoid``: the
    field assignments that accept or avoid every one."""

    def __init__(self, message: str, *, avoid: Mapping[str, Any], **kw: Any) -> None:
        super().__init__(message, **kw)
        self.avoid = dict(avoid)


def graph_skips(args: AttentionArgs, decode: str, device: DeviceFacts) -> list[Skip]:
    """CUDA graphs not captured (:func:`states.build_mode.decide_graphs`): none when captured or turned off; off CUDA
    they do not apply (``downgrade=False``); an uncapturable decode backend is a downgrade
    (``disable_cuda_graph=True``)."""
    d = decide_graphs(args, device.type, [decode])
    if d.capture or args.disable_cuda_graph:
        return []
    return [Skip(what="cuda_graph", reason=d.reason, downgrade=d.downgrade,
                 avoid={"disable_cuda_graph": True} if d.downgrade else {})]


def _device_name(device: DeviceFacts) -> str:
    return f"{device.type} {device.arch}" if device.arch else device.type


def reference_fallback(res: Resolution, device: DeviceFacts) -> Optional[SetupWarning]:
    """The ``reference_fallback`` warning when ``auto`` put the reference backend on a device other than ``cpu``;
    ``avoid`` accepts it explicitly (``attention_backend`` or the one fallen-back half's field)."""
    if device.type == "cpu":
        return None
    reference = registry.reference_name()
    halves = [h for h in ("prefill", "decode")
              if res.rules.get(h) == "auto" and getattr(res.pair, h) == reference]
    if not halves:
        return None
    field = "attention_backend" if len(halves) == 2 else f"{halves[0]}_attention_backend"
    rejected = {h: list(res.rejected.get(h, [])) for h in halves}
    names = list(dict.fromkeys(r.backend for h in halves for r in rejected[h]))
    why = f"{one_of(names)} cannot serve this request" if names else "no other backend is registered for it"
    return SetupWarning(code="reference_fallback", what="+".join(halves),
                        message=f"{' and '.join(halves)} fell back to {reference}, the slow reference backend, "
                                f"on {_device_name(device)}: {why}",
                        avoid={field: reference}, rejected=rejected)


def warnings_for(res: Resolution, skips: Sequence[Skip], device: DeviceFacts) -> list[SetupWarning]:
    """Every warning of a start: the reference fallback, then each downgrade in ``skips`` (``res.skips + plan.skips``).
    """
    fb = reference_fallback(res, device)
    return ([fb] if fb else []) + [SetupWarning(code="feature_downgraded", what=s.what, message=s.reason,
                                                avoid=dict(s.avoid)) for s in skips if s.downgrade]


def refuse_strict(res: Resolution, args: AttentionArgs, device: DeviceFacts, is_draft_worker: bool) -> None:
    """Under ``strict``: raise :class:`StrictRefusal` (state resolve) for a reference fallback or any downgrade (TBO on
    a draft worker included, :func:`decide_mode`), naming every field needed."""
    if not args.strict:
        return
    found = warnings_for(res, list(res.skips) + decide_mode(args, is_draft_worker)[1], device)
    if not found:
        return
    avoid = {k: v for w in found for k, v in w.avoid.items()}
    fb = next((w for w in found if w.code == "reference_fallback"), None)
    downs = [w for w in found if w.code == "feature_downgraded"]
    parts = []
    if fb is not None:
        rejected = {r.backend: r.reasons for h in fb.rejected for r in fb.rejected[h]}  # one survey: halves agree
        detail = "; ".join(f"{b}: {' and '.join(rs)}" for b, rs in rejected.items())
        parts.append(fb.message + (f" ({detail})" if detail else ""))
        why = "to accept the reference backend explicitly"
    else:
        why = "to avoid the downgrade" + ("s" if len(downs) > 1 else "")
    parts += [f"{w.what} downgraded: {w.message}" for w in downs]
    msg = "strict: " + "; ".join(parts)
    flags = [("strict", True)] + [(k, getattr(args, k)) for k in avoid] + [("device", _device_name(device))]
    raise StrictRefusal(msg, code="reference_fallback" if fb is not None else "downgrade_refused", state="resolve",
                        flags=flags, avoid=avoid, remedy=f"{assignments(avoid)} {why}, or drop strict")
