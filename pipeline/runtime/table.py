"""The runner's machine as one table (a model runner's ``initialize()``), each step's decision and effect
(docs/internals.md)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import msgspec

from pipeline.core import events as ev, settings
from pipeline.core.dtypes import kv_dtype, model_dtype
from pipeline.core.errors import ConfigError
from pipeline.core.layer_span import span_fields, span_of
from pipeline.core.spec import attention_layer_ids, truncate_spec
from pipeline.core.steps import Guard, Step, StepTable
from pipeline.memory.pools import (available_bytes, budget_from_fraction, check_fits, check_mem_fraction,
    POOL_MEMORY_SHARE, remedy_available, size_pools)


def served_field(req: Any, spec: Any) -> dict[str, Any]:
    """``{model or draft_model: spec}``: the field of ``req`` holding the model it serves."""
    return {"draft_model": spec} if req.is_draft_worker and req.draft_model is not None else {"model": spec}


# -- init-memory-pool: req_to_token and the per-layer K/V buffers, sized from the budget -----------------------
def decide_pools(r: Any) -> Any:
    """The pool sizes (slots > bytes > fraction of device memory less weights), refused above the device's memory or
    free share or below ``config.min_token_slots``; a ``mem_fraction`` outside (0, 1] is refused with
    :func:`fraction_remedy`.

    With decode graphs the platform's ``prime_graph_capture`` runs first so the budget is read after those one-time
    costs (kept in ``r.capture_prime_bytes``). Planned FlashInfer workspaces count with pools and graphs: above 90 % of
    free memory alone they are refused (``workspace_exceeds_memory``), then the sum by :func:`size_for`.
    """
    cfg = r.config
    if cfg.mem_fraction is not None:
        try:
            check_mem_fraction(cfg.mem_fraction)
        except ConfigError as e:  # "such as 0.8" is not true everywhere (0.8 of a CPU host's memory is refused)
            raise ConfigError(f"--mem-fraction {cfg.mem_fraction} is outside (0, 1]", code=e.info.code,
                              flags=[("mem_fraction", cfg.mem_fraction)], allowed=list(e.info.allowed),
                              remedy=fraction_remedy(r.platform, r.index, cfg, r.load.spec,
                                                     graph_reserve_bytes(r, r.load.spec),
                                                     workspace_bytes(r, r.load.spec))) from None
    reserve, ws = graph_reserve_bytes(r, r.load.spec), workspace_bytes(r, r.load.spec)
    if ws:  # before the prime: the budget's free-memory read comes right after it
        from pipeline.memory.workspaces import check_workspaces_fit

        req, d = setup_decided(r, r.load.spec)
        check_workspaces_fit(req, d["build-mode"], d["device-init"].facts, available_bytes(r.platform, r.index),
                             graph_bytes=reserve, device=r.platform.torch_device(r.index))
    prime = getattr(r.platform, "prime_graph_capture", None)
    if reserve and prime is not None:  # graphs will be captured: pay their one-time process costs, then read memory
        # summed: preflight decides this step too, and only the first call pays (later calls return 0)
        r.capture_prime_bytes = getattr(r, "capture_prime_bytes", 0) + prime(r.index)
    return size_for(r.platform, r.index, cfg, r.load.spec, graph_reserve=reserve, graphs=graph_trial_of(r, r.load.spec),
                    workspace=ws)


def setup_decided(r: Any, spec: Any) -> Any:
    """``(request, decided)``: :func:`pipeline.setup.build.decide_setup` for this run's request serving ``spec``, before
    pool sizing; cached on ``r``."""
    kept = getattr(r, "setup_decided_for", None)
    if kept is not None and kept[0] is spec:
        return kept[1]
    from pipeline.setup.build import decide_setup

    req = msgspec.structs.replace(r.config.request, **served_field(r.config.request, spec))
    out = (req, decide_setup(req, platform=r.platform, installed=r.installed, rank_group=r.rank_group))
    r.setup_decided_for = (spec, out)
    return out


def _workspaces_possible(device_type: str) -> bool:
    """Whether a backend with a workspace (FlashInfer, FA3) can be built on ``device_type`` at all: a CPU run then
    resolves once, for its attention step only (``tests/test_cli_run.py``)."""
    from pipeline.backends import registry

    return any(device_type in e.capability.devices and (e.capability.workspace_bytes or e.rules.workspace)
               for e in map(registry.get, registry.names()))


def workspace_bytes(r: Any, spec: Any) -> int:
    """Bytes of the FlashInfer workspaces build-mode plans for this run serving ``spec`` (0: none, or the setup is
    refused — the attention step raises that at its own state): the bytes ``plan`` counts with the pools."""
    if not _workspaces_possible(r.platform.device_facts(r.index).type):
        return 0
    try:
        return setup_decided(r, spec)[1]["build-mode"].plan.workspace_bytes
    except Exception:  # noqa: BLE001 - a refused setup decision (no build-mode): refused later, where it belongs
        return 0


def graph_estimate(r: Any, spec: Any) -> Any:
    """The decode graphs' estimated memory (:class:`pipeline.memory.graphs.GraphMemoryEstimate`) for the built ``spec``,
    from :func:`pipeline.setup.build.decide_setup`; None without graphs or when the setup is refused. Cached on ``r``.
    """
    from states.build_mode import decide_graphs

    cfg = r.config
    kept = getattr(r, "graph_estimate_for", None)
    if kept is not None and kept[0] is spec:
        return kept[1]
    est = None
    if decide_graphs(cfg.request.args, r.platform.device_facts(r.index).type, []).capture:
        from pipeline.memory.graphs import estimate_for_decided, graph_trial

        req, decided = setup_decided(r, spec)
        est = _bound_if_beyond_device(r, req, decided) or \
            estimate_for_decided(req, decided, aux_layers=cfg.aux_hidden_state_layers or ())
        r.graph_trial_for = (spec, graph_trial(req, decided, est, aux_layers=cfg.aux_hidden_state_layers or ()))
    r.graph_estimate_for = (spec, est)
    return est


def _bound_if_beyond_device(r: Any, req: Any, decided: Any) -> Any:
    """The graphs' closed-form lower bound when it alone exceeds the pools' share of device memory, else None (then the
    per-size estimate is never built; ``plan`` refuses the same way)."""
    from pipeline.memory.graphs import lower_bound_for_decided

    total = r.platform.device_facts(r.index).total_memory_bytes
    bound = lower_bound_for_decided(req, decided, aux_layers=r.config.aux_hidden_state_layers or ())
    return bound if bound is not None and total and bound.total_bytes > total * POOL_MEMORY_SHARE else None


def graph_trial_of(r: Any, spec: Any) -> Any:
    """The graphs :func:`graph_estimate` estimated for ``spec``, as a :class:`pipeline.memory.pools.GraphTrial`
    (their estimate at a lower top, for a pool remedy that lowers it); None without graphs."""
    graph_estimate(r, spec)
    kept = getattr(r, "graph_trial_for", None)
    return kept[1] if kept is not None and kept[0] is spec else None


def graph_reserve_bytes(r: Any, spec: Any) -> int:
    """Bytes :func:`graph_estimate` sets aside (0 without graphs)."""
    est = graph_estimate(r, spec)
    return 0 if est is None else est.total_bytes


def size_for(platform: Any, index: int, cfg: Any, spec: Any, graph_reserve: int = 0, spare: bool = False,
             graphs: Any = None, workspace: int = 0) -> Any:
    """:func:`decide_pools`' sizing for ``cfg`` and the built ``spec`` on ``platform``'s device ``index``; allocates
    nothing.

    Raises the sizing's ConfigError (``invalid_value`` for ``--mem-bytes`` above the device's total).
    ``config.min_token_slots`` binds every pool. ``graph_reserve``: graph bytes out of a ``mem_fraction`` budget;
    ``spare``: check against free memory less :func:`~pipeline.memory.pools.remedy_margin`; ``graphs``: for a remedy
    lowering them; ``workspace``: counted against free memory outside the budget (as sglang). Every remedy is inside its
    flags' domains.
    """
    req = cfg.request
    p, facts = req.pool, platform.device_facts(index)
    if cfg.mem_bytes is not None and facts.total_memory_bytes and cfg.mem_bytes > facts.total_memory_bytes:
        fit = min(int(remedy_available(available_bytes(platform, index)) * POOL_MEMORY_SHARE) - graph_reserve
                  - workspace,
                  facts.total_memory_bytes)
        raise ConfigError(f"--mem-bytes {cfg.mem_bytes} exceeds the device's {facts.total_memory_bytes} bytes",
                          code="invalid_value", flags=[("mem_bytes", cfg.mem_bytes)],
                          allowed=[f"<= {facts.total_memory_bytes}"],
                          remedy=(f"pass --mem-bytes {fit} or less (what fits the memory free now, with a margin), "
                                  "or use --mem-fraction" if fit > 0 else
                                  "free memory on the device, or drop --mem-bytes"))
    budget, source, total, allocated = cfg.mem_bytes, "bytes", 0, platform.memory_allocated(index)
    if cfg.num_token_slots is None and budget is None and cfg.mem_fraction is not None:
        total = facts.total_memory_bytes
        budget, source = budget_from_fraction(cfg.mem_fraction, total, allocated), "mem_fraction"
    slots = cfg.num_token_slots if cfg.num_token_slots is not None else (None if budget is not None else
                                                                         p.num_token_slots)
    s = size_pools(spec.layer_kinds(), spec.num_hidden_layers, kv_dtype(req.args, spec), page_size=req.args.page_size,
                   max_reqs=p.max_reqs, max_context_len=p.max_context_len, num_token_slots=slots,
                   budget_bytes=budget, source=source,
                   mem_fraction=cfg.mem_fraction, min_slots=cfg.min_token_slots, min_slots_for=cfg.min_token_slots_for,
                   graph_reserve_bytes=graph_reserve, workspace_bytes=workspace, total_bytes=total,
                   allocated_bytes=allocated, min_context_len=cfg.min_context_len)
    avail = available_bytes(platform, index)
    check_fits(s, remedy_available(avail) if spare else avail, device=platform.torch_device(index), total_bytes=total,
               allocated_bytes=allocated, mem_fraction=cfg.mem_fraction,
               graph_top=req.args.cuda_graph_max_bs or max(req.args.cuda_graph_bs or [0]), graphs=graphs,
               min_slots=cfg.min_token_slots, min_context_len=cfg.min_context_len)
    return s


def fraction_remedy(platform: Any, index: int, cfg: Any, spec: Any, graph_reserve: int = 0, workspace: int = 0) -> str:
    """A ``--mem-fraction`` remedy that is true on this device: the largest share (in hundredths, up to 0.9) whose
    pools both hold ``cfg.min_token_slots`` and fit its free memory less a margin (:func:`size_for` with ``spare``,
    sizing only — nothing is allocated), or, when none does, the default sizing (drop the flag)."""
    import dataclasses

    for pct in range(90, 0, -1):
        try:
            size_for(platform, index, dataclasses.replace(cfg, mem_fraction=pct / 100), spec, graph_reserve, spare=True,
                     workspace=workspace)
        except ConfigError:
            continue
        return (f"pass --mem-fraction {pct / 100:g} or less (the largest share of this device's memory whose "
                "pools fit and hold the verification batches; sglang's mem_fraction_static), or drop it")
    return "drop --mem-fraction (the pools are then sized from --num-token-slots)"


def alloc_pools(r: Any, s: Any) -> None:
    """Allocate ``req_to_token`` and the K/V buffers; log tokens and bytes; the request then carries the sizes."""
    from pipeline.backends.memory import KVPool, ReqToTokenPool, torch_dtype

    req, p, dev = r.request, s.facts, r.platform.torch_device(r.index)
    model = req.served_model
    pools = {"req_to_token_pool": ReqToTokenPool(p.max_reqs, p.max_context_len, dev)}
    pools["kv_pool"] = KVPool.for_layer_kinds(model.layer_kinds(), model.num_hidden_layers, p.num_token_slots,
                                              p.page_size, torch_dtype(kv_dtype(req.args, model)), dev)
    r.sizing, r.request = s, msgspec.structs.replace(req, pool=p)
    r.emit(ev.MemoryPoolSized, source=s.source, budget_bytes=s.budget_bytes, bytes_per_token=s.bytes_per_token,
           num_token_slots=p.num_token_slots, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
           page_size=p.page_size, req_to_token_bytes=s.req_to_token_bytes, kv_bytes=s.kv_bytes,
           graph_bytes_estimate=s.graph_reserve_bytes)
    r.machine.model.pools = pools


class LoadDecision(NamedTuple):
    """load-model's decision: the compute dtype and the spec of the layers built (the first ``num_layers``)."""

    dtype: str
    spec: Any


class CaptureDecision(NamedTuple):
    """capture-cuda-graphs' decision: the setup's :class:`states.build_mode.GraphDecision` and the batch sizes."""

    graphs: Any
    sizes: list[int]


CAPTURE_PRECONDITIONS: tuple[Guard, ...] = (
    Guard("attention_done", "the attention pipeline reached 'done'", "attention"),
    Guard("lazy_mem_settled", "NPU zbal lazy memory was initialised, or skipped with a recorded reason",
          "attention (npu-lazy-mem)"),
    Guard("aux_hidden_set", "the configured aux hidden-state layers (EAGLE3) are set on the model", "load-model"),
    Guard("kv_pool_exists", "req_to_token and the K/V buffers exist", "init-memory-pool"),
    Guard("ranks_agreed", "every rank resolved the same attention backends (or one rank)", "attention (rank agreement)"),
)


class RunnerModel:
    """What each runner step produced; the guards read only this."""

    def __init__(self) -> None:
        self.world: Any = None           # (rank, world_size, cpu_group)
        self.stack: Any = None           # AttentionStack
        self.aux_configured: Optional[list[int]] = None
        self.pools: Optional[dict[str, Any]] = None
        self.backends: Any = None        # AttentionBackends
        self.lazy_mem: Optional[str] = None  # "done" or the recorded skip reason
        self.agreement: Optional[str] = None  # detail of the rank agreement
        self.graphs: Any = None          # DecodeGraphRunner, or the recorded skip reason (str)
        self.state: Any = None

    def has_world(self) -> bool:
        return self.world is not None

    def has_model(self) -> bool:
        return self.stack is not None

    def kv_pool_exists(self) -> bool:
        return bool(self.pools) and self.pools.get("kv_pool") is not None and \
            self.pools.get("req_to_token_pool") is not None

    def attention_done(self) -> bool:
        return self.backends is not None and not getattr(self.backends, "closed", False)

    def lazy_mem_settled(self) -> bool:
        return bool(self.lazy_mem)

    def aux_hidden_set(self) -> bool:
        if not self.aux_configured:
            return True
        return self.stack is not None and self.stack.aux_hidden_state_layers == list(self.aux_configured)

    def ranks_agreed(self) -> bool:
        return bool(self.agreement)

    def graphs_outcome(self) -> bool:
        return self.graphs is not None


# -- init-distributed: rank, world size and the CPU group ------------------------------------------------------
def init_distributed(r: Any, _: Any) -> None:
    """Record rank, world size and the CPU group (a gloo group when torch.distributed is up)."""
    req, group, source = r.request, r.cpu_group, "arguments"
    if req.world_size > 1 and group is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (req.rank, req.world_size):
                raise ConfigError("torch.distributed disagrees with the request's rank/world_size",
                                  code="invalid_value", flags=[("rank", req.rank), ("world_size", req.world_size)],
                                  allowed=[f"rank={dist.get_rank()}, world_size={dist.get_world_size()}"],
                                  remedy="pass the process group's rank and world size")
            group, source = dist.new_group(backend="gloo"), "torch.distributed"
    r.cpu_group = group
    r.emit(ev.DistributedInitialized, world_size=req.world_size, has_cpu_group=group is not None, source=source)
    r.machine.model.world = (req.rank, req.world_size, group)


# -- load-model: the attention stack of the first num_layers attention layers --------------------------------
def decide_model(r: Any) -> LoadDecision:
    """The compute dtype (refused here for a model type that refuses it) and the layers to build (refused here
    when ``num_layers`` is outside the model's attention layers)."""
    served = r.config.request.served_model
    dtype = model_dtype(r.config.request.args, served)
    if not attention_layer_ids(served):  # nothing to cut: the setup machine refuses a model without attention
        return LoadDecision(dtype=dtype, spec=served)
    spec = truncate_spec(served, r.config.num_layers)
    _check_weights(r, served, dtype)
    return LoadDecision(dtype=dtype, spec=spec)


def _check_weights(r: Any, served: Any, dtype: str) -> None:
    """The stack's weights and their float64 reference against the memory free now (weights_exceed_memory);
    :mod:`pipeline.memory.pools`."""
    from pipeline.platforms.cpu import host_available_bytes
    from pipeline.memory.pools import check_weights_fit

    n = r.config.num_layers if r.config.num_layers is not None else len(attention_layer_ids(served))
    on_host = r.platform.torch_device(r.index) == "cpu"
    host = host_available_bytes()
    check_weights_fit(served, n, dtype, device_free=host if on_host else available_bytes(r.platform, r.index),
                      host_free=host, on_host=on_host, device=r.platform.torch_device(r.index))


def load_model(r: Any, d: LoadDecision) -> None:
    """Build the attention stack (seeded weights) and set the EAGLE3 aux layers; the request then serves its spec."""
    from pipeline.backends.memory import torch_dtype
    from pipeline.runtime.model import AttentionStack

    req, cfg = r.request, r.config
    # the device must exist before weights go to it: a typed device_unavailable, as the CLI and
    # build_attention_backends give, instead of torch's raw "Torch not compiled with CUDA enabled"
    r.platform.device_facts(r.index)
    stack = AttentionStack(d.spec, dtype=torch_dtype(d.dtype), device=r.platform.torch_device(r.index), seed=cfg.seed)
    if cfg.aux_hidden_state_layers:
        stack.set_aux_hidden_state_layers(cfg.aux_hidden_state_layers)
    r.request = msgspec.structs.replace(req, **served_field(req, stack.spec))
    span = span_fields(span_of(stack.spec, req.served_model))
    r.emit(ev.ModelLoaded, num_layers=stack.num_layers, num_hidden_layers=req.served_model.num_hidden_layers,
           param_bytes=stack.param_bytes(), dtype=d.dtype, seed=cfg.seed, aux_hidden_state_layers=stack.aux_hidden_state_layers,
           **span)
    m = r.machine.model
    m.stack, m.aux_configured = stack, list(cfg.aux_hidden_state_layers or []) or None


# -- attention: the setup machine over this runner's pools ------------------------------------------------------
def attention_request(r: Any) -> Any:
    """The request the setup machine gets: the spec load-model builds, the pool sizes init-memory-pool chose."""
    req = r.config.request
    return msgspec.structs.replace(req, pool=r.pools_decided.facts, **served_field(req, r.load.spec))


def decide_attention(r: Any) -> Any:
    """Every setup decision up to allocation, for the request this runner will build (a refusal is kept, not raised:
    the setup machine raises it at its own state, so the log shows where)."""
    from pipeline.setup.build import decide_setup

    return decide_setup(attention_request(r), platform=r.platform, installed=r.installed, rank_group=r.rank_group)


def build_attention(r: Any, decided: Any) -> None:
    """Run the setup machine over this runner's pools (its decisions taken, not made again), then read how NPU lazy
    memory and the ranks' agreement came out of it."""
    from pipeline.setup.build import build_attention_backends

    m = r.machine.model
    try:
        out = build_attention_backends(r.request, platform=r.platform, log=r.log, pools=m.pools, installed=r.installed,
                                       cpu_group=r.cpu_group, rank_group=r.rank_group, decided=decided)
    except BaseException:
        r.setup_failed = True  # the setup machine logged its run_failed
        raise
    m.backends = out
    m.lazy_mem = "done" if out.lazy_mem.run else out.lazy_mem.reason
    m.agreement = r.agreement_of(out)


# -- capture-cuda-graphs: decode graphs, or skipped with the setup's reason -----------------------------------
def decide_capture(r: Any) -> CaptureDecision:
    """Whether decode graphs are captured — as the setup machine decided (one rule: :mod:`states.build_mode`) — and for
    which batch sizes."""
    from states.build_mode import capture_batch_sizes

    out = r.machine.model.backends
    g = out.graphs if out is not None else r.attention["build-mode"].graphs
    req = r.request if out is not None else attention_request(r)
    facts = out.device_facts if out is not None else r.attention["device-init"].facts
    return CaptureDecision(graphs=g, sizes=capture_batch_sizes(req.args, req.pool.max_reqs, device=facts,
                                                               world_size=req.tp_size) if g.capture else [])


def capture(r: Any, d: CaptureDecision) -> None:
    """Capture decode graphs for the decided sizes, or record the skip with its reason."""
    from pipeline.runtime import cuda_graphs

    m = r.machine.model
    if not d.graphs.capture:
        r.emit(ev.StepSkipped, outcome="skipped", what="cuda_graph_capture", reason=d.graphs.reason)
        m.graphs = d.graphs.reason
        return
    from pipeline.core.contracts import ForwardMode
    from states.build_mode import graph_backend, graph_mode

    res = m.backends.resolution
    spec = None if res is None else res.speculative
    mode = ForwardMode(graph_mode(spec, r.request.is_draft_worker))  # a speculative worker captures its own step
    backend = graph_backend(m.backends.resolution.pair, spec, r.request.is_draft_worker) if res is not None \
        else m.backends.decode_attention_backend_str
    _barrier_before_capture(r)
    g = cuda_graphs.DecodeGraphRunner(m.stack, r.backend_for(mode.is_decode_like), m.pools["req_to_token_pool"],
                                      m.pools["kv_pool"], d.sizes, mode=mode, spec=spec)
    m.graphs = g
    est = graph_estimate(r, m.stack.spec)
    per_bs = {} if est is None else est.per_bs
    with r.log.heartbeat(f"capturing {mode.value} CUDA graphs for bs {', '.join(map(str, d.sizes))}"):
        g.capture(lambda bs, ms: r.emit(ev.CudaGraphCaptured, bs=bs, capture_ms=ms, backend=backend,
                                        graph_bytes=g.graph_bytes[bs], device_bytes=g.device_bytes[bs],
                                        graph_bytes_estimate=per_bs.get(bs, 0), mode=mode.value))
    if est is not None:  # the whole step against the estimate, part by part
        r.emit(ev.CudaGraphMemory, backend=backend, batch_sizes=list(d.sizes), pool_estimate=est.pool_bytes,
               state_estimate=est.state_bytes, warmup_estimate=est.warmup_bytes,
               blas_workspace_bytes=est.blas_workspace_bytes, total_estimate=est.total_bytes,
               pool_bytes=sum(g.graph_bytes.values()), step_device_bytes=g.step_device_bytes,
               prime_device_bytes=getattr(r, "capture_prime_bytes", 0))


def _barrier_before_capture(r: Any) -> None:
    """Many ranks: every rank arrives before any captures (a rank that never does is named
    ``rank_stalled`` after the group's timeout instead of leaving the others in NCCL forever)."""
    from pipeline.setup.rank_watch import watch_for

    watch = watch_for(r.rank_group) if r.request.world_size > 1 else None
    if watch is not None:
        watch.log = r.log
        watch.wait_all("the pre-capture barrier", r.state.value)


RUNNER = StepTable(
    machine="runner", success="ready", event=ev.RunnerTransition, enum_name="RunnerState", module=__name__,
    label="runner trigger", remedy="run initialize()'s steps in order",
    steps=(
        Step("init-distributed", "distributed_ready", (Guard(
            "has_world", "rank, world size (and the CPU group when there is a process group) are known"),),
            decide=lambda r: settings.check_env(), apply=init_distributed, emits=(ev.DistributedInitialized,)),
        Step("load-model", "model_loaded", (Guard(
            "has_model", "the attention stack exists (its layers size the KV pool)"),),
            result="load", decide=decide_model, apply=load_model, emits=(ev.ModelLoaded,)),
        Step("init-memory-pool", "pool_ready", (Guard(
            "kv_pool_exists", "req_to_token and the K/V buffers exist before any backend is built over them"),),
            result="pools_decided", decide=decide_pools, apply=alloc_pools, emits=(ev.MemoryPoolSized,)),
        Step("attention", "attention_ready", (Guard("attention_done", "the attention pipeline reached 'done'"),),
             result="attention", decide=decide_attention, apply=build_attention),
        Step("capture-cuda-graphs", "graphs_settled", (Guard(
            "graphs_outcome", "decode graphs captured, or capture skipped with a recorded reason"),),
            pre=CAPTURE_PRECONDITIONS, what="capture", name="CAPTURE", result="graphs_decided",
            decide=decide_capture, apply=capture, skip="cuda_graph_capture",
            emits=(ev.StepSkipped, ev.CudaGraphCaptured, ev.CudaGraphMemory, ev.RunnerReady)),
    ))
RunnerState = RUNNER.State

