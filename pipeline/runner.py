"""Runner orchestration: a model runner's ``initialize()`` as an outer state machine.

``init-distributed → load-model → init-memory-pool → attention → capture-cuda-graphs → ready``
(+ ``failed``; the table lives in :mod:`pipeline.runner_machine`). ``attention`` is the six-state
pipeline (:func:`pipeline.build.build_attention_backends`) run over the pools this runner sized,
writing to the same :class:`~pipeline.eventlog.EventLog`, so one trace holds both machines
(``runner_transition`` records for this one, ``state_transition`` for the pipeline).

Ordering rules enforced (sglang keeps them in comments): the KV pool exists before any backend is
built; decode CUDA-graph capture only after the pipeline reached ``done``, NPU zbal lazy memory was
initialised or skipped with its reason, the configured EAGLE3 aux hidden-state layers were set on
the model, the KV pool exists and — with several ranks — the ranks agreed on the resolution.
A failure in any step moves the runner to ``failed``, logs ``run_failed`` whose ``error.state``
names the step (the pipeline's own state for a failure inside ``attention``) and whose message
gives the cause, releases what was built and re-raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec

from pipeline import events as ev
from pipeline.contracts import SetupRequest
from pipeline.errors import error_info_from
from pipeline.eventlog import EventLog
from pipeline.runner_machine import CAPTURE_PRECONDITIONS, RunnerMachine, RunnerState

__all__ = ["RunnerConfig", "Runner", "RunnerState"]

# agree(resolution, request, cpu_group) -> detail str; raises a typed error when ranks disagree
AgreeFn = Callable[[Any, SetupRequest, Any], str]
SINGLE_RANK = "single rank: agrees trivially"


@dataclass(frozen=True)
class RunnerConfig:
    """What ``initialize()`` needs beyond the :class:`SetupRequest`.

    ``num_layers``: build only the first N attention layers (None = all; a hybrid model's
    linear-attention / mamba layers are skipped, not counted). ``seed``: weight seed.
    Pool size (first given wins): ``num_token_slots`` > ``mem_bytes`` (a byte budget) >
    ``mem_fraction`` (share of device memory, weights subtracted) > ``request.pool.num_token_slots``.
    ``aux_hidden_state_layers``: EAGLE3 layer ids whose input hidden states the model returns.
    """

    request: SetupRequest
    num_layers: Optional[int] = None
    seed: int = 0
    num_token_slots: Optional[int] = None
    mem_bytes: Optional[int] = None
    mem_fraction: Optional[float] = None
    aux_hidden_state_layers: Optional[tuple[int, ...]] = None


class Runner:
    """Drives the outer machine. Call :meth:`initialize`, or the steps one by one in order.

    Parameters
    ----------
    config : :class:`RunnerConfig`. platform : device platform (default from ``request.device``).
    log / log_file : an EventLog to emit to, or a trace path for a new one (checked up front:
        :func:`pipeline.build.open_event_log` raises UsageError ``log_file_unwritable``).
    cpu_group : the world's CPU process group (passed to NPU lazy memory).
    rank_group : a :class:`pipeline.distributed.RankGroup` (``init_from_env()``): the pipeline's
        resolve state then exchanges the resolution with every rank (``resolution_agreed``).
    agree : an alternative rank-agreement exchange run after the pipeline
        (``agree(resolution, request, cpu_group) -> detail``; raises when ranks disagree).
        With ``world_size > 1`` and a process group (``cpu_group``/``rank_group``), capture is
        refused unless one of the two recorded an agreement; with no process group at all the
        pipeline records the exchange as skipped with its reason, which the guard accepts.
    installed : package presence override passed to the pipeline.

    After ``ready``: ``stack`` (the :class:`~pipeline.model.AttentionStack`), ``pools``,
    ``backends`` (:class:`~pipeline.result.AttentionBackends`), ``graphs``
    (:class:`~pipeline.cuda_graphs.DecodeGraphRunner` or None) and :meth:`forward`. With PD-mux,
    decode (eager and graphs) runs on ``decode_attn_backend``, the first decode backend of the
    group; the other group members are built and verified but not graph-captured here.
    """

    def __init__(self, config: RunnerConfig, *, platform: Any = None, log: Optional[EventLog] = None,
                 log_file: Optional[str] = None, cpu_group: Any = None, agree: Optional[AgreeFn] = None,
                 installed: Optional[dict[str, bool]] = None, rank_group: Any = None) -> None:
        from pipeline.build import new_run_id, open_event_log
        from pipeline.platforms import parse_device, platform_for

        if not isinstance(config, RunnerConfig) or not isinstance(config.request, SetupRequest):
            from pipeline.errors import UsageError

            raise UsageError(f"Runner needs a RunnerConfig holding a SetupRequest, got {type(config).__name__}"
                             + (f" with request={type(config.request).__name__}" if isinstance(config, RunnerConfig)
                                else ""), code="usage", flags=[("config", type(config).__name__)],
                             allowed=["RunnerConfig(request=SetupRequest(...))"],
                             remedy="build RunnerConfig(request=SetupRequest(args=..., model=load_model_spec(path)))")
        req = config.request
        self.config, self.agree, self.installed, self.cpu_group = config, agree, installed, cpu_group
        self.rank_group = rank_group
        if cpu_group is None and rank_group is not None:
            self.cpu_group = rank_group.cpu_group
        self.own_log = log is None
        self.log = log or open_event_log(req.run_id or new_run_id(), req.rank, log_file, tuple(req.secrets.values()))
        self.platform = platform or platform_for(req.device)
        self.index = parse_device(req.device)[1]
        self.machine = RunnerMachine(on_transition=self._moved)
        self.request = req
        self.sizing: Any = None
        self.t0 = time.perf_counter()

    # -- plumbing ------------------------------------------------------------------------------
    @property
    def state(self) -> RunnerState:
        return self.machine.state

    @property
    def stack(self) -> Any:
        return self.machine.model.stack

    @property
    def pools(self) -> Any:
        return self.machine.model.pools

    @property
    def backends(self) -> Any:
        return self.machine.model.backends

    @property
    def graphs(self) -> Any:
        """The DecodeGraphRunner, or None (capture skipped or not reached)."""
        g = self.machine.model.graphs
        return None if isinstance(g, str) else g

    def _moved(self, src: RunnerState, dst: RunnerState, trigger: str, ms: float) -> None:
        self.log.emit(ev.RunnerTransition, state=dst.value, outcome="failed" if dst is RunnerState.FAILED else "ok",
                      from_state=src.value, to=dst.value, trigger=trigger, duration_ms=ms)

    def _step(self, step: RunnerState, work: Callable[[], Any]) -> Any:
        self.machine.require_step(step)
        try:
            return work()
        except BaseException as exc:
            self._fail(step, exc)
            raise

    def _fail(self, step: RunnerState, exc: BaseException) -> None:
        info = error_info_from(exc, step.value)
        released = self.release()
        if self.state is not RunnerState.FAILED:
            self.machine.fire("fail")
        pipeline_logged = step is RunnerState.ATTENTION and any(
            isinstance(r, ev.RunFailed) for r in self.log.records)
        if released:
            self.log.emit(ev.ResourcesReleased, state=RunnerState.FAILED.value, released=released)
        if not pipeline_logged:
            self.log.emit(ev.RunFailed, state=RunnerState.FAILED.value, outcome="failed", error=info,
                          released=released)

    # -- steps ---------------------------------------------------------------------------------
    def init_distributed(self) -> None:
        """Record rank, world size and the CPU group (a gloo group when torch.distributed is up)."""
        def work() -> None:
            from pipeline import settings

            settings.check_env()  # refused here, before the model and the pools are allocated
            req, group, source = self.request, self.cpu_group, "arguments"
            if req.world_size > 1 and group is None:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    from pipeline.errors import ConfigError

                    if (dist.get_rank(), dist.get_world_size()) != (req.rank, req.world_size):
                        raise ConfigError("torch.distributed disagrees with the request's rank/world_size",
                                          code="invalid_value", flags=[("rank", req.rank), ("world_size", req.world_size)],
                                          allowed=[f"rank={dist.get_rank()}, world_size={dist.get_world_size()}"],
                                          remedy="pass the process group's rank and world size")
                    group, source = dist.new_group(backend="gloo"), "torch.distributed"
            self.cpu_group = group
            self.log.emit(ev.DistributedInitialized, state=self.state.value, world_size=req.world_size,
                          has_cpu_group=group is not None, source=source)
            self.machine.model.world = (req.rank, req.world_size, group)
            self.machine.fire("distributed_ready")
        self._step(RunnerState.INIT_DISTRIBUTED, work)

    def load_model(self) -> None:
        """Build the attention stack (first ``num_layers`` attention layers, seeded) and set EAGLE3 aux layers."""
        def work() -> None:
            from pipeline.memory import torch_dtype
            from pipeline.model import AttentionStack
            from states.capability_check import model_dtype

            req, cfg = self.request, self.config
            # the device must exist before weights go to it: a typed device_unavailable, as the CLI and
            # build_attention_backends give, instead of torch's raw "Torch not compiled with CUDA enabled"
            self.platform.device_facts(self.index)
            dtype = model_dtype(req.args, req.served_model)
            stack = AttentionStack(req.served_model, dtype=torch_dtype(dtype), num_layers=cfg.num_layers,
                                   device=self.platform.torch_device(self.index), seed=cfg.seed)
            if cfg.aux_hidden_state_layers:
                stack.set_aux_hidden_state_layers(cfg.aux_hidden_state_layers)
            served = stack.spec
            self.request = msgspec.structs.replace(req, **(
                {"draft_model": served} if req.is_draft_worker and req.draft_model is not None else {"model": served}))
            self.log.emit(ev.ModelLoaded, state=self.state.value, num_layers=stack.num_layers,
                          num_hidden_layers=req.served_model.num_hidden_layers, param_bytes=stack.param_bytes(),
                          dtype=dtype, seed=cfg.seed, aux_hidden_state_layers=stack.aux_hidden_state_layers)
            m = self.machine.model
            m.stack, m.aux_configured = stack, list(cfg.aux_hidden_state_layers or []) or None
            self.machine.fire("model_loaded")
        self._step(RunnerState.LOAD_MODEL, work)

    def init_memory_pool(self) -> None:
        """Size and allocate ``req_to_token`` and the per-layer K/V buffers; logs tokens and bytes."""
        self._step(RunnerState.INIT_MEMORY_POOL, self._init_memory_pool)

    def _init_memory_pool(self) -> None:
        from pipeline.memory import KVPool, ReqToTokenPool, torch_dtype
        from pipeline.pool_sizing import available_bytes, budget_from_fraction, check_fits, size_pools
        from states.capability_check import kv_dtype

        req, cfg, stack = self.request, self.config, self.machine.model.stack
        model, p = req.served_model, req.pool
        budget, source = cfg.mem_bytes, "bytes"
        total, allocated = 0, self.platform.memory_allocated(self.index)
        if cfg.num_token_slots is None and budget is None and cfg.mem_fraction is not None:
            total = self.platform.device_facts(self.index).total_memory_bytes
            budget = budget_from_fraction(cfg.mem_fraction, total, allocated)
            source = "mem_fraction"
        slots = cfg.num_token_slots if cfg.num_token_slots is not None else (None if budget is not None
                                                                             else p.num_token_slots)
        kvd = kv_dtype(req.args, model)
        s = size_pools(model.layer_kinds(), stack.num_layers, kvd, page_size=req.args.page_size, max_reqs=p.max_reqs,
                       max_context_len=p.max_context_len, num_token_slots=slots, budget_bytes=budget, source=source,
                       mem_fraction=cfg.mem_fraction)
        check_fits(s, available_bytes(self.platform, self.index), device=self.platform.torch_device(self.index),
                   total_bytes=total, allocated_bytes=allocated, mem_fraction=cfg.mem_fraction)
        self.sizing, self.request = s, msgspec.structs.replace(req, pool=s.facts)
        dev = self.platform.torch_device(self.index)
        pools = {"req_to_token_pool": ReqToTokenPool(p.max_reqs, p.max_context_len, dev)}
        pools["kv_pool"] = KVPool.for_layer_kinds(model.layer_kinds(), stack.num_layers, s.facts.num_token_slots,
                                                  s.facts.page_size, torch_dtype(kvd), dev)
        self.log.emit(ev.MemoryPoolSized, state=self.state.value, source=s.source, budget_bytes=s.budget_bytes,
                      bytes_per_token=s.bytes_per_token, num_token_slots=s.facts.num_token_slots,
                      max_reqs=p.max_reqs, max_context_len=p.max_context_len, page_size=s.facts.page_size,
                      req_to_token_bytes=s.req_to_token_bytes, kv_bytes=s.kv_bytes)
        self.machine.model.pools = pools
        self.machine.fire("pool_ready")

    def init_attention(self) -> None:
        """Run the six-state pipeline over this runner's pools, then check the ranks agree."""
        self._step(RunnerState.ATTENTION, self._init_attention)

    def _init_attention(self) -> None:
        from pipeline.build import build_attention_backends

        m = self.machine.model
        out = build_attention_backends(self.request, platform=self.platform, log=self.log, pools=m.pools,
                                       installed=self.installed, cpu_group=self.cpu_group,
                                       rank_group=self.rank_group)
        m.backends = out
        lazy = next((r for r in self.log.records if isinstance(r, ev.LazyMemInitialized)), None)
        skip = next((r for r in self.log.records if isinstance(r, ev.StepSkipped) and r.what == "npu_lazy_mem"), None)
        m.lazy_mem = "done" if lazy is not None else (skip.reason if skip is not None else None)
        m.agreement = self._agree(out)
        self.machine.fire("attention_ready")

    def _agree(self, out: Any) -> Optional[str]:
        """How the ranks agreed (from the pipeline's records or ``agree``), or None when they did not."""
        req, recs = self.request, self.log.records
        if req.world_size == 1:
            return SINGLE_RANK
        if any(isinstance(r, ev.ResolutionAgreed) for r in recs):
            return f"resolution_agreed across {req.world_size} ranks"
        if self.agree is not None:
            return self.agree(out.resolution, req, self.cpu_group)
        skip = next((r for r in recs if isinstance(r, ev.StepSkipped) and r.what == "rank_agreement"), None)
        if skip is not None and self.cpu_group is None and self.rank_group is None:
            return f"skipped: {skip.reason}"
        return None  # a process group but no exchange recorded: capture is refused, naming the guard

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs for the configured batch sizes, or skip with the reason; then ``ready``."""
        self._step(RunnerState.CAPTURE, self._capture)

    def _capture(self) -> None:
        from pipeline.backends import registry
        from pipeline.cuda_graphs import DecodeGraphRunner, capture_batch_sizes, skip_reason

        self.machine.require(CAPTURE_PRECONDITIONS)
        m, req = self.machine.model, self.request
        out = m.backends
        names = sorted({out.decode_attention_backend_str})
        reason = skip_reason(req.args, self.platform.device_type, names,
                             lambda n: "cuda_graph" in registry.get(n).capability.features)
        if reason is not None:
            self.log.emit(ev.StepSkipped, state=self.state.value, outcome="skipped", what="cuda_graph_capture",
                          reason=reason)
            m.graphs = reason
        else:
            sizes = capture_batch_sizes(req.args, req.pool.max_reqs)
            self._barrier_before_capture()
            g = DecodeGraphRunner(m.stack, self._backend_for(True), m.pools["req_to_token_pool"], m.pools["kv_pool"],
                                  sizes)
            m.graphs = g
            with self.log.heartbeat(f"capturing decode CUDA graphs for bs {', '.join(map(str, sizes))}"):
                g.capture(lambda bs, ms: self.log.emit(ev.CudaGraphCaptured, state=self.state.value, bs=bs,
                                                       capture_ms=ms, backend=out.decode_attention_backend_str,
                                                       graph_bytes=max(getattr(g, "graph_bytes", {}).get(bs, 0), 0)))
        self.machine.fire("graphs_settled")
        self.log.emit(ev.RunnerReady, state=self.state.value, duration_ms=(time.perf_counter() - self.t0) * 1e3,
                      graph_batch_sizes=sorted(self.graphs.capture_ms) if self.graphs is not None else [],
                      rank_agreement=m.agreement or "")

    def _barrier_before_capture(self) -> None:
        """Many ranks: every rank arrives before any captures (a rank that never does is named
        ``rank_stalled`` after the group's timeout instead of leaving the others in NCCL forever)."""
        from pipeline.rank_watch import watch_for

        watch = watch_for(self.rank_group) if self.request.world_size > 1 else None
        if watch is not None:
            watch.log = self.log
            watch.wait_all("the pre-capture barrier", self.state.value)

    def initialize(self) -> "Runner":
        """Every step in order (sglang's ``ModelRunner.initialize``); returns self in ``ready``."""
        self.log.emit(ev.RunnerStarted, state=self.state.value, config={
            "num_layers": self.config.num_layers, "seed": self.config.seed,
            "num_token_slots": self.config.num_token_slots, "mem_bytes": self.config.mem_bytes,
            "mem_fraction": self.config.mem_fraction,
            "aux_hidden_state_layers": list(self.config.aux_hidden_state_layers or [])})
        for step in (self.init_distributed, self.load_model, self.init_memory_pool, self.init_attention,
                     self.capture_cuda_graphs):
            step()
        return self

    # -- use -----------------------------------------------------------------------------------
    def forward(self, hidden: Any, forward_batch: Any) -> tuple[Any, list[Any], bool]:
        """One step of the stack: decode replayed from a graph when one fits, else eager.

        Returns (output [T, hidden_size], aux hidden states, replayed_from_graph).
        """
        g = self.graphs
        if g is not None and g.can_run(forward_batch):
            out, aux = g.replay(hidden, forward_batch)
            return out, aux, True
        backend = self._backend_for(forward_batch.is_decode())
        backend.init_forward_metadata(forward_batch)
        out, aux = self.machine.model.stack.forward(hidden, forward_batch, backend)
        return out, aux, False

    def _backend_for(self, decode: bool) -> Any:
        """PD-mux decodes on ``decode_attn_backend`` (the first of its group); everything else on ``attn_backend``."""
        out = self.machine.model.backends
        return out.decode_attn_backend if decode and out.decode_attn_backend is not None else out.attn_backend

    def release(self) -> list[str]:
        """Drop graphs, backends (their buffers and workspaces) and the pools; returns what was released."""
        m, released = self.machine.model, []
        if self.graphs is not None:
            self.graphs.close()
            released.append("cuda_graphs")
        if m.backends is not None and not m.backends.closed:
            released += m.backends.close()
        for name in list(m.pools or {}):
            released.append(f"pool:{name}")
        m.pools = None if m.pools is None else {}
        return released

    def close(self) -> list[str]:
        """Release everything (idempotent) and close the trace file when this runner opened it."""
        released = self.release()
        if released:
            self.log.emit(ev.ResourcesReleased, state=self.state.value, released=released)
        if self.own_log:
            self.log.close()
        return released

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
