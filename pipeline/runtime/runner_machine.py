"""The runner's outer machine (a model runner's ``initialize()``): the table as data, guards that name invariants.

::

    init-distributed ─distributed_ready─► load-model ─model_loaded─► init-memory-pool ─pool_ready─►
        attention ─attention_ready─► capture-cuda-graphs ─graphs_settled─► ready   (any non-terminal ─fail─► failed)

``attention`` runs the six-state pipeline (:mod:`pipeline.core.machine`) composed inside it. Capture is
refused unless every :data:`CAPTURE_PRECONDITIONS` guard holds; a step called out of order raises
:class:`~pipeline.core.errors.OrderingError` naming the step(s) still missing. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

from pipeline.core.errors import OrderingError
from pipeline.core.machine import GuardError, TableMachine, table


class RunnerState(str, enum.Enum):
    INIT_DISTRIBUTED = "init-distributed"
    LOAD_MODEL = "load-model"
    INIT_MEMORY_POOL = "init-memory-pool"
    ATTENTION = "attention"
    CAPTURE = "capture-cuda-graphs"
    READY = "ready"
    FAILED = "failed"


ORDER = [RunnerState.INIT_DISTRIBUTED, RunnerState.LOAD_MODEL, RunnerState.INIT_MEMORY_POOL, RunnerState.ATTENTION,
         RunnerState.CAPTURE, RunnerState.READY]
TERMINAL = (RunnerState.READY, RunnerState.FAILED)

# guard (a method of RunnerModel), invariant, the step that establishes it
CAPTURE_PRECONDITIONS: list[tuple[str, str, str]] = [
    ("attention_done", "the attention pipeline reached 'done'", "attention"),
    ("lazy_mem_settled", "NPU zbal lazy memory was initialised, or skipped with a recorded reason",
     "attention (npu-lazy-mem)"),
    ("aux_hidden_set", "the configured aux hidden-state layers (EAGLE3) are set on the model", "load-model"),
    ("kv_pool_exists", "req_to_token and the K/V buffers exist", "init-memory-pool"),
    ("ranks_agreed", "every rank resolved the same attention backends (or one rank)", "attention (rank agreement)"),
]

# trigger, source, dest, guards, invariant of the first guard
STEPS: list[tuple[str, RunnerState, RunnerState, tuple[str, ...], str]] = [
    ("distributed_ready", RunnerState.INIT_DISTRIBUTED, RunnerState.LOAD_MODEL, ("has_world",),
     "rank, world size (and the CPU group when there is a process group) are known"),
    ("model_loaded", RunnerState.LOAD_MODEL, RunnerState.INIT_MEMORY_POOL, ("has_model",),
     "the attention stack exists (its layers size the KV pool)"),
    ("pool_ready", RunnerState.INIT_MEMORY_POOL, RunnerState.ATTENTION, ("kv_pool_exists",),
     "req_to_token and the K/V buffers exist before any backend is built over them"),
    ("attention_ready", RunnerState.ATTENTION, RunnerState.CAPTURE, ("attention_done",),
     "the attention pipeline reached 'done'"),
    ("graphs_settled", RunnerState.CAPTURE, RunnerState.READY,
     tuple(g for g, _, _ in CAPTURE_PRECONDITIONS) + ("graphs_outcome",),
     "decode graphs captured, or capture skipped with a recorded reason"),
]
STEP_OF_STATE = {s: t for t, s, _, _, _ in STEPS}
INVARIANT = {g: why for g, why, _ in CAPTURE_PRECONDITIONS}
INVARIANT.update({gs[0]: why for _, _, _, gs, why in STEPS})
INVARIANT["graphs_outcome"] = "decode graphs captured, or capture skipped with a recorded reason"

TRANSITIONS: list[dict[str, Any]] = table(STEPS, RunnerState, TERMINAL)


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
        self.state: RunnerState = RunnerState.INIT_DISTRIBUTED

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


class RunnerMachine(TableMachine):
    """The runner's machine over a :class:`RunnerModel` (the table above); ``on_transition(src, dst, trigger, ms)``."""

    STATES, STEPS, TERMINAL, INVARIANTS = RunnerState, STEPS, TERMINAL, INVARIANT
    LABEL = "runner trigger"
    REMEDY = "run initialize()'s steps in order"

    def __init__(self, model: Optional[RunnerModel] = None,
                 on_transition: Optional[Callable[[RunnerState, RunnerState, str, float], None]] = None) -> None:
        super().__init__(model or RunnerModel(), on_transition)

    def require_step(self, step: RunnerState) -> None:
        """Raise OrderingError unless the machine is in ``step`` (naming the missing or finished steps)."""
        cur = self.state
        if cur is step:
            return
        if cur is RunnerState.FAILED:
            raise OrderingError(f"{step.value} refused: the runner failed; start a new runner", state=cur.value,
                                flags=[("step", step.value), ("current_state", cur.value)],
                                remedy="a failed initialize() cannot continue — fix the cause and start again")
        i, j = ORDER.index(cur), ORDER.index(step)
        if j > i:
            missing = [s.value for s in ORDER[i:j]]
            steps = ", ".join(missing)
            raise OrderingError(f"{step.value} refused: step(s) {steps} must run first (runner is in {cur.value!r})",
                                state=cur.value, flags=[("step", step.value), ("missing", missing)],
                                allowed=[cur.value], remedy=f"run {missing[0]} first, or call initialize()")
        raise OrderingError(f"{step.value} refused: it already ran (runner is in {cur.value!r})", state=cur.value,
                            flags=[("step", step.value), ("current_state", cur.value)],
                            allowed=[cur.value], remedy="each initialize() step runs once; start a new runner")

    def require(self, guards: list[tuple[str, str, str]]) -> None:
        """Raise GuardError naming the first guard of ``guards`` that does not hold and the step that sets it."""
        for guard, why, step in guards:
            if not getattr(self.model, guard)():
                raise GuardError(f"capture refused: {why} does not hold (guard {guard!r}; missing step: {step})",
                                 state=self.state.value, flags=[("guard", guard), ("missing_step", step)],
                                 remedy=f"complete {step} before capturing CUDA graphs")
