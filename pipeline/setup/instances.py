"""build-mode's effect: the KV pools, the planned workspaces, every backend instance and the wrappers over them.

:func:`apply_build` carries out a :class:`~pipeline.setup.context.BuildDecision` for a run (fault points
``build:pools``, ``build:workspace:<id>``, ``build:instance:<role>``, ``build:instance:<role>:built``,
``build:compose``); :func:`build_instances` builds a plan's instances through a factory and composes the
wrappers (PD-mux's groups, TBO's primary and children, a hybrid's halves), so a failure half-way leaves
exactly what must be released; :func:`build_like` builds a finished run's plan again for another spec
(verification's capped windows).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

from pipeline.backends import registry
from pipeline.core import events as ev
from pipeline.core.contracts import BuildPlan, InstancePlan, Mode, SetupRequest
from pipeline.core.dtypes import model_dtype
from pipeline.core.faults import check as fault_point
from pipeline.setup.context import Built, SetupContext
from pipeline.setup.pools import check_workspace_memory, make_pools
from pipeline.setup.result import release


def _compose(plan: BuildPlan, instances: dict[str, Any], top: str) -> Any:
    if plan.hybrid:
        from pipeline.backends.hybrid import HybridAttnBackend

        return HybridAttnBackend(instances[f"{top}.prefill"], instances[f"{top}.decode"])
    return instances[top]


def build_instances(plan: BuildPlan, make_instance: Callable[[InstancePlan], Any], built: Built) -> Built:
    """Build every planned instance through ``make_instance`` and compose the wrappers of ``plan.mode``.

    Instances are added to ``built.instances`` as they are made, so a failure half-way leaves ``built``
    listing exactly what must be released. PD-mux: ``attn_backend`` is the prefill instance and the decode
    group the ``pdmux.decodeN`` instances (``decode_attn_backend`` the first); TBO: a wrapper over the primary
    and two children; else the primary. With ``plan.hybrid`` each of those is a prefill/decode hybrid.
    """
    built.plan = plan
    for inst in plan.instances:
        built.instances[inst.role] = make_instance(inst)
    if plan.mode is Mode.PDMUX:
        tops = sorted({r.role.split(".")[1] for r in plan.instances if r.role.startswith("pdmux.decode")},
                      key=lambda s: int(s[len("decode"):]))
        built.attn_backend = _compose(plan, built.instances, "pdmux.prefill")
        built.decode_attn_backend_group = [_compose(plan, built.instances, f"pdmux.{t}") for t in tops]
        built.decode_attn_backend = built.decode_attn_backend_group[0]
    elif plan.mode is Mode.TBO:
        from pipeline.backends.tbo import TboAttnBackend

        parts = [_compose(plan, built.instances, f"tbo.{t}") for t in ("primary", "child0", "child1")]
        built.attn_backend = TboAttnBackend(parts[0], children=parts[1:])
    else:
        built.attn_backend = _compose(plan, built.instances, "primary")
    return built


def backend_context(inst: InstancePlan, request: SetupRequest, model: Any, kinds: list[Any], facts: Any,
                    torch_device: str, pools: Mapping[str, Any], workspace: Any, max_graph_bs: int) -> Any:
    """The :class:`~pipeline.backends.registry.BackendContext` a factory gets for one planned instance."""
    return registry.BackendContext(
        name=inst.backend, role=inst.role, device=facts, torch_device=torch_device, model=model, layer_kinds=kinds,
        args=request.args, req_to_token_pool=pools["req_to_token_pool"], kv_pool=pools["kv_pool"],
        workspace=workspace, dtype=model_dtype(request.args, model), extra={"cuda_graph_max_bs": max_graph_bs})


def apply_build(ctx: SetupContext, d: Any) -> None:
    """Carry out build-mode's decision: refuse workspaces the device cannot hold, then make the pools (or check
    the engine's), the workspaces and every instance, logging ``backend_built`` for each."""
    from pipeline.backends.workspace import WorkspacePool

    plan, faults = d.plan, ctx.faults
    ctx.built.plan = plan
    check_workspace_memory(ctx, d)
    fault_point(faults, "build:pools")
    make_pools(ctx)
    ctx.workspace_pool = WorkspacePool(ctx.torch_device)
    for ws_plan in plan.workspaces:
        fault_point(faults, f"build:workspace:{ws_plan.id}", *ctx.pools.values())
        ctx.workspace_pool.allocate(ws_plan)
    max_bs, kinds = d.graph_max_bs(ctx.request, ctx.device.facts), ctx.request.served_model.layer_kinds()

    def make(inst: InstancePlan) -> Any:
        ws = ctx.workspace_pool.get(inst.workspace) if inst.workspace else None
        bctx = backend_context(inst, ctx.request, ctx.request.served_model, kinds, ctx.device.facts, ctx.torch_device,
                               ctx.pools, ws, max_bs)
        fault_point(faults, f"build:instance:{inst.role}", *([ws] if ws is not None else []))
        t = time.perf_counter()
        backend = registry.get(inst.backend).load_factory()(bctx)
        if faults is not None:
            _fault_after_factory(faults, inst.role, backend)
        ctx.emit(ev.BackendBuilt, role=inst.role, backend=inst.backend, duration_ms=(time.perf_counter() - t) * 1e3)
        return backend

    with ctx.log.heartbeat(f"building {len(plan.instances)} backend instance(s)"):
        build_instances(plan, make, ctx.built)
    ctx.model.backends = ctx.built
    fault_point(faults, "build:compose", *ctx.workspace_pool.workspaces)


def _fault_after_factory(faults: Any, role: str, backend: Any) -> None:
    """Test-only: a fault right after a factory returned closes the backend that nobody holds yet."""
    try:
        fault_point(faults, f"build:instance:{role}:built", backend)
    except BaseException:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        raise


def build_like(backends: Any, request: SetupRequest, model: Any, pools: Optional[Mapping[str, Any]] = None) -> Built:
    """Build ``backends``' plan again for ``model``: the same instances (roles, backends, mode, wrappers).

    ``model`` must have the layers of the served model (same ids and dims); what may differ is a per-kind
    parameter the backends bake in, e.g. the shrunk sliding windows of
    :func:`pipeline.runtime.verify.verification_model`, so that a check runs on instances built for exactly the
    layers it calls them with. Each instance gets the factory, role, device facts, workspace (the same buffer:
    the copies run only while the originals are idle), pools (``pools`` or ``backends.pools``) and graph size of
    the original build; the refusals of the factories apply again. No pipeline event is logged. Returns a
    :class:`~pipeline.setup.context.Built`; the caller closes its ``instances`` (they own no workspace or pool).
    Raises what a factory raises, after closing the instances already built.
    """
    from states.build_mode import graph_max_bs

    pools = pools if pools is not None else backends.pools
    kinds, ws_pool = model.layer_kinds(), backends.workspace_pool
    max_bs = graph_max_bs(request.args, request.pool.max_reqs, backends.graphs.capture, device=backends.device_facts,
                          world_size=request.world_size)

    def make(inst: InstancePlan) -> Any:
        ws = ws_pool.get(inst.workspace) if inst.workspace else None
        ctx = backend_context(inst, request, model, kinds, backends.device_facts, backends.torch_device, pools, ws,
                              max_bs)
        return registry.get(inst.backend).load_factory()(ctx)

    built = Built()
    try:
        return build_instances(backends.plan, make, built)
    except BaseException:
        release(built.instances, None, {})
        raise
