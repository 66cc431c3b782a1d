"""Runner orchestration: a model runner's ``initialize()`` as an outer state machine (docs/internals.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from pipeline.core import steps, events as ev
from pipeline.core.contracts import ErrorInfo, SetupRequest
from pipeline.core.errors import error_info_from
from pipeline.core.eventlog import EventLog
from pipeline.core.steps import TableMachine
from pipeline.runtime.table import RUNNER, RunnerModel, RunnerState

__all__ = ["RunnerConfig", "Runner", "RunnerState", "Verification"]

# agree(resolution, request, cpu_group) -> detail str; raises a typed error when ranks disagree
AgreeFn = Callable[[Any, SetupRequest, Any], str]


@dataclass(frozen=True)
class RunnerConfig:
    """What ``initialize()`` needs beyond the :class:`SetupRequest`.

    ``num_layers``: first N attention layers (None = all); ``seed``: weight seed. Pool size, first given wins:
    ``num_token_slots`` > ``mem_bytes`` > ``mem_fraction`` (weights subtracted) > ``request.pool.num_token_slots``.
    ``aux_hidden_state_layers``: EAGLE3 layer ids. ``min_token_slots`` (what ``min_token_slots_for`` needs them for) and
    ``min_context_len``: the least a pool or its remedy may hold.
    """

    request: SetupRequest
    num_layers: Optional[int] = None
    seed: int = 0
    num_token_slots: Optional[int] = None
    mem_bytes: Optional[int] = None
    mem_fraction: Optional[float] = None
    aux_hidden_state_layers: Optional[tuple[int, ...]] = None
    min_token_slots: int = 0
    min_token_slots_for: str = ""
    min_context_len: int = 1

    def __post_init__(self) -> None:
        """Every field but ``request`` against its annotation (:func:`pipeline.core.validation.matches`): ConfigError
        ``invalid_value`` naming field, value and type, before anything is built."""
        import dataclasses
        import typing

        from pipeline.core import validation
        from pipeline.core.errors import ConfigError

        hints = typing.get_type_hints(RunnerConfig)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "request" or validation.matches(v, hints[f.name]):
                continue
            want = validation._type_name(hints[f.name]).replace("Ellipsis", "...")
            raise ConfigError(f"RunnerConfig.{f.name} must be {want}, got {validation._describe(v)}",
                              code="invalid_value", flags=[(f.name, v if isinstance(v, (int, float, str)) else repr(v))],
                              allowed=[want], remedy=f"pass a value of type {want} for {f.name}")


VERIFY_REMEDY = "the backend computes wrong attention for this model; report it with the log"


def verification_failure(records: Iterable[ev.Event]) -> Optional[ErrorInfo]:
    """The ``verification_failed`` ErrorInfo of failed ``instance_verified`` / ``model_step_verified`` records, or None.
    Instances read ``role (backend: max_rel_err > tol)``, steps ``step (graph|eager[, mla-…]: max_rel_err > tol)``;
    ``state`` is ``done`` when an instance failed, else ``ready``."""
    inst, steps = [], []
    for r in records:
        if isinstance(r, ev.InstanceVerified) and not r.passed:
            inst.append(f"{r.role} ({r.backend}: {r.max_rel_err:.2e} > {tol_text(r.tol)})")
        elif isinstance(r, ev.ModelStepVerified) and not r.passed:
            how = ("graph" if r.graph else "eager") + (f", {r.reference}" if r.reference.startswith("mla-") else "")
            steps.append(f"{r.step} ({how}: {r.max_rel_err:.2e} > {tol_text(r.tol)})")
    if not inst and not steps:
        return None
    parts = ([f"instances failed verification against the float64 reference: {', '.join(inst)}"] if inst else []) \
        + ([f"model steps failed verification against the float64 reference: {', '.join(steps)}"] if steps else [])
    return ErrorInfo(code="verification_failed", state="done" if inst else "ready", message="; ".join(parts),
                     remedy=VERIFY_REMEDY)


def tol_text(tol: float) -> str:
    """A tolerance as the reports print it: one digit when that is exact (``1e-02``), else three
    (``1.43e-02``: the MLA absorption check's tolerance is derived per step, :mod:`pipeline.runtime.model_steps`)."""
    short = f"{tol:.0e}"
    return short if float(short) == tol else f"{tol:.2e}"


@dataclass(frozen=True)
class Verification:
    """What :meth:`Runner.verify` found: ``instances`` (VerifyResult each), ``steps`` (StepCheck each), ``error``
    (``verification_failed``, or None)."""

    instances: list[Any]
    steps: list[Any]
    error: Optional[Any] = None


class Runner:
    """Drives the outer machine: call :meth:`initialize`, or the steps one by one in order.

    ``log`` / ``log_file``: an EventLog, or a trace path (UsageError ``log_file_unwritable``); ``cpu_group``: for NPU
    lazy memory; ``rank_group``: resolve exchanges the resolution with every rank; ``agree(resolution, request,
    cpu_group)``: an alternative exchange (with ``world_size > 1`` and a group, capture needs one of them);
    ``installed``: package override. After ``ready``: ``stack``, ``pools``, ``backends``, ``graphs`` (or None),
    :meth:`forward`, :meth:`verify`; with PD-mux decode runs on ``decode_attn_backend``.
    """

    def __init__(self, config: RunnerConfig, *, platform: Any = None, log: Optional[EventLog] = None,
                 log_file: Optional[str] = None, cpu_group: Any = None, agree: Optional[AgreeFn] = None,
                 installed: Optional[dict[str, bool]] = None, rank_group: Any = None) -> None:
        from pipeline.platforms import parse_device, platform_for
        from pipeline.setup.build import open_event_log
        from pipeline.core.eventlog import new_run_id

        if not isinstance(config, RunnerConfig) or not isinstance(config.request, SetupRequest):
            from pipeline.core.errors import UsageError

            raise UsageError(f"Runner needs a RunnerConfig holding a SetupRequest, got {type(config).__name__}"
                             + (f" with request={type(config.request).__name__}" if isinstance(config, RunnerConfig)
                                else ""), code="usage", flags=[("config", type(config).__name__)],
                             allowed=["RunnerConfig(request=SetupRequest(...))"],
                             remedy="build RunnerConfig(request=SetupRequest(args=..., model=load_model_spec(path)))")
        req = config.request
        self.config, self.agree, self.installed, self.rank_group = config, agree, installed, rank_group
        self.cpu_group = cpu_group if cpu_group is not None or rank_group is None else rank_group.cpu_group
        self.own_log = log is None
        self.log = log or open_event_log(req.run_id or new_run_id(), req.rank, log_file, tuple(req.secrets.values()))
        self.platform = platform or platform_for(req.device)
        self.index = parse_device(req.device)[1]
        self.machine = TableMachine(RUNNER, RunnerModel(), on_transition=self._moved)
        self.request = req
        self.sizing: Any = None
        self.setup_failed = False
        self.preflighted: Optional[steps.Decided] = None
        self.t0 = time.perf_counter()
        # each step's decision, kept by the driver under the step's ``result``
        self.load: Any = None
        self.pools_decided: Any = None
        self.attention: Any = None
        self.graphs_decided: Any = None

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

    def emit(self, cls: type, **fields: Any) -> None:
        """Log a record in the runner's current state."""
        self.log.emit(cls, state=self.state.value, **fields)

    def _moved(self, src: RunnerState, dst: RunnerState, trigger: str, ms: float) -> None:
        self.log.emit(RUNNER.event, state=dst.value, outcome="failed" if dst.value == RUNNER.failed else "ok",
                      from_state=src.value, to=dst.value, trigger=trigger, duration_ms=ms)

    def _run(self, state: str) -> None:
        """One step of the table (ordering checked first); a failure moves the runner to ``failed``."""
        self.machine.require_state(state)
        given = None if self.preflighted is None else self.preflighted.only("attention")
        try:
            steps.run_step(RUNNER, RUNNER.step(state), self, self.machine, given=given)
        except BaseException as exc:
            self._fail(state, exc)
            raise
        if self.state.value == RUNNER.success:
            self.emit(ev.RunnerReady, duration_ms=(time.perf_counter() - self.t0) * 1e3,
                      graph_batch_sizes=sorted(self.graphs.capture_ms) if self.graphs is not None else [],
                      rank_agreement=self.machine.model.agreement or "")

    def _fail(self, state: str, exc: BaseException) -> None:
        info = error_info_from(exc, state)
        released = self.release()
        if self.state.value != RUNNER.failed:
            self.machine.fire("fail")
        if released:
            self.log.emit(ev.ResourcesReleased, state=RUNNER.failed, released=released)
        if not self.setup_failed:  # a failure out of the setup machine was logged by it
            self.log.emit(ev.RunFailed, state=RUNNER.failed, outcome="failed", error=info, released=released)

    def agreement_of(self, out: Any) -> Optional[str]:
        """How the ranks agreed: the setup machine's agreement, else ``agree``'s, else (no process group at all)
        the recorded skip; None when a process group exists but nothing agreed (capture is then refused)."""
        a = out.agreement
        if a.agreed:
            return a.detail
        if self.agree is not None:
            return self.agree(out.resolution, self.request, self.cpu_group)
        return a.detail if self.cpu_group is None and self.rank_group is None else None

    # -- steps ---------------------------------------------------------------------------------
    def preflight(self) -> steps.Decided:
        """Every step's decision before anything is allocated (the table in decide mode): the env settings, the
        dtype and the layers to build, the pool sizes against the device's memory, every setup decision, the graph
        sizes. A typed refusal is kept in the result; :meth:`initialize` then takes the setup's decisions."""
        self.preflighted = steps.decide(RUNNER, self)
        return self.preflighted

    def init_distributed(self) -> None:
        """Record rank, world size and the CPU group (a gloo group when torch.distributed is up)."""
        self._run("init-distributed")

    def load_model(self) -> None:
        """Build the attention stack (first ``num_layers`` attention layers, seeded) and set EAGLE3 aux layers."""
        self._run("load-model")

    def init_memory_pool(self) -> None:
        """Size and allocate ``req_to_token`` and the per-layer K/V buffers; logs tokens and bytes."""
        self._run("init-memory-pool")

    def init_attention(self) -> None:
        """Run the six-state pipeline over this runner's pools, then check the ranks agree."""
        self._run("attention")

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs for the configured batch sizes, or skip with the reason; then ``ready``."""
        self._run("capture-cuda-graphs")

    def initialize(self) -> "Runner":
        """Every step in table order (sglang's ``ModelRunner.initialize``); returns self in ``ready``."""
        # the first state and runner_ready are timed from here: a preflight before this belongs to ``preflight``
        self.t0 = time.perf_counter()
        self.machine.start_clock()
        self.log.emit(ev.RunnerStarted, state=self.state.value, config={
            "num_layers": self.config.num_layers, "seed": self.config.seed,
            "num_token_slots": self.config.num_token_slots, "mem_bytes": self.config.mem_bytes,
            "mem_fraction": self.config.mem_fraction,
            "aux_hidden_state_layers": list(self.config.aux_hidden_state_layers or [])})
        for step in RUNNER.steps:
            self._run(step.state)
        return self

    def verify(self, decode_steps: int = 3) -> "Verification":
        """Check the build in ``ready``: every instance (``instance_verified``), then extend, chunked extend and
        ``decode_steps`` decodes (``model_step_verified``). A failure is logged ``run_failed`` and returned as ``error``
        (``verification_failed``), never raised."""
        from pipeline.runtime.runner import verification_failure
        from pipeline.runtime.model_steps import verify_model_steps
        from pipeline.runtime.verify import verify_built

        self.machine.require_state(RUNNER.success)
        emitted, instances = [], verify_built(self.backends, self.request, pools=self.pools, decode_steps=decode_steps)
        if self.request.world_size > 1 and self.cpu_group is not None:  # the TP ranks together vs the whole model
            instances += self._world_check()
        for r in instances:
            emitted.append(self.log.emit(
                ev.InstanceVerified, state="done", outcome="ok" if r.passed else "failed", role=r.role,
                backend=r.backend, max_rel_err=r.max_rel_err, tol=r.tol, passed=r.passed, duration_ms=r.duration_ms))
        res = self.backends.resolution  # speculative decoding adds target-verify or draft-decode steps
        checks = verify_model_steps(self, decode_steps=decode_steps, spec=None if res is None else res.speculative,
                                    draft=self.request.is_draft_worker)
        for c in checks:
            emitted.append(self.log.emit(
                ev.ModelStepVerified, state="ready", outcome="ok" if c.passed else "failed", step=c.step, mode=c.mode,
                batch_size=c.batch_size, graph=c.graph, max_rel_err=c.max_rel_err, tol=c.tol, passed=c.passed,
                reference=c.reference))
        error = verification_failure(emitted)
        if error is not None:
            self.log.emit(ev.RunFailed, state=self.log.current_state, outcome="failed", error=error)
        return Verification(instances=instances, steps=checks, error=error)

    def _world_check(self) -> list[Any]:
        """:func:`pipeline.runtime.world_check.world_check` on the serving backend, over the CPU group (every rank
        takes part); [] when this rank's stage has no attention layer."""
        from pipeline.core.dtypes import model_dtype
        from pipeline.runtime.world_check import world_check

        b, req = self.backends, self.request
        r = world_check(b.attn_backend, req, kv_pool=self.pools["kv_pool"],
                        req_to_token_pool=self.pools["req_to_token_pool"], torch_device=b.torch_device,
                        dtype=model_dtype(req.args, req.served_model), name=b.plan.instances[0].backend,
                        group=self.cpu_group, seed=self.config.seed)
        return [] if r is None else [r]

    # -- use -----------------------------------------------------------------------------------
    def forward(self, hidden: Any, forward_batch: Any) -> tuple[Any, list[Any], bool]:
        """One step of the stack (graph replay when one fits): (output [T, hidden_size], aux hidden states, replayed).
        """
        g = self.graphs
        if g is not None and g.can_run(forward_batch):
            out, aux = g.replay(hidden, forward_batch)
            return out, aux, True
        backend = self.backend_for(forward_batch.is_decode())
        backend.init_forward_metadata(forward_batch)
        out, aux = self.machine.model.stack.forward(hidden, forward_batch, backend)
        return out, aux, False

    def backend_for(self, decode: bool) -> Any:
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
        if m.stack is not None:  # its weights; the machine's callbacks close over the runner (a cycle), so drop them
            m.stack = None      # here rather than wait for the cyclic garbage collector
            released.append("stack")
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
