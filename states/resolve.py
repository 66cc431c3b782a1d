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

Remedies are true for the request at hand: ``allowed`` and every backend a remedy names are ones
that resolve for this device, model and flags (with ``strict``, the extra fields a backend needs
to pass strict are named with it); an unknown name gets the closest known one ("did you mean"),
registered or sglang's, installed or not, with the package it needs. Library wording: field names
(``attention_backend``), assignments as ``field='value'``; the CLI shows its flags instead.

Warnings (:func:`warnings_for`): auto-selection landing on ``torch_native`` — the reference
backend — on an accelerator (``reference_fallback``, with every rejected candidate's reasons), and
every downgrade (:class:`~pipeline.contracts.Skip` with ``downgrade=True``: CUDA graphs off on a
CUDA device, TBO dropped on a draft worker). With ``args.strict`` each of them is a refusal in
resolve instead (``reference_fallback`` / ``downgrade_refused``, exit 3), naming the fields that
accept or avoid it; applying them resolves under strict.
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Optional, Sequence, Union

import msgspec

from pipeline.backends import registry
from pipeline.contracts import (
    AttentionArgs, DeviceFacts, ModelSpec, Rejection, Resolution, ResolvedAttentionBackendStr, Rule, SetupWarning,
    Skip,
)
from pipeline.cuda_graphs import decide_graphs
from pipeline.errors import BackendUnavailable, BackendUnknown, CapabilityMismatch, ConfigError, ConflictingOptions
from states.build_mode import decide_mode
from states.capability_check import INSTALL_HINT, Reason, reasons_with_flags

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
# The reference backend: correct everywhere, slow, no CUDA graphs. Landing on it by auto-selection on
# an accelerator is a warning (refused under strict); choosing it explicitly is not.
REFERENCE_BACKEND = "torch_native"

Explicit = tuple[Rule, str, str]  # (rule, backend name, flag that named it)


def one_of(names: Sequence[str]) -> str:
    """``a, b, c`` (never a Python list repr)."""
    return ", ".join(str(n) for n in names)


def assignments(fix: Mapping[str, Any]) -> str:
    """Library wording of field changes: ``set a='x' and b=True, and drop c`` (``c=False`` is "drop c").

    The CLI rewrites each ``field=value`` / ``drop field`` into its flag (``--a x``, ``--b``, ``drop --c``).
    """
    sets = [f"{k}={v!r}" for k, v in fix.items() if v is not False]
    drops = [k for k, v in fix.items() if v is False]
    out = ("set " + " and ".join(sets)) if sets else ""
    if drops:
        out += (", and " if out else "") + "drop " + " and ".join(drops)
    return out


class StrictRefusal(CapabilityMismatch):
    """A fallback or downgrade refused because ``strict`` is set (``reference_fallback`` / ``downgrade_refused``).

    ``avoid`` holds the field assignments that accept or avoid every refused fallback and downgrade.
    """

    def __init__(self, message: str, *, avoid: Mapping[str, Any], **kw: Any) -> None:
        super().__init__(message, **kw)
        self.avoid = dict(avoid)


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

    def packages_of(self, name: str) -> list[str]:
        """The packages whose absence is (part of) why ``name`` cannot serve."""
        return sorted({x.flags[0][1] for x in self.why.get(name, []) if x.is_package})

    def remedy_without_working(self) -> str:
        if self.installable:
            pk = sorted({x.flags[0][1] for n in self.installable for x in self.why[n]})
            return f"install {' and '.join(pk)} (see the reasons), or change the model/dtype/flags"
        return "no registered backend can serve this; change the model, dtype or flags named in the reasons"


def _flags_of(head: list[tuple[str, object]], bad: list[Reason], device: DeviceFacts) -> list[tuple[str, object]]:
    out = list(head)
    for r in bad:
        out += [f for f in r.flags if f not in out]
    dev = ("device", device.arch or device.type)
    return out + ([dev] if dev not in out and ("device.arch", device.arch) not in out else [])


def _fixes_of(err: ConfigError) -> list[dict[str, Any]]:
    """The field changes a resolve refusal proposes, as data (a strict refusal's ``avoid``, else ``err.fixes``)."""
    if isinstance(err, StrictRefusal):
        return [err.avoid]
    return list(getattr(err, "fixes", []))


def complete_fix(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, installed: Mapping[str, bool],
                 is_draft_worker: bool, fix: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``fix`` extended until the request resolves: ``(fix, resolved)``.

    The request with ``fix`` applied is tried through :func:`decide`; while it is refused with a fix
    of its own (strict's fields, another flag's backend, a mode to drop) that agrees with what ``fix``
    already sets, that fix is added and the request tried again. So a remedy names everything the
    start needs — also a second fault the first fix would only reveal. ``resolved`` is False when a
    refusal without such a fix remains (e.g. a package to install); ``fix`` is then the best so far.
    """
    for _ in range(8):
        try:
            _decide(msgspec.structs.replace(args, **fix), model, device, is_draft_worker=is_draft_worker,
                    installed=installed, probe=True)
        except ConfigError as e:
            nxt = next((f for f in _fixes_of(e) if any(k not in fix for k in f)
                        and all(fix.get(k, v) == v for k, v in f.items())), None)
            if nxt is None:
                return fix, False
            fix = {**fix, **nxt}
            continue
        return fix, True
    return fix, False


class _Ctx:
    """One resolve request: what remedies are checked against (a strict remedy is tried, not guessed)."""

    def __init__(self, args: AttentionArgs, model: ModelSpec, device: DeviceFacts, installed: Mapping[str, bool],
                 is_draft_worker: bool, survey: _Survey, probe: bool) -> None:
        self.args, self.model, self.device, self.installed = args, model, device, installed
        self.is_draft_worker, self.survey, self.probe = is_draft_worker, survey, probe

    def complete(self, fix: dict[str, Any], packages: Sequence[str] = ()) -> dict[str, Any]:
        """``fix`` with what the rest of the request needs to resolve (:func:`complete_fix`), as far as it goes;
        ``packages`` are assumed installed. A probe (a trial inside another remedy) returns ``fix`` as is."""
        if self.probe:
            return dict(fix)
        installed = {**self.installed, **{p: True for p in packages}}
        return complete_fix(self.args, self.model, self.device, installed, self.is_draft_worker, dict(fix))[0]

    def options(self, flag: str, names: Sequence[str]) -> tuple[list[str], list[dict[str, Any]]]:
        """Setting ``flag`` to each of ``names`` (backends that can serve it): (names that suffice alone,
        fixes that also need other fields — strict's, or a second fault's — tried, not guessed)."""
        alone, more = [], []
        for n in names:
            fix = self.complete({flag: n})
            (alone if len(fix) == 1 else more).append(fix)
        return [f[flag] for f in alone], more

    def set_remedy(self, flag: str, names: Sequence[str], first: Optional[str] = None) -> tuple[list[str], str]:
        """(allowed, remedy) offering ``names`` for ``flag`` with what each needs; ``first`` leading."""
        alone, more = self.options(flag, names)
        if first in alone:
            alone = [first] + [n for n in alone if n != first]
        parts = [f"set {flag} to one of: {one_of(alone)}"] if alone else []
        parts += [assignments(f) for f in more]
        return alone, (", or ".join(parts) if parts else self.install_for(flag))

    def install_for(self, flag: str) -> str:
        """The remedy when nothing installed can take ``flag``: install what a backend needs and set ``flag``
        to it (with what else the request needs), else :meth:`without_working`."""
        survey, parts = self.survey, []
        for name in survey.installable:
            pk = survey.packages_of(name)
            parts.append(f"install {' and '.join(pk)} and {assignments(self.complete({flag: name}, pk))}")
        return ", or ".join(parts) if parts else self.without_working()

    def without_working(self) -> str:
        """The remedy when no installed backend resolves and no flag names one: install what would serve it
        (with what else the request then needs), or change the request."""
        survey = self.survey
        if not survey.installable:
            return survey.remedy_without_working()
        pk = sorted({p for n in survey.installable for p in survey.packages_of(n)})
        fix = self.complete({}, pk)
        then = f" and {assignments(fix)}" if fix else ""
        return f"install {' and '.join(pk)}{then} (see the reasons), or change the model/dtype/flags"


def _suggest(name: str, ctx: _Ctx) -> tuple[Optional[str], str]:
    """(the closest known backend name, one sentence about it) for an unknown ``name``.

    Matched over every name attn-setup knows — registered (installed or not) and sglang's that it
    does not implement — case-insensitively, with difflib's ratio (cutoff 0.6).
    """
    known = registry.known_names()
    lower = {k.lower(): k for k in known}
    hit = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    if not hit:
        return None, ""
    best = lower[hit[0]]
    note = f"did you mean {best!r}?"
    if best in registry.KNOWN_UNAVAILABLE:
        return best, f"{note} (sglang's {registry.KNOWN_UNAVAILABLE[best]}, which attn-setup does not implement)"
    why = ctx.survey.why[best]
    if not why:
        return best, note
    pk = ctx.survey.packages_of(best)
    if pk and best in ctx.survey.installable:
        hints = sorted({INSTALL_HINT.get(p, f"pip install {p}") for p in pk})
        return best, f"{note} It needs {one_of(pk)}, which is not installed ({'; '.join(hints)})"
    return best, f"{note} It cannot serve this request here: {'; '.join(r.text for r in why)}"


def _lookup(name: str, flag: str, ctx: _Ctx) -> registry.BackendEntry:
    """registry.get, with allowed values and remedy narrowed to the backends that resolve here."""
    try:
        return registry.get(name, flag=flag)
    except (BackendUnavailable, BackendUnknown) as e:
        survey = ctx.survey
        msg, first = e.info.message, None
        if isinstance(e, BackendUnknown):
            first, note = _suggest(name, ctx)
            msg = f"{msg}; {note}" if note else msg
        allowed, remedy = ctx.set_remedy(flag, survey.working, first)
        if isinstance(e, BackendUnknown) and first in survey.installable and first not in survey.working:
            pk = survey.packages_of(first)
            remedy = f"install {' and '.join(pk)} and {assignments(ctx.complete({flag: first}, pk))}" + (
                f", or {remedy}" if allowed else "")
        e.args = (msg,)
        e.info = msgspec.structs.replace(e.info, state="resolve", message=msg, allowed=allowed, remedy=remedy)
        e.fixes = [{flag: n} for n in survey.working]  # type: ignore[attr-defined]
        raise


def _refuse_explicit(half: str, rule: Rule, name: str, flag: str, bad: list[Reason], ctx: _Ctx) -> CapabilityMismatch:
    survey, model, device = ctx.survey, ctx.model, ctx.device
    target = flag
    if rule != "draft_override" and ctx.is_draft_worker:
        target = "speculative_draft_attention_backend"
    allowed, remedy = ctx.set_remedy(target, survey.working)
    if target != flag:
        remedy = f"the draft model cannot use the inherited {name!r}: {remedy}"
    msg = f"{flag}={name!r} cannot serve {half} here: " + "; ".join(r.text for r in bad)
    if not survey.working and survey.installable:
        msg += f" ({survey.missing_note()})"
    flags = _flags_of([(flag, name)], bad, device) + [("model", model.source or model.model_type)]
    err = CapabilityMismatch(msg, state="resolve", flags=list(dict.fromkeys(flags)), allowed=allowed, remedy=remedy)
    err.fixes = [{target: n} for n in survey.working]  # type: ignore[attr-defined]
    return err


def _pick(half: str, explicit: Optional[Explicit], ctx: _Ctx) -> tuple[str, Rule, list[Rejection]]:
    survey, device = ctx.survey, ctx.device
    if explicit is not None:
        rule, name, flag = explicit
        entry = _lookup(name, flag, ctx)
        bad = survey.why[entry.name]
        if bad:
            raise _refuse_explicit(half, rule, name, flag, bad, ctx)
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
                             remedy=ctx.without_working())


def graph_skips(args: AttentionArgs, decode: str, device: DeviceFacts) -> list[Skip]:
    """CUDA graphs not captured, from the one rule (:func:`pipeline.cuda_graphs.decide_graphs`).

    No skip when graphs are captured or the user turned them off. On a non-CUDA device graphs do
    not apply (``downgrade=False``); on a CUDA device with a decode backend that cannot be captured
    they are a downgrade, avoided by ``disable_cuda_graph=True``.
    """
    d = decide_graphs(args, device.type, [decode], lambda n: registry.get(n).capability.has("cuda_graph"))
    if d.capture or args.disable_cuda_graph:
        return []
    return [Skip(what="cuda_graph", reason=d.reason, downgrade=d.downgrade,
                 avoid={"disable_cuda_graph": True} if d.downgrade else {})]


def _device_name(device: DeviceFacts) -> str:
    return f"{device.type} {device.arch}" if device.arch else device.type


def reference_fallback(res: Resolution, device: DeviceFacts) -> Optional[SetupWarning]:
    """The ``reference_fallback`` warning when auto-selection put ``torch_native`` on an accelerator.

    Any device but ``cpu`` counts (torch_native is the slow reference everywhere else). Only halves
    resolved by ``auto`` count: an explicit ``torch_native`` is the user's choice. ``avoid`` accepts
    it explicitly (``attention_backend``, or the phase field of the one half that fell back).
    """
    if device.type == "cpu":
        return None
    halves = [h for h in ("prefill", "decode") if res.rules.get(h) == "auto" and getattr(res.pair, h) == REFERENCE_BACKEND]
    if not halves:
        return None
    field = "attention_backend" if len(halves) == 2 else f"{halves[0]}_attention_backend"
    rejected = {h: list(res.rejected.get(h, [])) for h in halves}
    names = list(dict.fromkeys(r.backend for h in halves for r in rejected[h]))
    why = f"{one_of(names)} cannot serve this request" if names else "no other backend is registered for it"
    return SetupWarning(code="reference_fallback", what="+".join(halves),
                        message=f"{' and '.join(halves)} fell back to {REFERENCE_BACKEND}, the slow reference backend, "
                                f"on {_device_name(device)}: {why}",
                        avoid={field: REFERENCE_BACKEND}, rejected=rejected)


def warnings_for(res: Resolution, skips: Sequence[Skip], device: DeviceFacts) -> list[SetupWarning]:
    """Every warning of a start: the reference fallback (if any), then each downgrade among ``skips``.

    ``skips``: resolve's and build-mode's (``res.skips + plan.skips``). ``attn-setup plan`` lists
    these; a run logs the same as ``reference_fallback`` and ``feature_downgraded`` events.
    """
    fb = reference_fallback(res, device)
    return ([fb] if fb else []) + [SetupWarning(code="feature_downgraded", what=s.what, message=s.reason,
                                                avoid=dict(s.avoid)) for s in skips if s.downgrade]


def _refuse_strict(res: Resolution, args: AttentionArgs, device: DeviceFacts, is_draft_worker: bool) -> None:
    """Under ``strict``: raise :class:`StrictRefusal` for a reference fallback or any downgrade.

    Build-mode's downgrade (TBO on a draft worker) is decided here too (:func:`decide_mode`), so
    one refusal names every field needed: accepting ``torch_native`` explicitly, ``disable_cuda_graph``,
    dropping ``enable_two_batch_overlap``.
    """
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


def decide(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
           installed: Mapping[str, bool]) -> Resolution:
    """Resolve the (prefill, decode) pair for the model this worker serves.

    Parameters
    ----------
    args : the attention flags (sglang's names, plus ``strict``).
    model : the served model (the draft model on a draft worker).
    device : the device facts (a named profile at plan time, torch's at run time).
    is_draft_worker : a speculative-decoding draft worker.
    installed : distribution name (``torch``, ``triton``, ``flashinfer-python``) → present.

    Returns a :class:`Resolution` (never None): the pair, the rule per half, every auto candidate
    refused (per half, with reasons) and the CUDA-graph skip, if any (:func:`warnings_for` turns it
    into the start's warnings).
    Raises BackendUnknown / BackendUnavailable / CapabilityMismatch / ConflictingOptions (exit 3);
    with ``args.strict``, :class:`StrictRefusal` (``reference_fallback`` / ``downgrade_refused``).
    """
    return _decide(args, model, device, is_draft_worker=is_draft_worker, installed=installed, probe=False)


def _decide(args: AttentionArgs, model: ModelSpec, device: DeviceFacts, *, is_draft_worker: bool,
            installed: Mapping[str, bool], probe: bool) -> Resolution:
    """:func:`decide`; ``probe`` (remedy trials) skips trying remedies of its own."""
    try:
        check_modes(args, device, is_draft_worker)
    except ConfigError as e:
        fixes = getattr(e, "fixes", [])
        if fixes and not probe:  # each alternative with what the rest needs; those that resolve first
            tried = [complete_fix(args, model, device, installed, is_draft_worker, dict(f)) for f in fixes]
            done = [f for f, ok in tried if ok]
            if not done and len(fixes) > 1:  # e.g. PD-mux + TBO on a CPU: only dropping both resolves
                union, ok = complete_fix(args, model, device, installed, is_draft_worker,
                                         {k: v for f in fixes for k, v in f.items()})
                done = [union] if ok else []
            done = done or [f for f, _ in tried]
            prose = [e.prose] if getattr(e, "prose", "") else []
            e.info = msgspec.structs.replace(e.info, remedy=" or ".join([assignments(f) for f in done] + prose))
        raise
    survey = _Survey(args=args, model=model, device=device, installed=installed, is_draft_worker=is_draft_worker)
    ctx = _Ctx(args, model, device, installed, is_draft_worker, survey, probe)
    picks, rules, rejected = {}, {}, {}
    for half in ("prefill", "decode"):
        name, rule, rej = _pick(half, explicit_choice(args, half, is_draft_worker), ctx)
        picks[half], rules[half] = name, rule
        if rej:
            rejected[half] = rej
    pair = ResolvedAttentionBackendStr(prefill=picks["prefill"], decode=picks["decode"],
                                       is_draft_override=rules["prefill"] == "draft_override")
    res = Resolution(pair=pair, rules=rules, rejected=rejected, skips=graph_skips(args, picks["decode"], device))
    _refuse_strict(res, args, device, is_draft_worker)
    return res


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
