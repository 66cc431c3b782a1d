"""build-mode's effect: the KV pools, the planned workspaces, every backend instance and the wrappers over them.

:func:`apply_build` carries out a :class:`~pipeline.setup.context.BuildDecision` (fault points ``build:pools``,
``build:workspace:<id>``, ``build:instance:<role>``, ``build:instance:<role>:built``, ``build:compose``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

from pipeline.backends import registry
from pipeline.core import events as ev
from pipeline.core.contracts import BuildPlan, InstancePlan, Mode, SetupRequest
from pipeline.core.dtypes import kv_dtype, model_dtype
from pipeline.core.errors import ConfigError
from pipeline.core.faults import check as fault_point
from pipeline.memory.pools import (available_bytes, check_fits, kv_bytes_per_token, POOL_MEMORY_SHARE, PoolSizing,
    remedy_available)
from pipeline.platforms import parse_device
from pipeline.setup.context import Built, SetupContext
from pipeline.setup.result import release


GIVEN_POOLS_REMEDY = ("build the pools from the same sizes as the SetupRequest's PoolFacts (max_reqs, max_context_len, "
                      "num_token_slots, page_size) and the model (KVPool.for_layer_kinds), or pass pools=None")


def check_workspace_memory(ctx: SetupContext, d: Any) -> None:
    """Refuse planned workspaces above :data:`POOL_MEMORY_SHARE` of free memory (ConfigError
    ``workspace_exceeds_memory`` with a size that fits)."""
    plan = d.plan
    total = plan.workspace_bytes
    avail = available_bytes(ctx.platform, parse_device(ctx.request.device)[1]) if total else 0
    if not avail or total <= avail * POOL_MEMORY_SHARE:
        return
    s = max(d.settings, key=lambda s: s.value) if d.settings else None  # the setting that sized the workspaces
    name = "workspace_bytes" if s is None else (s.env_var if s.source == "env" and s.env_var else s.field)
    per_ws = int(avail * POOL_MEMORY_SHARE) // max(len(plan.workspaces), 1)
    fit = int(remedy_available(avail) * POOL_MEMORY_SHARE) // max(len(plan.workspaces), 1)  # with a margin
    raise ConfigError(f"the planned workspaces need {total} bytes but {ctx.torch_device} has {avail} bytes free "
                      f"({POOL_MEMORY_SHARE:.0%} of it may be used)", code="workspace_exceeds_memory",
                      flags=[(name, None if s is None else s.value), ("workspaces", len(plan.workspaces)),
                             ("available_bytes", avail)],
                      allowed=[f"<= {per_ws} bytes per workspace"], remedy=f"set {name} to {fit} or less")


def check_pools_fit(ctx: SetupContext) -> None:
    """Refuse KV pools ``request.pool`` asks for that cannot fit the device's free memory: ConfigError
    ``pool_exceeds_memory`` naming the deciding ``pool.*`` field (:func:`pipeline.memory.pools.check_fits`). Allocates
    nothing; runs before build-mode's workspace checks."""
    req = ctx.request
    p, model = req.pool, req.served_model
    per_tok = kv_bytes_per_token(model.layer_kinds(), model.num_hidden_layers, kv_dtype(req.args, model))
    s = PoolSizing(facts=p, source="slots", budget_bytes=None, bytes_per_token=per_tok,
                   req_to_token_bytes=p.max_reqs * p.max_context_len * 4, kv_bytes=p.num_token_slots * per_tok)
    check_fits(s, available_bytes(ctx.platform, parse_device(req.device)[1]), device=str(ctx.torch_device), cli=False,
               graph_top=req.args.cuda_graph_max_bs or max(req.args.cuda_graph_bs or [0]))


def make_pools(ctx: SetupContext) -> None:
    """The KV pools for ``request.pool`` and the served model, or the engine's own pools, checked
    (:func:`check_given_pools`)."""
    if ctx.given_pools is not None:
        check_given_pools(ctx)
        return
    from pipeline.backends.memory import KVPool, ReqToTokenPool, torch_dtype

    req = ctx.request
    p, model = req.pool, req.served_model
    kinds, kvd = model.layer_kinds(), kv_dtype(req.args, model)
    ctx.pools["req_to_token_pool"] = ReqToTokenPool(p.max_reqs, p.max_context_len, ctx.torch_device)
    ctx.pools["kv_pool"] = KVPool.for_layer_kinds(kinds, model.num_hidden_layers, p.num_token_slots, p.page_size,
                                                  torch_dtype(kvd), ctx.torch_device)


def _bad(field: str, have: Any, want: Any) -> ConfigError:
    return ConfigError(f"the given pools' {field} is {have!r}, this run needs {want!r}", code="pools_mismatch",
                       flags=[(f"pools.{field}", repr(have))], allowed=[repr(want)], remedy=GIVEN_POOLS_REMEDY)


def _check_tensor(field: str, t: Any, shape: tuple, dtype: Any, dev: Any) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise _bad(field, type(t).__name__, f"a torch.Tensor {list(shape)} {dtype}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise _bad(field, f"{list(t.shape)} {t.dtype}", f"{list(shape)} {dtype}")
    if t.device.type != dev.type or (dev.index is not None and t.device.index not in (None, dev.index)):
        raise _bad(f"{field}.device", str(t.device), str(dev))


def check_given_pools(ctx: SetupContext) -> None:
    """Refuse engine pools the request's ``PoolFacts`` or the model do not describe: ConfigError ``pools_mismatch``
    before any allocation. Checked: both keys; ``req_to_token`` [max_reqs, max_context_len] int32; one K/V buffer per
    layer of the served model (a pipeline stage: its own layers from 0, as sglang's ``layer_id - start_layer``); per
    layer K [num_token_slots, Hkv, D] and V [num_token_slots, Hkv, Dv] of the KV dtype on the run's device (MLA: V a
    view of K); ``page_size``."""
    import torch

    from pipeline.backends.memory import torch_dtype

    pools, req = ctx.given_pools, ctx.request
    p, model = req.pool, req.served_model
    for key in ("req_to_token_pool", "kv_pool"):
        if pools.get(key) is None:
            raise _bad(key, None if key not in pools else pools[key], "a pool object")
    r2t, kv, dev = pools["req_to_token_pool"], pools["kv_pool"], torch.device(ctx.torch_device)
    _check_tensor("req_to_token_pool.req_to_token", getattr(r2t, "req_to_token", None),
                  (p.max_reqs, p.max_context_len), torch.int32, dev)
    if getattr(kv, "page_size", None) != p.page_size:
        raise _bad("kv_pool.page_size", getattr(kv, "page_size", None), p.page_size)
    kvd, n = torch_dtype(kv_dtype(req.args, model)), model.num_hidden_layers
    kb, vb = getattr(kv, "k_buffer", None), getattr(kv, "v_buffer", None)
    for name, bufs in (("k_buffer", kb), ("v_buffer", vb)):
        if not isinstance(bufs, (list, tuple)) or len(bufs) != n:
            stage = model.shard is not None and model.shard.pp_size > 1
            where = f" (pipeline stage {model.shard.pp_rank}: layers {model.shard.layer_range[0]}-" \
                    f"{model.shard.layer_range[0] + n - 1}, indexed from 0)" if stage else ""
            raise _bad(f"kv_pool.{name}", f"{type(bufs).__name__} of "
                       f"{len(bufs) if isinstance(bufs, (list, tuple)) else '-'}",
                       f"a list of {n} per-layer buffers{where}")
    for k in model.layer_kinds():
        for lid in k.layer_ids:
            _check_tensor(f"kv_pool.k_buffer[{lid}]", kb[lid], (p.num_token_slots, k.num_kv_heads, k.head_dim_qk),
                          kvd, dev)
            _check_tensor(f"kv_pool.v_buffer[{lid}]", vb[lid], (p.num_token_slots, k.num_kv_heads, k.head_dim_v),
                          kvd, dev)
            if k.is_mla and (vb[lid].data_ptr() != kb[lid].data_ptr() or vb[lid].stride() != kb[lid].stride()):
                raise _bad(f"kv_pool.v_buffer[{lid}]", "a separate tensor",
                           f"a view of the first {k.head_dim_v} dims of k_buffer[{lid}] (one latent buffer per "
                           "MLA layer, as sglang's MLATokenToKVPool; KVPool.for_layer_kinds builds it)")


def _compose(plan: BuildPlan, instances: dict[str, Any], top: str) -> Any:
    if plan.hybrid:
        from pipeline.backends.hybrid import HybridAttnBackend

        return HybridAttnBackend(instances[f"{top}.prefill"], instances[f"{top}.decode"])
    return instances[top]


def build_instances(plan: BuildPlan, make_instance: Callable[[InstancePlan], Any], built: Built) -> Built:
    """Build every planned instance via ``make_instance`` (added to ``built.instances`` as made) and compose the
    wrappers of ``plan.mode``: PD-mux prefill + ``pdmux.decodeN``, TBO primary + two children, optional hybrid halves.
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
    """Build ``backends``' plan again for ``model`` (same layer ids and dims; per-kind parameters may differ, e.g.
    :func:`pipeline.runtime.verify.verification_model`'s windows), on the same workspaces, pools and graph size. Logs
    nothing; returns a :class:`~pipeline.setup.context.Built` whose ``instances`` the caller closes. Raises what a
    factory raises, after closing those already built."""
    from states.build_mode import graph_max_bs

    pools = pools if pools is not None else backends.pools
    kinds, ws_pool = model.layer_kinds(), backends.workspace_pool
    max_bs = graph_max_bs(request.args, request.pool.max_reqs, backends.graphs.capture, device=backends.device_facts,
                          world_size=request.tp_size)

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

