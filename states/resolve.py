"""resolve: the backend pair, the rule that chose each half, and every candidate refused.

Precedence per half (recorded as the rule): ``draft_override`` (draft worker with
``speculative_draft_attention_backend`` set: it serves both halves, ``is_draft_override=True``, as
sglang) > ``phase_flag`` (``prefill_attention_backend`` / ``decode_attention_backend``) >
``global_flag`` (``attention_backend``) > ``auto``. An explicit choice is never replaced: it
passes the capability check or is refused with every reason, the flags involved and the backends
that would work. Auto-selection walks a per-device priority list and takes the first candidate
with no reason against it, recording the others with their reasons (vLLM's approach). Registry
lookups read only the resolved strings (the seed reviewer's ``attention_backend=None`` bug cannot
recur). Mode checks that need no backend (PD-mux with TBO, PD-mux on CPU or on an arch outside the
SM-partition table) also happen here, before anything is allocated.

When no *installed* backend can serve a request but one would if its package were installed, the
error says exactly that (and names the package), instead of advising a backend that is missing.

The resolution also carries the compute dtype and the rule that chose it
(:func:`pipeline.dtypes.resolve_dtype`; an explicit float16 the model type refuses is refused here)
and the model's layers that are not attention (linear attention, mamba): those need no backend, so
only the attention layer kinds are checked; a model with no attention layer at all is refused.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import msgspec

from pipeline.backends import registry
from pipeline.contracts import (
    AttentionArgs, DeviceFacts, ModelSpec, Rejection, Resolution, ResolvedAttentionBackendStr, Rule, Skip,
)
from pipeline.dtypes import resolve_dtype
from pipeline.errors import BackendUnavailable, BackendUnknown, CapabilityMismatch, ConfigError, ConflictingOptions
from pipeline.model_spec import format_layer_ids
from states.capability_check import Reason, reasons_with_flags

# Arches whose SMs sglang's PD-multiplexing can partition into groups (green contexts need sm80+
# and a per-arch SM table; sglang's table covers Ampere, Ada, Hopper and Blackwell datacenter).
PDMUX_SM_PARTITION_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100")

# Auto-selection priority (backend-rules.md: sglang prefers fa3/flashinfer on NVIDIA, then triton;
# vLLM SM 8-9: FLASH_ATTN > FLASHINFER > TRITON). The capability records prune the list per request:
# on sm80-sm90 flashinfer when installed, else triton; fa3 (sm90 only) is considered after
# flashinfer so an arch it lacks is recorded as its reason; sm100+/ROCm fall to what the records allow.
AUTO_PRIORITY: dict[str, list[str]] = {
    "cuda": ["flashinfer", "fa3", "triton", "torch_native"],
}
DEFAULT_PRIORITY = ["torch_native"]

Explicit = tuple[Rule, str, str]  # (rule, backend name, flag that named it)


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
    if args.enable_pdmux and device.sm_count and args.sm_group_num > device.sm_count:
        raise CapabilityMismatch(
            f"sm_group_num={args.sm_group_num} SM groups cannot be carved from {device.sm_count} SMs",
            state="resolve", flags=[("sm_group_num", args.sm_group_num), ("device.sm_count", device.sm_count)],
            allowed=[f"1..{device.sm_count}"], remedy="lower --sm-group-num (sglang uses a handful of groups)")
    if args.enable_pdmux and device.arch not in PDMUX_SM_PARTITION_ARCHS:
        raise CapabilityMismatch(
            f"PD-multiplexing has no SM partition table for {device.arch or device.type}",
            state="resolve", flags=[("enable_pdmux", True), ("device.arch", device.arch or device.type)],
            allowed=list(PDMUX_SM_PARTITION_ARCHS), remedy="drop --enable-pdmux on this GPU")


def explicit_choice(args: AttentionArgs, half: str, is_draft_worker: bool) -> Optional[Explicit]:
    """(rule, name, flag) of the explicit choice for ``half`` (``prefill``/``decode``), or None for auto."""
    if is_draft_worker and args.speculative_draft_attention_backend:
        return "draft_override", args.speculative_draft_attention_backend, "speculative_draft_attention_backend"
    phase_flag = f"{half}_attention_backend"
    if getattr(args, phase_flag):
        return "phase_flag", getattr(args, phase_flag), phase_flag
    if args.attention_backend:
        return "global_flag", args.attention_backend, "attention_backend"
    return None


def auto_candidates(device: DeviceFacts) -> list[str]:
    """The registered backends auto-selection considers on ``device``, in priority order."""
    known = set(registry.names())
    return [n for n in AUTO_PRIORITY.get(device.type, DEFAULT_PRIORITY) if n in known]


class _Survey:
    """Every registered backend's reasons for one request: who works, who would if installed."""

    def __init__(self, **ctx) -> None:
        self.why: dict[str, list[Reason]] = {
            n: reasons_with_flags(registry.get(n).capability, **ctx) for n in registry.names()}
        self.working = [n for n, r in self.why.items() if not r]
        self.installable = [n for n, r in self.why.items() if r and all(x.is_package for x in r)]

    def missing_note(self) -> str:
        """One sentence naming the backends that would work if their package were installed."""
        pk = sorted({x.flags[0][1] for n in self.installable for x in self.why[n]})
        return (f"no installed backend can serve this; only {', '.join(self.installable)} could, and it needs "
                f"package(s) {', '.join(pk)}, which {'is' if len(pk) == 1 else 'are'} not installed")

    def remedy_without_working(self) -> str:
        if self.installable:
            pk = sorted({x.flags[0][1] for n in self.installable for x in self.why[n]})
            return f"install {', '.join(pk)} (see the reasons), or change the model/dtype/flags"
        return "no registered backend can serve this; change the model, dtype or flags named in the reasons"


def _flags_of(head: list[tuple[str, object]], bad: list[Reason], device: DeviceFacts) -> list[tuple[str, object]]:
    out = list(head)
    for r in bad:
        out += [f for f in r.flags if f not in out]
    dev = ("device", device.arch or device.type)
    return out + ([dev] if dev not in out and ("device.arch", device.arch) not in out else [])


def _lookup(name: str, flag: str, survey: _Survey) -> registry.BackendEntry:
    """registry.get, with the backends that work here (not every registered one) as allowed values."""
    try:
        return registry.get(name, flag=flag)
    except (BackendUnavailable, BackendUnknown) as e:
        working = survey.working or e.info.allowed
        remedy = e.info.remedy if isinstance(e, BackendUnavailable) else f"set {flag} to one of: {', '.join(working)}"
        e.info = msgspec.structs.replace(e.info, state="resolve", allowed=working, remedy=remedy)
        raise


def _refuse_explicit(half: str, rule: Rule, name: str, flag: str, bad: list[Reason], survey: _Survey,
                     model: ModelSpec, device: DeviceFacts, is_draft_worker: bool) -> CapabilityMismatch:
    working = survey.working
    remedy = (f"set --{flag.replace('_', '-')} to one of {working}" if working else survey.remedy_without_working())
    if rule != "draft_override" and is_draft_worker:
        remedy = (f"the draft model cannot use the inherited {name!r}: set --speculative-draft-attention-backend"
                  + (f" to one of {working}" if working else " once a backend can serve it"))
    msg = f"{flag}={name!r} cannot serve {half} here: " + "; ".join(r.text for r in bad)
    if not working and survey.installable:
        msg += f" ({survey.missing_note()})"
    flags = _flags_of([(flag, name)], bad, device) + [("model", model.source or model.model_type)]
    return CapabilityMismatch(msg, state="resolve", flags=list(dict.fromkeys(flags)), allowed=working, remedy=remedy)


def _pick(half: str, explicit: Optional[Explicit], survey: _Survey, *, model: ModelSpec, device: DeviceFacts,
          is_draft_worker: bool) -> tuple[str, Rule, list[Rejection]]:
    if explicit is not None:
        rule, name, flag = explicit
        entry = _lookup(name, flag, survey)
        bad = survey.why[entry.name]
        if bad:
            raise _refuse_explicit(half, rule, name, flag, bad, survey, model, device, is_draft_worker)
        return name, rule, []
    rejected: list[Rejection] = []
    for name in auto_candidates(device):
        bad = survey.why[name]
        if not bad:
            return name, "auto", rejected
        rejected.append(Rejection(backend=name, reasons=[r.text for r in bad]))
    detail = "; ".join(f"{r.backend}: {', '.join(r.reasons)}" for r in rejected)
    msg = f"auto-selection found no backend for {half} on {device.arch or device.type}: {detail}"
    if survey.installable:
        msg = f"auto-selection found no backend for {half} on {device.arch or device.type}: " \
              f"{survey.missing_note()}. Reasons: {detail}"
    bad_all = [r for n in auto_candidates(device) for r in survey.why[n]]
    flags = _flags_of([(f"{half}_attention_backend", None)], [r for r in bad_all if not r.is_package], device)
    raise CapabilityMismatch(msg, state="resolve", flags=list(dict.fromkeys(flags)), allowed=survey.working,
                             remedy=survey.remedy_without_working())


def _graph_skips(args: AttentionArgs, decode: str, device: DeviceFacts) -> list[Skip]:
    """The allowed CUDA-graph downgrade: no CUDA device, or a decode backend that cannot be captured."""
    if args.disable_cuda_graph:
        return []
    if device.type != "cuda":
        return [Skip(what="cuda_graph", reason=f"CUDA graphs need a CUDA device; this run is on {device.type}")]
    if not registry.get(decode).capability.has("cuda_graph"):
        return [Skip(what="cuda_graph", reason=f"decode backend {decode!r} cannot be captured in a CUDA graph "
                     "(as sglang turns graphs off for torch_native)")]
    return []


def decide(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
           installed: Mapping[str, bool]) -> Resolution:
    """Resolve the (prefill, decode) pair for the model this worker serves.

    Parameters
    ----------
    args : the attention flags (sglang's names).
    model : the served model (the draft model on a draft worker).
    device : the device facts (a named profile at plan time, torch's at run time).
    is_draft_worker : a speculative-decoding draft worker.
    installed : distribution name (``torch``, ``triton``, ``flashinfer-python``) → present.

    Returns a :class:`Resolution` (never None): the pair, the rule per half, every auto candidate
    refused (per half, with reasons), the CUDA-graph downgrade if any, the compute dtype with its
    rule, and the layers that are not attention (``not_attention``).
    Raises BackendUnknown / BackendUnavailable / CapabilityMismatch / ConflictingOptions / ConfigError
    (``dtype_refused``; ``no_attention_layers`` for a model made only of linear-attention / mamba
    layers) — exit 3.
    """
    check_modes(args, device, is_draft_worker)
    dtype = resolve_dtype(args, model)
    check_has_attention(model)
    survey = _Survey(args=args, model=model, device=device, installed=installed, is_draft_worker=is_draft_worker)
    picks, rules, rejected = {}, {}, {}
    for half in ("prefill", "decode"):
        name, rule, rej = _pick(half, explicit_choice(args, half, is_draft_worker), survey, model=model,
                                device=device, is_draft_worker=is_draft_worker)
        picks[half], rules[half] = name, rule
        if rej:
            rejected[half] = rej
    pair = ResolvedAttentionBackendStr(prefill=picks["prefill"], decode=picks["decode"],
                                       is_draft_override=rules["prefill"] == "draft_override")
    return Resolution(pair=pair, rules=rules, rejected=rejected, skips=_graph_skips(args, picks["decode"], device),
                      dtype=dtype, not_attention=model.not_attention())


def check_has_attention(model: ModelSpec) -> None:
    """Refuse a model none of whose layers is attention (nothing for an attention backend to serve).

    Raises CapabilityMismatch (``no_attention_layers``) naming each layer type and its ids.
    """
    if model.layer_kinds():
        return
    groups = model.not_attention()
    what = "; ".join(f"{g.kind} layers {format_layer_ids(g.layer_ids)}" for g in groups)
    raise CapabilityMismatch(
        f"model {model.source or model.model_type!r} has no attention layer ({what}): no attention backend has "
        "anything to serve", code="no_attention_layers", state="resolve",
        flags=[("model", model.source or model.model_type)] + [(f"{g.kind}.layer_ids", g.layer_ids) for g in groups],
        remedy="serve this model with an engine's linear-attention / state-space kernels; attn-setup initializes "
               "attention backends only")


def decide_for_run(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
                   metadata: Mapping[str, bool], imported: Mapping[str, bool],
                   import_errors: Optional[Mapping[str, str]] = None) -> Resolution:
    """:func:`decide` for a run: package presence by real import, checked against the metadata.

    ``metadata`` is presence by distribution metadata (what ``attn-setup plan`` sees);
    ``imported`` presence by a real import; ``import_errors`` the import error text per package.
    When the two disagree on a package *and* that changes the outcome (another pair, or a refusal
    on one side only), raises :class:`BackendUnavailable` (``package_presence_mismatch``) naming the
    package, both answers and the import error — so a run never silently resolves differently
    from ``plan``. A disagreement that changes nothing is ignored. Otherwise returns the
    import-based resolution, or raises its error.
    """
    diff = sorted(p for p in set(metadata) | set(imported) if bool(metadata.get(p)) != bool(imported.get(p)))
    kw = dict(is_draft_worker=is_draft_worker)
    by_import: Union[Resolution, ConfigError]
    try:
        by_import = decide(args, model, device, installed=imported, **kw)
    except ConfigError as e:
        by_import = e
    if not diff:
        if isinstance(by_import, ConfigError):
            raise by_import
        return by_import
    try:
        by_meta: Union[Resolution, ConfigError] = decide(args, model, device, installed=metadata, **kw)
    except ConfigError as e:
        by_meta = e
    same = (isinstance(by_import, Resolution) and isinstance(by_meta, Resolution) and by_import.pair == by_meta.pair) \
        or (isinstance(by_import, ConfigError) and isinstance(by_meta, ConfigError))
    if same:
        if isinstance(by_import, ConfigError):
            raise by_import
        return by_import
    errs = import_errors or {}
    detail = "; ".join(f"{p}: metadata says {'installed' if metadata.get(p) else 'absent'}, import "
                       f"{'works' if imported.get(p) else 'fails' + (' (' + errs[p] + ')' if p in errs else '')}"
                       for p in diff)
    raise BackendUnavailable(
        f"package presence by metadata and by import disagree, and the resolution depends on it: {detail}",
        code="package_presence_mismatch", state="resolve", flags=[("package", p) for p in diff],
        remedy=f"reinstall or uninstall {', '.join(diff)} (pip install --force-reinstall …) so that "
               "'attn-setup plan' and 'attn-setup run' see the same packages")
