"""The library entry point: run the six-state pipeline and return :class:`AttentionBackends`."""

from __future__ import annotations

import time
import traceback
from typing import Any, Mapping, Optional

from pipeline import events as ev
from pipeline import settings
from pipeline.contracts import InstancePlan, SetupRequest
from pipeline.errors import error_info_from
from pipeline.eventlog import EventLog
from pipeline.faults import Faults, check as fault_point
from pipeline.machine import SetupMachine, State
from pipeline.platforms import parse_device, platform_for
from pipeline.platforms.base import Platform
from pipeline.result import AttentionBackends
from states import annotate, build_mode, device_init, npu_lazy_mem, resolve
from states.capability_check import kv_dtype, model_dtype
from pipeline.runinfo import (  # noqa: F401 (re-exported: part of this module's API)
    PACKAGES, installed_by_import, installed_by_metadata, new_run_id, redacted_request, versions,
)


class _Run:
    """One pipeline run: the machine, the log, and what each state produced."""

    def __init__(self, request: SetupRequest, platform: Optional[Platform], log: EventLog,
                 pools: Optional[dict[str, Any]], installed: Optional[Mapping[str, bool]], cpu_group: Any,
                 faults: Optional[Faults] = None, rank_group: Any = None) -> None:
        self.req, self.log, self.cpu_group = request, log, cpu_group
        self.faults, self.rank_group = faults, rank_group  # faults: test-only (pipeline.faults)
        if cpu_group is None and rank_group is not None:  # NPU zbal init uses the world's CPU group
            self.cpu_group = rank_group.cpu_group
        self.platform = platform or platform_for(request.device)
        self.machine = SetupMachine(on_transition=self._on_transition)
        self.import_errors: dict[str, str] = {}
        self.installed_given = installed is not None
        self.installed = dict(installed) if installed is not None else installed_by_import(errors=self.import_errors)
        self.given_pools = pools
        self.pools: dict[str, Any] = dict(pools or {})
        self.workspace_pool: Any = None
        self.built = build_mode.Built(plan=None)  # type: ignore[arg-type]
        self.t0 = time.perf_counter()
        from pipeline.rank_watch import watch_for  # heartbeats + named stalls (many ranks with a store)

        self.watch = watch_for(rank_group) if request.world_size > 1 else None
        self._beats: Any = None

    @property
    def state(self) -> str:
        return self.machine.state.value

    def _on_transition(self, src: State, dst: State, trigger: str, ms: float) -> None:
        if self.watch is not None:
            self.watch.beat(dst.value if dst is not State.FAILED else f"failed in {src.value}")
        self.log.emit(ev.StateTransition, state=dst.value, outcome="failed" if dst is State.FAILED else "ok",
                      from_state=src.value, to=dst.value, trigger=trigger, duration_ms=ms)

    # -- states ---------------------------------------------------------------------------
    def device_init(self) -> None:
        fault_point(self.faults, "state:device-init")
        settings.check_env()  # the SGLANG_* size variables, checked like their fields before anything is built
        _, index = parse_device(self.req.device)
        if self.rank_group is not None:  # many ranks: each on its own device, never device 0 by accident
            from pipeline.distributed import check_rank_device

            check_rank_device(self.req.device, self.platform.device_type, self.rank_group,
                              rank=self.req.rank, world_size=self.req.world_size)
        facts, blas = device_init.apply(self.platform, index)
        self.torch_device = self.platform.torch_device(index)
        self.log.emit(ev.DeviceInitialized, state=self.state, facts=facts, blas_init=blas)
        if self.rank_group is not None and self.req.world_size > 1:
            from pipeline.rank_checks import balance_memory

            balance_memory(self, index)
        self.machine.model.device_facts = facts
        fault_point(self.faults, "state:device-init:done")
        self.machine.fire("device_ready")

    def resolve(self) -> None:
        fault_point(self.faults, "state:resolve")
        facts, model = self.machine.model.device_facts, self.req.served_model
        try:
            r = self._decide(facts, model)
        except Exception as e:  # the other ranks must hear of it, or they would wait out the timeout
            self._agree_across_ranks(None, facts, error=error_info_from(e, "resolve"))
            raise
        if r.dtype is not None:
            self.log.emit(ev.SettingResolved, state=self.state, field="dtype", value=r.dtype.value,
                          source=r.dtype.source)
        self.log.emit(ev.BackendsResolved, state=self.state, prefill=r.pair.prefill, decode=r.pair.decode,
                      is_draft_override=r.pair.is_draft_override, rules=dict(r.rules), rejected=r.rejected,
                      not_attention=list(r.not_attention))
        fb = resolve.reference_fallback(r, facts)
        if fb is not None:
            self.log.emit(ev.ReferenceFallback, state=self.state, halves=fb.what.split("+"),
                          backend=resolve.REFERENCE_BACKEND, device=facts.arch or facts.type, rejected=fb.rejected,
                          avoid=fb.avoid, message=fb.message)
        self._emit_skips(r.skips)
        self._agree_across_ranks(r, facts)
        self.machine.model.resolution = r
        fault_point(self.faults, "state:resolve:done")
        self.machine.fire("resolved")

    def _decide(self, facts: Any, model: Any) -> Any:
        if self.installed_given:
            return resolve.decide(self.req.args, model, facts, is_draft_worker=self.req.is_draft_worker,
                                  installed=self.installed)
        # a run: imports decide, and must agree with what `attn-setup plan` (metadata) would say
        return resolve.decide_for_run(self.req.args, model, facts, is_draft_worker=self.req.is_draft_worker,
                                      metadata=installed_by_metadata(), imported=self.installed,
                                      import_errors=self.import_errors)

    def _agree_across_ranks(self, r: Any, facts: Any, error: Any = None) -> None:
        """world_size > 1 with a rank group: all ranks agree on the pair (and args), or all raise
        RankDivergence; without a group the exchange is recorded as skipped. One rank: nothing to do."""
        if self.req.world_size <= 1:
            return
        if self.rank_group is None:
            if error is None:
                self.log.emit(ev.StepSkipped, state=self.state, outcome="skipped", what="rank_agreement",
                              reason=f"world_size={self.req.world_size} but no rank_group was given")
            return
        from pipeline.distributed import agree_on_resolution

        t = time.perf_counter()
        g = self.rank_group
        from pipeline.rank_digest import digest_fields

        table = agree_on_resolution(r, facts, group=g.cpu_group, rank=self.req.rank, world_size=self.req.world_size,
                                    timeout_s=g.timeout_s, args=self.req.args, error=error,
                                    digest=digest_fields(self.req, self.installed), watch=self.watch)
        if error is not None:
            return
        self.log.emit(ev.ResolutionAgreed, state=self.state, world_size=self.req.world_size, table=table,
                      duration_ms=(time.perf_counter() - t) * 1e3)

    def _workspace_bytes(self, backend: str) -> int:
        from pipeline.backends import registry

        if backend in ("flashinfer", "fa3"):
            nbytes, source = self.fi_ws
            return nbytes
        return registry.get(backend).capability.workspace_bytes

    def build(self) -> None:
        fault_point(self.faults, "state:build-mode")
        res = self.machine.model.resolution
        model = self.req.served_model
        self.kinds = model.layer_kinds()
        if {res.pair.prefill, res.pair.decode} & {"flashinfer", "fa3"}:
            self.fi_ws = settings.flashinfer_workspace_size(self.req.args, model)
            self.log.emit(ev.SettingResolved, state=self.state, field="flashinfer_workspace_size",
                          value=self.fi_ws[0], source=self.fi_ws[1], env_var="SGLANG_FLASHINFER_WORKSPACE_SIZE")
        plan = build_mode.decide(self.req.args, res.pair, is_draft_worker=self.req.is_draft_worker,
                                 workspace_bytes=self._workspace_bytes)
        self.built.plan = plan
        self.log.emit(ev.BuildPlanned, state=self.state, mode=plan.mode, hybrid=plan.hybrid,
                      instances=plan.instances, workspaces=plan.workspaces)
        self._emit_skips(plan.skips)
        self._check_workspaces(plan)
        fault_point(self.faults, "build:pools")
        self._make_pools(model)
        from pipeline.workspace import WorkspacePool

        self.workspace_pool = WorkspacePool(self.torch_device)
        for ws_plan in plan.workspaces:
            fault_point(self.faults, f"build:workspace:{ws_plan.id}", *self.pools.values())
            self.workspace_pool.allocate(ws_plan)
        with self.log.heartbeat(f"building {len(plan.instances)} backend instance(s)"):
            build_mode.apply(plan, self._make_instance, self.built)
        self.machine.model.backends = self.built
        fault_point(self.faults, "build:compose", *self.workspace_pool.workspaces)
        fault_point(self.faults, "state:build-mode:done")
        self.machine.fire("built")

    def _emit_skips(self, skips: Any) -> None:
        """A downgrade is a ``feature_downgraded`` warning; a feature that does not apply here a ``step_skipped``."""
        for s in skips:
            if s.downgrade:
                self.log.emit(ev.FeatureDowngraded, state=self.state, outcome="skipped", what=s.what, reason=s.reason,
                              avoid=dict(s.avoid))
            else:
                self.log.emit(ev.StepSkipped, state=self.state, outcome="skipped", what=s.what, reason=s.reason)

    def _graph_max_bs(self) -> int:
        return graph_max_bs_of(self.req.args, self.machine.model.resolution, self.req.pool.max_reqs)

    def _check_workspaces(self, plan: Any) -> None:
        """Refuse a FlashInfer workspace too small for the largest planned batch, or larger than the
        device's free memory, before allocating."""
        from pipeline.pool_sizing import POOL_MEMORY_SHARE, available_bytes

        total = sum(ws.bytes for ws in plan.workspaces)
        avail = available_bytes(self.platform, parse_device(self.req.device)[1]) if total else 0
        if avail and total > avail * POOL_MEMORY_SHARE:
            from pipeline.errors import ConfigError

            nbytes, source = getattr(self, "fi_ws", (None, "default"))
            name = "SGLANG_FLASHINFER_WORKSPACE_SIZE" if source == "env" else "flashinfer_workspace_size"
            per_ws = int(avail * POOL_MEMORY_SHARE) // max(len(plan.workspaces), 1)
            raise ConfigError(f"the planned workspaces need {total} bytes but {self.torch_device} has {avail} bytes "
                              f"free ({POOL_MEMORY_SHARE:.0%} of it may be used)", code="workspace_exceeds_memory",
                              flags=[(name, nbytes), ("workspaces", len(plan.workspaces)), ("available_bytes", avail)],
                              allowed=[f"<= {per_ws} bytes per workspace"],
                              remedy=f"set {name} to {per_ws} or less")

        check_before_allocation(self.req.args, self.machine.model.resolution, plan, self.kinds,
                                self.machine.model.device_facts, self.req.pool.max_reqs)

    def _make_pools(self, model: Any) -> None:
        if self.given_pools is not None:
            self._check_given_pools()
            return
        from pipeline.memory import KVPool, ReqToTokenPool, torch_dtype
        from pipeline.pool_sizing import PoolSizing, available_bytes, check_fits, kv_bytes_per_token

        p, kvd = self.req.pool, kv_dtype(self.req.args, model)
        per_tok = kv_bytes_per_token(self.kinds, model.num_hidden_layers, kvd)
        s = PoolSizing(facts=p, source="slots", budget_bytes=None, bytes_per_token=per_tok,
                       req_to_token_bytes=p.max_reqs * p.max_context_len * 4, kv_bytes=p.num_token_slots * per_tok)
        _, index = parse_device(self.req.device)
        check_fits(s, available_bytes(self.platform, index), device=str(self.torch_device), cli=False)
        self.pools["req_to_token_pool"] = ReqToTokenPool(p.max_reqs, p.max_context_len, self.torch_device)
        self.pools["kv_pool"] = KVPool.for_layer_kinds(
            self.kinds, model.num_hidden_layers, p.num_token_slots, p.page_size,
            torch_dtype(kv_dtype(self.req.args, model)), self.torch_device)

    def _check_given_pools(self) -> None:
        """Refuse engine pools that the request's ``PoolFacts`` or the model do not describe.

        The workspace bound and the backends' buffers are sized from ``request.pool`` and the layer
        kinds, so pools that differ would be read past their end or under-sized (sglang builds both
        from one ModelRunner config). Checked: both keys; ``req_to_token`` [max_reqs, max_context_len]
        int32; per model layer a K [num_token_slots, Hkv, D] and V [num_token_slots, Hkv, Dv] buffer
        of the KV dtype, on the run's device (an MLA layer's V a view of its K buffer's first Dv dims);
        ``page_size``. Raises ConfigError ``pools_mismatch``
        (naming the field, what it holds and what is needed) before any allocation.
        """
        import torch

        from pipeline.errors import ConfigError
        from pipeline.memory import torch_dtype
        from states.capability_check import kv_dtype

        remedy = ("build the pools from the same sizes as the SetupRequest's PoolFacts (max_reqs, max_context_len, "
                  "num_token_slots, page_size) and the model (KVPool.for_layer_kinds), or pass pools=None")

        def bad(field: str, have: Any, want: Any) -> ConfigError:
            return ConfigError(f"the given pools' {field} is {have!r}, this run needs {want!r}", code="pools_mismatch",
                               flags=[(f"pools.{field}", repr(have))], allowed=[repr(want)], remedy=remedy)

        pools, p, model = self.given_pools, self.req.pool, self.req.served_model
        for key in ("req_to_token_pool", "kv_pool"):
            if pools.get(key) is None:
                raise bad(key, None if key not in pools else pools[key], "a pool object")
        r2t, kv = pools["req_to_token_pool"], pools["kv_pool"]
        dev = torch.device(self.torch_device)

        def tensor(field: str, t: Any, shape: tuple, dtype: Any) -> None:
            if not isinstance(t, torch.Tensor):
                raise bad(field, type(t).__name__, f"a torch.Tensor {list(shape)} {dtype}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise bad(field, f"{list(t.shape)} {t.dtype}", f"{list(shape)} {dtype}")
            if t.device.type != dev.type or (dev.index is not None and t.device.index not in (None, dev.index)):
                raise bad(f"{field}.device", str(t.device), str(dev))

        tensor("req_to_token_pool.req_to_token", getattr(r2t, "req_to_token", None), (p.max_reqs, p.max_context_len),
               torch.int32)
        if getattr(kv, "page_size", None) != p.page_size:
            raise bad("kv_pool.page_size", getattr(kv, "page_size", None), p.page_size)
        kvd = torch_dtype(kv_dtype(self.req.args, model))
        kb, vb = getattr(kv, "k_buffer", None), getattr(kv, "v_buffer", None)
        n = model.num_hidden_layers
        for name, bufs in (("k_buffer", kb), ("v_buffer", vb)):
            if not isinstance(bufs, (list, tuple)) or len(bufs) < n:
                raise bad(f"kv_pool.{name}", f"{type(bufs).__name__} of {len(bufs) if isinstance(bufs, (list, tuple)) else '-'}",
                          f"a list of {n} per-layer buffers")
        for k in self.kinds:
            for lid in k.layer_ids:
                tensor(f"kv_pool.k_buffer[{lid}]", kb[lid], (p.num_token_slots, k.num_kv_heads, k.head_dim_qk), kvd)
                tensor(f"kv_pool.v_buffer[{lid}]", vb[lid], (p.num_token_slots, k.num_kv_heads, k.head_dim_v), kvd)
                if k.is_mla and (vb[lid].data_ptr() != kb[lid].data_ptr() or vb[lid].stride() != kb[lid].stride()):
                    raise bad(f"kv_pool.v_buffer[{lid}]", "a separate tensor",
                              f"a view of the first {k.head_dim_v} dims of k_buffer[{lid}] (one latent buffer per "
                              "MLA layer, as sglang's MLATokenToKVPool; KVPool.for_layer_kinds builds it)")

    def _make_instance(self, inst: InstancePlan) -> Any:
        from pipeline.backends.registry import get

        ws = self.workspace_pool.get(inst.workspace) if inst.workspace else None
        ctx = backend_context(inst, self.req, self.req.served_model, self.kinds, self.machine.model.device_facts,
                              self.torch_device, self.pools, ws, self._graph_max_bs())
        fault_point(self.faults, f"build:instance:{inst.role}", *([ws] if ws is not None else []))
        t = time.perf_counter()
        backend = get(inst.backend).load_factory()(ctx)
        if self.faults is not None:
            self._fault_after_factory(inst.role, backend)
        self.log.emit(ev.BackendBuilt, state=self.state, role=inst.role, backend=inst.backend,
                      duration_ms=(time.perf_counter() - t) * 1e3)
        return backend

    def _fault_after_factory(self, role: str, backend: Any) -> None:
        """Test-only: a fault right after a factory returned closes the backend that nobody holds yet."""
        try:
            fault_point(self.faults, f"build:instance:{role}:built", backend)
        except BaseException:
            close = getattr(backend, "close", None)
            if close is not None:
                close()
            raise

    def npu_lazy_mem(self) -> None:
        fault_point(self.faults, "state:npu-lazy-mem")
        size, source = settings.zbal_local_mem_size(self.req.args)
        self.log.emit(ev.SettingResolved, state=self.state, field="zbal_local_mem_size", value=size, source=source,
                      env_var="SGLANG_ZBAL_LOCAL_MEM_SIZE")
        d = npu_lazy_mem.decide(self.platform.device_type, size, source, self.req.is_draft_worker)
        npu_lazy_mem.apply(self.platform, d, self.req.rank, self.req.world_size, self.cpu_group)
        if d.run:
            self.log.emit(ev.LazyMemInitialized, state=self.state, bytes=d.nbytes, rank_arg=self.req.rank,
                          world_size=self.req.world_size)
            self.machine.model.lazy_mem = "done"
        else:
            self.log.emit(ev.StepSkipped, state=self.state, outcome="skipped", what="npu_lazy_mem", reason=d.reason)
            self.machine.model.lazy_mem = d.reason
        fault_point(self.faults, "state:npu-lazy-mem:done")
        self.machine.fire("lazy_mem_settled")

    def annotate(self) -> AttentionBackends:
        fault_point(self.faults, "state:annotate")
        pair = self.machine.model.resolution.pair
        annotate.apply(self.built.attn_backend, pair)
        self.log.emit(ev.BackendsAnnotated, state=self.state, target=type(self.built.attn_backend).__name__,
                      prefill=pair.prefill, decode=pair.decode)
        self.machine.model.names_set = True
        fault_point(self.faults, "state:annotate:done")
        self.machine.fire("annotated")
        res = self.machine.model.resolution
        return AttentionBackends(
            attn_backend=self.built.attn_backend, decode_attn_backend=self.built.decode_attn_backend,
            decode_attn_backend_group=list(self.built.decode_attn_backend_group),
            prefill_attention_backend_str=pair.prefill, decode_attention_backend_str=pair.decode,
            run_id=self.log.run_id, resolution=res, plan=self.built.plan,
            skips=list(res.skips) + list(self.built.plan.skips), instances=dict(self.built.instances),
            pools={} if self.given_pools is not None else self.pools, workspace_pool=self.workspace_pool,
            events=self.log.records, torch_device=self.torch_device, device_facts=self.machine.model.device_facts)

    def fail(self, exc: BaseException) -> None:
        state = self.state
        info = error_info_from(exc, state)
        released = release(self.built.instances, self.workspace_pool, {} if self.given_pools is not None else self.pools)
        # Drop every reference this run holds, so a caller keeping the exception (and with it these
        # frames) keeps no device memory alive either.
        self.built.attn_backend = self.built.decode_attn_backend = None
        self.built.decode_attn_backend_group = []
        self.workspace_pool, self.pools = None, {}
        if self.machine.state not in (State.DONE, State.FAILED):
            self.machine.fire("fail")
        if released:
            self.log.emit(ev.ResourcesReleased, state=State.FAILED.value, released=released)
        self.log.emit(ev.RunFailed, state=State.FAILED.value, outcome="failed", error=info, released=released)


def backend_context(inst: InstancePlan, request: SetupRequest, model: Any, kinds: list[Any], facts: Any,
                    torch_device: str, pools: Mapping[str, Any], workspace: Any, max_graph_bs: int) -> Any:
    """The :class:`~pipeline.backends.registry.BackendContext` a factory gets for one planned instance."""
    from pipeline.backends.registry import BackendContext

    return BackendContext(name=inst.backend, role=inst.role, device=facts, torch_device=torch_device, model=model,
                          layer_kinds=kinds, args=request.args, req_to_token_pool=pools["req_to_token_pool"],
                          kv_pool=pools["kv_pool"], workspace=workspace, dtype=model_dtype(request.args, model),
                          extra={"cuda_graph_max_bs": max_graph_bs})


def build_like(backends: AttentionBackends, request: SetupRequest, model: Any,
               pools: Optional[Mapping[str, Any]] = None) -> build_mode.Built:
    """Build ``backends``' plan again for ``model``: the same instances (roles, backends, mode, wrappers).

    ``model`` must have the layers of the served model (same ids and dims); what may differ is a
    per-kind parameter the backends bake in, e.g. the shrunk sliding windows of
    :func:`pipeline.verify.verification_model`, so that a check runs on instances built for exactly
    the layers it calls them with. Each instance gets the factory, role, device facts, workspace
    (the same buffer: the copies run only while the originals are idle) and pools
    (``pools`` or ``backends.pools``) of the original build; the build-mode refusals of the factories
    apply again. No pipeline event is logged. Returns a :class:`states.build_mode.Built`; the caller
    closes its ``instances`` (they own no workspace or pool). Raises what a factory raises, after
    closing the instances already built.
    """
    from pipeline.backends.registry import get

    pools = pools if pools is not None else backends.pools
    kinds, plan = model.layer_kinds(), backends.plan
    max_graph_bs = graph_max_bs_of(request.args, backends.resolution, request.pool.max_reqs)
    ws_pool = backends.workspace_pool

    def make(inst: InstancePlan) -> Any:
        ws = ws_pool.get(inst.workspace) if inst.workspace else None
        ctx = backend_context(inst, request, model, kinds, backends.device_facts, backends.torch_device, pools, ws,
                              max_graph_bs)
        return get(inst.backend).load_factory()(ctx)

    built = build_mode.Built(plan=plan)
    try:
        return build_mode.apply(plan, make, built)
    except BaseException:
        release(built.instances, None, {})
        raise


def open_event_log(run_id: str, rank: int, log_file: Any, secrets: tuple[str, ...] = (),
                   name: str = "log_file") -> EventLog:
    """The EventLog for a library call's ``log_file=`` argument, checked before anything runs.

    ``log_file`` is None (no trace file) or a path (str / os.PathLike) that is absent or a regular
    file; its parent folders are created. Raises :class:`UsageError` (``log_file_unwritable``,
    exit 2) naming ``name`` for another type, a directory, a device, FIFO or socket (``/dev/full``
    takes the open and fails every write; a FIFO blocks the open until a reader comes), or a path
    that cannot be opened for appending.
    """
    import os
    import stat

    from pipeline.errors import UsageError

    if log_file is None:
        return EventLog(run_id, rank, None, secrets=secrets)

    def bad(why: str) -> UsageError:
        return UsageError(f"{name}={os.fspath(log_file) if isinstance(log_file, (str, os.PathLike)) else log_file!r} "
                          f"{why}", code="log_file_unwritable", flags=[(name, str(log_file))],
                          allowed=["a path to a regular file (created if absent)"],
                          remedy=f"pass {name}= a writable file path such as logs/attn.rank0.jsonl, or None")

    if not isinstance(log_file, (str, os.PathLike)) or isinstance(log_file, bytes) or not os.fspath(log_file):
        raise bad("is not a file path")
    try:
        mode = os.stat(log_file).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise bad(f"cannot be checked: {e.strerror or e}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise bad("is a directory")
    if mode is not None and not stat.S_ISREG(mode):
        raise bad("is not a regular file (a device, FIFO or socket)")
    try:
        return EventLog(run_id, rank, log_file, secrets=secrets)
    except OSError as e:
        raise bad(f"cannot be opened for appending: {e.strerror or e}") from None


def release(instances: dict[str, Any], workspace_pool: Any, pools: dict[str, Any]) -> list[str]:
    """Close every backend, drop every workspace and pool; returns what was released."""
    released = []
    for role, b in list(instances.items()):
        close = getattr(b, "close", None)
        if close is not None:
            close()
        released.append(f"backend:{role}")
    instances.clear()
    if workspace_pool is not None:
        released += [f"workspace:{w}" for w in workspace_pool.release_all()]
    for name in list(pools):
        released.append(f"pool:{name}")
        pools.pop(name)
    return released


def workspace_bytes_for(request: SetupRequest) -> Any:
    """``backend -> bytes`` of workspace for build-mode's plan (FlashInfer's from :mod:`pipeline.settings`)."""
    from pipeline.backends import registry

    def need(backend: str) -> int:
        if backend in build_mode.FLASHINFER_BACKENDS:
            return settings.flashinfer_workspace_size(request.args, request.served_model)[0]
        return registry.get(backend).capability.workspace_bytes

    return need


def graph_max_bs_of(args: Any, res: Any, max_reqs: int) -> int:
    """The largest decode batch a graph is captured for, 0 when graphs are off or skipped (``res.skips``)."""
    from pipeline.cuda_graphs import graph_max_bs

    captured = not args.disable_cuda_graph and not any(s.what == "cuda_graph" for s in res.skips)
    return graph_max_bs(args, max_reqs, captured)


def check_before_allocation(args: Any, res: Any, plan: Any, kinds: Any, device: Any, max_reqs: int) -> None:
    """Build-mode's checks that need no device: CUDA-graph sizes within ``max_reqs`` (on every device) and each
    FlashInfer workspace against the largest batch its users plan (graph sizes actually captured).
    Raises ConfigError (``invalid_value`` / ``workspace_too_small``, state build-mode)."""
    from pipeline.cuda_graphs import check_graph_bs

    check_graph_bs(args, max_reqs)
    build_mode.check_workspaces(plan, kinds, num_sms=device.sm_count, max_reqs=max_reqs,
                                graph_max_bs=graph_max_bs_of(args, res, max_reqs),
                                graph_bs_given=bool(args.cuda_graph_bs))


def decide_offline(request: SetupRequest, device: Any, installed: Mapping[str, bool]) -> tuple[Any, Any]:
    """Every decision up to allocation, with no device touched: ``(Resolution, BuildPlan)``.

    resolve (``strict`` included), build-mode's plan, the CUDA-graph sizes against ``max_reqs``
    (:func:`pipeline.cuda_graphs.capture_batch_sizes`) and each FlashInfer workspace against the
    largest batch it will plan (:func:`states.build_mode.check_workspaces`) — the same rules
    :func:`build_attention_backends` applies. ``attn-setup plan`` and ``run``'s preflight call this so
    a configuration build-mode or graph capture would refuse is refused before the model loads.
    Raises the typed ConfigError of the first refusal.
    """
    args, model = request.args, request.served_model
    res = resolve.decide(args, model, device, is_draft_worker=request.is_draft_worker, installed=installed)
    plan = build_mode.decide(args, res.pair, is_draft_worker=request.is_draft_worker,
                             workspace_bytes=workspace_bytes_for(request))
    check_before_allocation(args, res, plan, model.layer_kinds(), device, request.pool.max_reqs)
    return res, plan


def build_attention_backends(request: SetupRequest, *, platform: Optional[Platform] = None,
                             log: Optional[EventLog] = None, log_file: Optional[str] = None,
                             pools: Optional[dict[str, Any]] = None,
                             installed: Optional[Mapping[str, bool]] = None,
                             cpu_group: Any = None, rank_group: Any = None,
                             faults: Optional[Faults] = None) -> AttentionBackends:
    """Run ``device-init → resolve → build-mode → npu-lazy-mem → annotate → done``.

    Parameters
    ----------
    request: the immutable inputs (args, model, pools' sizes, device, rank …).
    platform: the device platform (default: chosen from ``request.device``); tests pass a fake.
    log / log_file: an :class:`EventLog` to emit to, or a JSON-lines trace path for a new one
        (checked before anything runs: :func:`open_event_log`).
    pools: the engine's own KV pools ``{"req_to_token_pool": …, "kv_pool": …}`` (sglang builds
        them before the backends); default: built here from ``request.pool``.
    installed: package presence override (default: real imports of torch/triton/flashinfer).
    cpu_group: the world's CPU process group, passed to NPU lazy memory init.
    rank_group: a :class:`pipeline.distributed.RankGroup` (from ``init_from_env()``) when
        ``request.world_size > 1``: device-init checks the rank's own device, resolve exchanges
        the resolution with every rank (``ranks_agreed``, or :class:`RankDivergence` on all ranks),
        its run id is used when ``request.run_id`` is None, its CPU group when ``cpu_group`` is None.
    faults: test-only fault injection (:class:`pipeline.faults.Faults`); None in shipped code.

    Returns :class:`AttentionBackends`. Raises the typed error that failed the run (ConfigError
    subclasses for refused configurations, BuildError …) after the machine entered ``failed``,
    the failure was logged with its ErrorInfo, and everything allocated was released;
    :class:`UsageError` before the machine starts for a request that is not a SetupRequest, pools
    that are not a dict, or a ``log_file`` that cannot be a trace file.
    """
    if not isinstance(request, SetupRequest):
        from pipeline.errors import UsageError

        raise UsageError(f"build_attention_backends needs a SetupRequest, got {type(request).__name__}",
                         code="usage", flags=[("request", type(request).__name__)], allowed=["SetupRequest"],
                         remedy="build one: SetupRequest(args=AttentionArgs(...), model=load_model_spec(path))")
    if pools is not None and not isinstance(pools, Mapping):
        from pipeline.errors import UsageError

        raise UsageError(f"pools must be a dict of the engine's pools, got {type(pools).__name__}", code="usage",
                         flags=[("pools", type(pools).__name__)],
                         allowed=["{'req_to_token_pool': ReqToTokenPool, 'kv_pool': KVPool}", "None"],
                         remedy="pass pools=None to let the pipeline build them")
    run_id = request.run_id or (log.run_id if log else None) or getattr(rank_group, "run_id", None) or new_run_id()
    own_log = log is None
    log = log or open_event_log(run_id, request.rank, log_file, tuple(request.secrets.values()))
    run = None
    try:
        run = _Run(request, platform, log, pools, installed, cpu_group, faults, rank_group)
        if run.watch is not None:  # heartbeats for the whole run, so a peer waiting on us can say where we are
            run._beats = run.watch.running(log)
            run._beats.__enter__()
        log.emit(ev.RunStarted, state=run.state, request=redacted_request(request),
                 versions=versions(run.installed), packages=run.installed,
                 platform=type(run.platform).__name__)
        run.device_init()
        run.resolve()
        run.build()
        run.npu_lazy_mem()
        result = run.annotate()
        log.emit(ev.RunFinished, state=State.DONE.value, duration_ms=(time.perf_counter() - run.t0) * 1e3)
        return result
    except BaseException as exc:
        if run is None:
            info = error_info_from(exc, "device-init")
            log.emit(ev.RunFailed, state=State.FAILED.value, outcome="failed", error=info)
        else:
            run.fail(exc)
        # The traceback's frames (factories, states) still reference pools, workspaces and backends;
        # clear their locals so a caller who keeps the exception keeps no device memory alive.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        if run is not None and run._beats is not None:
            run._beats.__exit__(None, None, None)
        if own_log:
            log.close()
