"""The setup machine as one table: ``device-init → resolve → build-mode → npu-lazy-mem → annotate → done``.

Each :data:`SETUP` row is a :class:`~pipeline.core.steps.Step` with ``decide``, ``log``, ``check``, ``apply``,
``compare`` and ``skips``; :mod:`pipeline.core.steps` walks it for a run, ``plan`` / preflight and replay. ``failed`` is
reachable from every state.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from pipeline.backends import registry
from pipeline.backends.packages import installed_by_metadata
from pipeline.core import events as ev, settings
from pipeline.core.contracts import Skip
from pipeline.core.steps import Stop, Guard, Step, StepTable
from pipeline.core.errors import error_info_from
from pipeline.platforms import parse_device
from pipeline.setup.context import SINGLE_RANK, Agreement, BuildDecision, DeviceDecision, LazyDecision, SetupContext
from pipeline.setup.instances import apply_build, check_pools_fit
from states import annotate, build_mode, device_init, fallback, npu_lazy_mem, resolve
from pipeline.memory.workspaces import check_workspaces

Rows = Iterable[tuple[str, Any, Any]]


def _recorded(recorded: Any, cls: type, state: str) -> Any:
    rec = recorded.first(cls)
    if rec is None:
        raise Stop(f"the trace ends before {state} recorded its decision")
    return rec


def _setting_rows(recorded: Any, now: Iterable[Any]) -> Rows:
    """``setting.<field>``: [value, source] as recorded vs now."""
    for s in now:
        rec = next((r for r in recorded.all(ev.SettingResolved) if r.field == s.field), None)
        yield f"setting.{s.field}", None if rec is None else [rec.value, rec.source], [s.value, s.source]


def _skip_rows(recorded: Any, state: str, skips: Iterable[Skip]) -> Rows:
    """``skips``: the recorded downgrades and not-applicable features of ``state`` (traces before the split
    logged both as ``feature_downgraded``) vs now."""
    rec = [[r.what, r.reason] for r in recorded.records if r.state == state and (
        isinstance(r, ev.FeatureDowngraded) or (isinstance(r, ev.StepSkipped) and r.what == "cuda_graph"))]
    yield "skips", rec, [[s.what, s.reason] for s in skips]


def _log_setting(ctx: SetupContext, s: Any) -> None:
    ctx.emit(ev.SettingResolved, field=s.field, value=s.value, source=s.source, env_var=s.env_var)


# -- device-init: BLAS init on cuda/musa only (sglang's init_cublas), device facts recorded ----------------
def decide_device(ctx: SetupContext) -> DeviceDecision:
    """The size env vars checked like their fields, this rank's own device (many ranks), its facts, BLAS."""
    req = ctx.request
    settings.check_env(ctx.env)
    _, index = parse_device(req.device)
    if ctx.rank_group is not None:  # many ranks: each on its own device, never device 0 by accident
        from pipeline.setup.distributed import check_rank_device

        check_rank_device(req.device, ctx.platform.device_type, ctx.rank_group, rank=req.rank,
                          world_size=req.world_size)
    facts = ctx.facts if ctx.facts is not None else ctx.platform.device_facts(index)
    return DeviceDecision(facts=facts, blas=device_init.decide_blas(facts.type))


def apply_device(ctx: SetupContext, d: DeviceDecision) -> None:
    index = parse_device(ctx.request.device)[1]
    blas = ctx.platform.init_blas() if d.blas else False
    ctx.torch_device = ctx.platform.torch_device(index)
    ctx.emit(ev.DeviceInitialized, facts=d.facts, blas_init=blas, spelled_as=ctx.request.device_spelled_as)
    if ctx.rank_group is not None and ctx.request.world_size > 1:
        from pipeline.setup.distributed import balance_memory

        balance_memory(ctx, index)
    ctx.model.device_facts = d.facts


def compare_device(ctx: SetupContext, recorded: Any, d: DeviceDecision) -> Rows:
    yield "blas_init", _recorded(recorded, ev.DeviceInitialized, "device-init").blas_init, d.blas


# -- resolve: the pair, each half's rule, every candidate refused; the ranks agree ----------------------------
def decide_resolution(ctx: SetupContext) -> Any:
    """resolve's decision; a run's package presence by import must agree with the metadata ``plan`` reads."""
    req, facts = ctx.request, ctx.device.facts
    kw = dict(is_draft_worker=req.is_draft_worker, target=req.model)
    if ctx.installed_given:
        return resolve.decide(req.args, req.served_model, facts, installed=ctx.installed, **kw)
    return resolve.decide_for_run(req.args, req.served_model, facts, metadata=installed_by_metadata(),
                                  imported=ctx.installed, import_errors=ctx.import_errors, **kw)


def log_resolution(ctx: SetupContext, res: Any) -> None:
    facts = ctx.device.facts
    if res.dtype is not None:
        ctx.emit(ev.SettingResolved, field="dtype", value=res.dtype.value, source=res.dtype.source)
    ctx.emit(ev.BackendsResolved, prefill=res.pair.prefill, decode=res.pair.decode,
             is_draft_override=res.pair.is_draft_override, rules=dict(res.rules), rejected=res.rejected,
             not_attention=list(res.not_attention), speculative=res.speculative, evidence=res.evidence)
    fb = fallback.reference_fallback(res, facts)
    if fb is not None:
        ctx.emit(ev.ReferenceFallback, halves=fb.what.split("+"), backend=registry.reference_name(),
                 device=facts.arch or facts.type, rejected=fb.rejected, avoid=fb.avoid, message=fb.message)
    ctx.emit_skips(res.skips)


def agree(ctx: SetupContext, res: Any, error: Any = None) -> Agreement:
    """world_size > 1 with a rank group: every rank agrees on the pair (and args), or all raise RankDivergence;
    without a group the exchange is recorded as skipped; one rank agrees trivially."""
    req = ctx.request
    if req.world_size <= 1:
        return Agreement(True, SINGLE_RANK)
    if ctx.rank_group is None:
        reason = f"world_size={req.world_size} but no rank_group was given"
        if error is None:
            ctx.emit(ev.StepSkipped, outcome="skipped", what="rank_agreement", reason=reason)
        return Agreement(False, f"skipped: {reason}")
    from pipeline.setup.distributed import agree_on_resolution
    from pipeline.setup.distributed import digest_fields

    t, g = time.perf_counter(), ctx.rank_group
    table = agree_on_resolution(res, ctx.device.facts, group=g.cpu_group, rank=req.rank, world_size=req.world_size,
                                timeout_s=g.timeout_s, args=req.args, error=error,
                                digest=digest_fields(req, ctx.installed, ctx.device.facts), watch=ctx.watch)
    if error is None:
        ctx.emit(ev.ResolutionAgreed, world_size=req.world_size, table=table,
                 duration_ms=(time.perf_counter() - t) * 1e3)
    return Agreement(True, f"resolution_agreed across {req.world_size} ranks")


def apply_resolution(ctx: SetupContext, res: Any) -> None:
    ctx.agreement = agree(ctx, res)
    ctx.model.resolution = res


def resolution_refused(ctx: SetupContext, exc: BaseException) -> None:
    """The other ranks must hear of a refusal, or they would wait out the timeout."""
    if isinstance(exc, Exception) and ctx.log is not None and ctx.device is not None:
        agree(ctx, None, error=error_info_from(exc, "resolve"))


def compare_resolution(ctx: SetupContext, recorded: Any, res: Any) -> Rows:
    rec = _recorded(recorded, ev.BackendsResolved, "resolve")
    dt = next((s for s in recorded.all(ev.SettingResolved) if s.field == "dtype"), None)
    if dt is not None and res.dtype is not None:  # traces from before the dtype rule record none
        yield "setting.dtype", [dt.value, dt.source], [res.dtype.value, res.dtype.source]
    yield from (("prefill", rec.prefill, res.pair.prefill), ("decode", rec.decode, res.pair.decode),
                ("is_draft_override", rec.is_draft_override, res.pair.is_draft_override),
                ("rules", rec.rules, dict(res.rules)), ("rejected", rec.rejected, res.rejected),
                ("not_attention", rec.not_attention, res.not_attention),
                ("speculative", rec.speculative, res.speculative))
    if rec.evidence:  # traces recorded before the measured table have none
        yield "evidence", rec.evidence, res.evidence
    yield from _skip_rows(recorded, "resolve", res.skips)
    fb, now = recorded.first(ev.ReferenceFallback), fallback.reference_fallback(res, ctx.device.facts)
    yield "reference_fallback", None if fb is None else fb.halves, None if now is None else now.what.split("+")


# -- build-mode: the instances, their workspaces, whether decode graphs are captured -------------------------
def decide_build(ctx: SetupContext) -> BuildDecision:
    req, res = ctx.request, ctx.resolution
    ws = {b: registry.get(b).workspace(req.args, req.served_model, ctx.env)
          for b in dict.fromkeys((res.pair.prefill, res.pair.decode))}
    plan = build_mode.decide(req.args, res.pair, is_draft_worker=req.is_draft_worker,
                             workspace_bytes=lambda b: ws[b].value)
    logged = list({s.field: s for s in ws.values() if s.field}.values())
    return BuildDecision(settings=logged, workspace_bytes={b: s.value for b, s in ws.items()}, plan=plan,
                         graphs=build_mode.decide_graphs(req.args, ctx.device.facts.type, [build_mode.graph_backend(
                             res.pair, res.speculative, req.is_draft_worker)]))


def log_build(ctx: SetupContext, d: BuildDecision) -> None:
    for s in d.settings:
        _log_setting(ctx, s)
    p = d.plan
    ctx.emit(ev.BuildPlanned, mode=p.mode, hybrid=p.hybrid, instances=p.instances, workspaces=p.workspaces)
    ctx.emit_skips(p.skips)


def check_build(ctx: SetupContext, d: BuildDecision) -> None:
    """Refusals that need no device: CUDA-graph sizes within ``max_reqs`` (on every device) and each workspace
    against the largest batch its users plan (each user's registry entry, graph sizes actually captured)."""
    req = ctx.request
    build_mode.check_graph_bs(req.args, req.pool.max_reqs)
    if ctx.platform is not None and ctx.given_pools is None:  # pools we will allocate: the first thing to refuse
        check_pools_fit(ctx)
    check_workspaces(req, d, ctx.device.facts)


def compare_build(ctx: SetupContext, recorded: Any, d: BuildDecision) -> Rows:
    yield from _setting_rows(recorded, d.settings)
    rec = _recorded(recorded, ev.BuildPlanned, "build-mode")
    yield from ((f, getattr(rec, f), getattr(d.plan, f)) for f in ("mode", "hybrid", "instances", "workspaces"))
    yield from _skip_rows(recorded, "build-mode", d.plan.skips)


# -- npu-lazy-mem: zbal lazy device memory before any graph capture, or skipped with the reason --------------
def decide_lazy(ctx: SetupContext) -> LazyDecision:
    req = ctx.request
    size, source = settings.zbal_local_mem_size(req.args, ctx.env)
    return LazyDecision(setting=settings.setting("zbal_local_mem_size", size, source),
                        decision=npu_lazy_mem.decide(ctx.device.facts.type, size, source, req.is_draft_worker))


def apply_lazy(ctx: SetupContext, d: LazyDecision) -> None:
    lazy, req = d.decision, ctx.request
    if lazy.run:
        ctx.platform.init_lazy_device_memory(lazy.nbytes, req.rank, req.world_size, ctx.cpu_group)
        ctx.emit(ev.LazyMemInitialized, bytes=lazy.nbytes, rank_arg=req.rank, world_size=req.world_size)
        ctx.model.lazy_mem = "done"
    else:
        ctx.emit(ev.StepSkipped, outcome="skipped", what="npu_lazy_mem", reason=lazy.reason)
        ctx.model.lazy_mem = lazy.reason


def compare_lazy(ctx: SetupContext, recorded: Any, d: LazyDecision) -> Rows:
    yield from _setting_rows(recorded, [d.setting])
    lazy = recorded.first(ev.LazyMemInitialized)
    skip = next((s for s in recorded.all(ev.StepSkipped) if s.what == "npu_lazy_mem"), None)
    if lazy is None and skip is None:
        raise Stop("the trace ends before npu-lazy-mem recorded its decision")
    yield "run", lazy is not None, d.decision.run
    yield ("bytes", lazy.bytes, d.decision.nbytes) if d.decision.run else ("reason", skip.reason, d.decision.reason)


def lazy_skips(ctx: SetupContext, d: LazyDecision) -> list[Skip]:
    return [] if d.decision.run else [Skip(what="npu_lazy_mem", reason=d.decision.reason, downgrade=False)]


def apply_names(ctx: SetupContext, _: Any) -> None:
    pair, top = ctx.resolution.pair, ctx.built.attn_backend
    annotate.set_names(top, pair)
    ctx.emit(ev.BackendsAnnotated, target=type(top).__name__, prefill=pair.prefill, decode=pair.decode)
    ctx.model.names_set = True


def compare_names(ctx: SetupContext, recorded: Any, _: Any) -> Rows:
    rec = _recorded(recorded, ev.BackendsAnnotated, "annotate")
    yield "names", [rec.prefill, rec.decode], [ctx.resolution.pair.prefill, ctx.resolution.pair.decode]


SETUP = StepTable(
    machine="setup", success="done", event=ev.StateTransition, enum_name="State", module=__name__,
    remedy="run the pipeline's steps in order; a finished or failed run cannot continue — start a new run",
    steps=(
        Step("device-init", "device_ready", (Guard(
            "has_device_facts", "device facts are recorded (and BLAS initialised on cuda/musa) before anything is "
            "resolved"),), result="device", decide=decide_device, apply=apply_device, compare=compare_device,
            emits=(ev.DeviceInitialized,)),
        Step("resolve", "resolved", (Guard(
            "has_resolution", "both halves resolved to registered, non-None backend names before any backend is "
            "built"),), result="resolution", decide=decide_resolution, log=log_resolution, apply=apply_resolution,
            compare=compare_resolution, skips=lambda ctx, res: list(res.skips), refused=resolution_refused,
            emits=(ev.SettingResolved, ev.BackendsResolved, ev.ReferenceFallback, ev.FeatureDowngraded,
                   ev.StepSkipped, ev.ResolutionAgreed)),
        Step("build-mode", "built", (Guard(
            "has_backends", "every planned instance is built and every workspace accounted for"),),
            result="build", decide=decide_build, log=log_build, check=check_build, apply=apply_build,
            compare=compare_build, skips=lambda ctx, d: list(d.plan.skips),
            emits=(ev.SettingResolved, ev.BuildPlanned, ev.FeatureDowngraded, ev.StepSkipped, ev.BackendBuilt),
            faults=("build:pools", "build:workspace:<id>", "build:instance:<role>", "build:instance:<role>:built",
                    "build:compose")),
        Step("npu-lazy-mem", "lazy_mem_settled", (Guard(
            "has_lazy_mem_outcome", "NPU zbal lazy memory is initialised, or skipped with a recorded reason, before "
            "graph capture"),), result="lazy", decide=decide_lazy, log=lambda ctx, d: _log_setting(ctx, d.setting),
            apply=apply_lazy, compare=compare_lazy, skips=lazy_skips, skip="npu_lazy_mem",
            emits=(ev.SettingResolved, ev.LazyMemInitialized, ev.StepSkipped)),
        Step("annotate", "annotated", (Guard("has_names", "the resolved names are set on the top-level backend object"),),
             apply=apply_names, compare=compare_names, emits=(ev.BackendsAnnotated,)),
    ))
State = SETUP.State
