"""resolve: the backend pair, the rule that chose each half, and every candidate refused.

Details: docs/internals.md, ``states.resolve``.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Union

import msgspec

from pipeline.backends import registry
from pipeline.core.contracts import (AttentionArgs, DeviceFacts, ModelSpec, Rejection, Resolution,
    ResolvedAttentionBackendStr, Rule)
from pipeline.core.dtypes import resolve_dtype
from pipeline.core.errors import BackendUnavailable, BackendUnknown, CapabilityMismatch, ConfigError, ConflictingOptions
from pipeline.core.model_spec import format_layer_ids
from pipeline.core.speculative import decide_speculative
from states.build_mode import graph_backend
from states import evidence
from states.capability_check import Reason
from states.fallback import assignments, graph_skips, refuse_strict
from states.remedies import complete_fix, minimal, Remedies, suggest, Survey


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
    check_tbo(args)


def check_tbo(args: AttentionArgs) -> None:
    """Refuse two-batch overlap without attention data parallelism or an expert-parallel all-to-all, as sglang 0.5.23
    does (``arg_groups/validation_hook.py``, ``check_two_batch_overlap``): TBO overlaps one micro-batch's compute with
    the other's DP all-gather / EP all-to-all, so without either there is nothing to overlap. A server-wide rule: a
    draft worker's args are the server's, so it holds there too. Raises ConflictingOptions naming the three fields."""
    if args.enable_two_batch_overlap and args.moe_a2a_backend == "none" and args.attn_dp_size <= 1:
        raise _refuse_mode(ConflictingOptions(
            "two-batch overlap needs attention data parallelism (attn_dp_size > 1) or an expert-parallel all-to-all "
            "(moe_a2a_backend): without either there is no communication for TBO to overlap (sglang refuses it)",
            state="resolve", flags=[("enable_two_batch_overlap", True), ("attn_dp_size", args.attn_dp_size),
                                    ("moe_a2a_backend", args.moe_a2a_backend)]),
            [{"enable_two_batch_overlap": False}, {"moe_a2a_backend": "deepep"}],
            "attn_dp_size > 1 with world_size a multiple of it")


Explicit = tuple[Rule, str, str]  # (rule, backend name, flag that named it)


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


def auto_candidates(device: DeviceFacts, model: Optional[ModelSpec] = None) -> list[str]:
    """The registered backends auto-selection considers on ``device`` (for ``model``), in priority order (the
    registry's :func:`~pipeline.backends.registry.auto_candidates`: sglang's and vLLM's orders, pruned per request
    by the capability records; for an MLA model on an arch with measured MLA decode times, those backends first,
    fastest first)."""
    return registry.auto_candidates(device.type, arch=device.arch or "", mla=model is not None and model.is_mla)


def _flags_of(head: list[tuple[str, object]], bad: list[Reason], device: DeviceFacts) -> list[tuple[str, object]]:
    out = list(head)
    for r in bad:
        out += [f for f in r.flags if f not in out]
    dev = ("device", device.arch or device.type)
    return out + ([dev] if dev not in out and ("device.arch", device.arch) not in out else [])


def _lookup(name: str, flag: str, ctx: Remedies) -> registry.BackendEntry:
    """registry.get, with allowed values and remedy narrowed to the backends that resolve here."""
    try:
        return registry.get(name, flag=flag)
    except (BackendUnavailable, BackendUnknown) as e:
        survey = ctx.survey
        msg, first = e.info.message, None
        if isinstance(e, BackendUnknown):
            first, note = suggest(name, ctx)
            msg = f"{msg}; {note}" if note else msg
        allowed, remedy = ctx.set_remedy(flag, survey.working, first)
        if isinstance(e, BackendUnknown) and first in survey.installable and first not in survey.working:
            pk = survey.packages_of(first)
            remedy = f"install {survey.install_words(pk)} and {assignments(ctx.complete({flag: first}, pk))}" + (
                f", or {remedy}" if allowed else "")
        e.args = (msg,)
        e.info = msgspec.structs.replace(e.info, state="resolve", message=msg, allowed=allowed, remedy=remedy)
        e.fixes = [{flag: n} for n in survey.working] + survey.field_fixes()  # type: ignore[attr-defined]
        raise


def _refuse_explicit(half: str, rule: Rule, name: str, flag: str, bad: list[Reason],
                     ctx: Remedies) -> CapabilityMismatch:
    survey, model, device = ctx.survey, ctx.model, ctx.device
    target = flag
    if rule != "draft_override" and ctx.is_draft_worker:
        target = "speculative_draft_attention_backend"
    allowed, remedy = ctx.set_remedy(target, survey.working)
    own = {k: v for r in bad for k, v in r.fix} if all(r.fix for r in bad) else {}
    if own and survey.working and not ctx.probe:  # keep the user's backend: the field changes it needs, first
        own, ok = complete_fix(_probe, ctx.args, model, device, ctx.installed, ctx.is_draft_worker, own)
        remedy = f"{assignments(own)}, or {remedy}" if ok else remedy
    code = "package_version_unsupported" if survey.versions_only(bad) else None
    if code and allowed:  # installing the supported versions serves the user's choice: first
        remedy = f"{survey.pip_command(bad)} (then {flag}={name!r} serves it), or {remedy}"
    if target != flag:
        remedy = f"the draft model cannot use the inherited {name!r}: {remedy}"
    msg = f"{flag}={name!r} cannot serve {half} here: " + "; ".join(r.text for r in bad)
    if not survey.working and survey.installable:
        msg += f" ({survey.missing_note()})"
    flags = _flags_of([(flag, name)], bad, device) + [("model", model.source or model.model_type)]
    if target != flag:  # the field the allowed values and the remedy are for
        flags.append((target, None))
    err = CapabilityMismatch(msg, code=code, state="resolve", flags=list(dict.fromkeys(flags)), allowed=allowed,
                             remedy=remedy)
    err.fixes = [{target: n} for n in survey.working] + ([own] if own else []) \
        + survey.field_fixes()  # type: ignore[attr-defined]
    return err


def _pick(half: str, explicit: Optional[Explicit], ctx: Remedies,
          order: list[str]) -> tuple[str, Rule, list[Rejection]]:
    survey, device = ctx.survey, ctx.device
    if explicit is not None:
        rule, name, flag = explicit
        entry = _lookup(name, flag, ctx)
        bad = survey.why[entry.name]
        if bad:
            raise _refuse_explicit(half, rule, name, flag, bad, ctx)
        return name, rule, []
    rejected: list[Rejection] = []
    for name in order:
        bad = survey.why[name]
        if not bad:
            return name, "auto", rejected
        rejected.append(Rejection(backend=name, reasons=[r.text for r in bad]))
    detail = "; ".join(f"{r.backend}: {', '.join(r.reasons)}" for r in rejected)
    msg = f"auto-selection found no backend for {half} on {device.arch or device.type}: {detail}"
    if survey.installable:
        msg = f"auto-selection found no backend for {half} on {device.arch or device.type}: " \
              f"{survey.missing_note()}. Reasons: {detail}"
    bad_all = [r for n in auto_candidates(device, ctx.model) for r in survey.why[n]]
    flags = _flags_of([(f"{half}_attention_backend", None)], [r for r in bad_all if not r.is_package], device)
    err = CapabilityMismatch(msg, state="resolve", flags=list(dict.fromkeys(flags)), allowed=survey.working,
                             remedy=ctx.without_working())
    err.fixes = survey.field_fixes()  # type: ignore[attr-defined]  # for a remedy trial to extend (complete_fix)
    raise err


def decide(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
           installed: Mapping[str, bool], target: Optional[ModelSpec] = None) -> Resolution:
    """Resolve the (prefill, decode) pair for the model this worker serves.

    Parameters
    ----------
    args : the attention flags (sglang's names, plus ``strict``).
    model : the served model (the draft model on a draft worker).
    device : the device facts (a named profile at plan time, torch's at run time).
    is_draft_worker : a speculative-decoding draft worker.
    installed : distribution name (``torch``, ``triton``, ``flashinfer-python``) → presence
        (:data:`pipeline.backends.packages.Presence`: False, True, or the installed version, which must be in the
        supported range).
    target : the target model, whose architecture settles the speculative shape
        (:func:`pipeline.core.speculative.decide_speculative`) on a draft worker too; None: ``model``.

    Returns a :class:`Resolution` (never None): the pair, the rule per half, every auto candidate
    refused (per half, with reasons), the CUDA-graph skip if any (:func:`warnings_for` turns it into the
    start's warnings), the compute dtype with its rule, the layers that are not attention
    (``not_attention``) and the speculative shape (``speculative``): every backend is checked against the settled
    top-k, never the unset flag (sglang#36554 chose the draft worker's backend before top-k was filled in).
    Raises BackendUnknown / BackendUnavailable / CapabilityMismatch (``package_version_unsupported``: an explicit
    choice refused only for packages, one at an unsupported version) / ConflictingOptions / ConfigError
    (``dtype_refused``; ``no_attention_layers``: only linear-attention / mamba layers) — exit 3; with
    ``args.strict``, :class:`StrictRefusal` (``reference_fallback`` / ``downgrade_refused``).
    """
    return _decide(args, model, device, is_draft_worker=is_draft_worker, installed=installed, probe=False,
                   target=target)


def _decide(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
            installed: Mapping[str, bool], probe: bool, target: Optional[ModelSpec] = None) -> Resolution:
    """:func:`decide`; ``probe`` (remedy trials) skips trying remedies of its own."""
    trial = functools.partial(_probe, target=target)
    try:
        check_modes(args, device, is_draft_worker)
        spec = decide_speculative(args, target if target is not None else model)
    except ConfigError as e:
        fixes = getattr(e, "fixes", [])
        if fixes and not probe:  # each alternative with what the rest needs; those that resolve first
            tried = [complete_fix(trial, args, model, device, installed, is_draft_worker, dict(f)) for f in fixes]
            done = [f for f, ok in tried if ok]
            if not done and len(fixes) > 1:  # e.g. PD-mux + TBO on a CPU: only dropping both resolves
                union, ok = complete_fix(trial, args, model, device, installed, is_draft_worker,
                                         {k: v for f in fixes for k, v in f.items()})
                done = [union] if ok else []
            done = minimal(done) or [f for f, _ in tried]
            prose = [e.prose] if getattr(e, "prose", "") else []
            e.info = msgspec.structs.replace(e.info, remedy=" or ".join([assignments(f) for f in done] + prose))
        raise
    dtype = resolve_dtype(args, model)
    check_has_attention(model)
    survey = Survey(args=args, model=model, device=device, installed=installed, is_draft_worker=is_draft_worker,
                    spec=spec)
    ctx = Remedies(trial, args, model, device, installed, is_draft_worker, survey, probe)
    picks, rules, rejected, why = {}, {}, {}, {}
    for half in ("prefill", "decode"):
        explicit = explicit_choice(args, half, is_draft_worker)
        order, why[half] = evidence.order(half, auto_candidates(device, model), lambda n: not survey.why[n],
                                          model=model, device=device, kv=evidence.kv_dtype(args.kv_cache_dtype,
                                          dtype.value), installed=installed, explicit=explicit is not None,
                                          speculative=spec is not None)
        name, rule, rej = _pick(half, explicit, ctx, order)
        picks[half], rules[half] = name, rule
        if rej:
            rejected[half] = rej
    pair = ResolvedAttentionBackendStr(prefill=picks["prefill"], decode=picks["decode"],
                                       is_draft_override=rules["prefill"] == "draft_override")
    captured = graph_backend(pair, spec, is_draft_worker)  # target verify is captured on the prefill half
    res = Resolution(pair=pair, rules=rules, rejected=rejected, skips=graph_skips(args, captured, device),
                     dtype=dtype, not_attention=model.not_attention(), speculative=spec, evidence=why)
    refuse_strict(res, args, device, is_draft_worker)
    return res


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


def _probe(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
           installed: Mapping[str, bool], target: Optional[ModelSpec] = None) -> Resolution:
    """:func:`decide` as a remedy trial: refusals come without remedies of their own (no recursion)."""
    return _decide(args, model, device, is_draft_worker=is_draft_worker, installed=installed, probe=True,
                   target=target)


def decide_for_run(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
                   metadata: Mapping[str, bool], imported: Mapping[str, bool],
                   import_errors: Optional[Mapping[str, str]] = None,
                   target: Optional[ModelSpec] = None) -> Resolution:
    """:func:`decide` for a run: package presence by real import, checked against the metadata.

    ``metadata`` is presence by distribution metadata (what ``attn-setup plan`` sees: the version or False);
    ``imported`` presence by a real import (the same metadata version, True without one, False);
    ``import_errors`` the import error text per package. Both check versions alike, so only presence can differ.
    When the two disagree on a package *and* that changes the outcome (another pair, or a refusal
    on one side only), raises :class:`BackendUnavailable` (``package_presence_mismatch``) naming the
    package, both answers and the import error — so a run never silently resolves differently
    from ``plan``. A disagreement that changes nothing is ignored. Otherwise returns the
    import-based resolution, or raises its error.
    """
    diff = sorted(p for p in set(metadata) | set(imported) if bool(metadata.get(p)) != bool(imported.get(p)))
    kw = dict(is_draft_worker=is_draft_worker, target=target)
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

