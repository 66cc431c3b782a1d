"""The runner's machine as one table (a model runner's ``initialize()``), each step's decision and effect.

::

    init-distributed ─distributed_ready─► load-model ─model_loaded─► init-memory-pool ─pool_ready─►
        attention ─attention_ready─► capture-cuda-graphs ─graphs_settled─► ready   (any non-terminal ─fail─► failed)

``attention`` runs the setup machine (:data:`pipeline.setup.table.SETUP`) composed inside it. Each step's
``decide`` makes its decision without an effect — a runner's preflight (:meth:`pipeline.runtime.runner.Runner.preflight`)
walks them before anything is allocated: the env settings, the compute dtype and the layers to build, the pool
sizes against the device's memory, every setup decision up to allocation, the graph sizes — and ``apply`` carries
it out. Capture is refused unless every :data:`CAPTURE_PRECONDITIONS` guard holds. Nothing here imports torch at
import time.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core import settings
from pipeline.core.dtypes import kv_dtype, model_dtype  # noqa: F401
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import available_bytes, budget_from_fraction, check_fits, check_mem_fraction, size_pools  # noqa: F401
from pipeline.core.layer_span import span_fields, span_of
from pipeline.core.spec import attention_layer_ids, truncate_spec
from pipeline.core.steps import Guard, Step, StepTable
from pipeline.runtime.pool_steps import (alloc_pools, decide_pools, fraction_remedy, graph_estimate,  # noqa: F401
                                         graph_reserve_bytes, served_field, size_for)


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
                                                               world_size=req.world_size) if g.capture else [])


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
