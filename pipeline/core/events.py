"""Event records: one per transition and per decision, schema-versioned, a tagged union (:data:`AnyEvent`)
(docs/internals.md)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec

from pipeline.core.contracts import (DeviceFacts, ErrorInfo, Evidence, InstancePlan, LayerGroup, Mode, Rejection,
    SCHEMA_VERSION, SpeculativeParams, WorkspacePlan)


Outcome = Literal["ok", "skipped", "failed"]
Ns = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # wall-clock ns (time.time_ns() fits int64)


class Event(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="event"):
    """Fields every record carries; ``level`` (class attribute) is the log level it is emitted at. ``launch_id``
    separates launches sharing a ``run_id`` and a log file (``""`` in older traces). The reader refuses ``schema_version
    < 1``, ``ts_ns`` outside ``[0, 2**63)`` and ``rank < 0``."""

    level: ClassVar[str] = "info"
    schema_version: Annotated[int, msgspec.Meta(ge=1)] = SCHEMA_VERSION
    ts_ns: Ns
    run_id: str
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    launch_id: str = ""
    state: str
    outcome: Outcome = "ok"


class RunStarted(Event, tag="run_started", kw_only=True):
    """Inputs (redacted request, model, packages) and versions, for replay. ``packages``: False, True or the installed
    version resolve checked (older traces: booleans)."""

    request: dict[str, Any]
    versions: dict[str, str | None] = {}
    packages: dict[str, bool | str] = {}
    platform: str = ""


class StateTransition(Event, tag="state_transition", kw_only=True):
    """The machine moved ``from`` → ``to`` by ``trigger``; ``duration_ms`` spent in ``from``."""

    from_state: str = msgspec.field(name="from")
    to: str
    trigger: str
    duration_ms: float


class DeviceInitialized(Event, tag="device_initialized", kw_only=True):
    """device-init's result: the device facts and whether BLAS was initialised (cuda/musa only); ``spelled_as``:
    the device as the user wrote it when that differs from its canonical form (``CUDA:0``; None otherwise)."""

    facts: DeviceFacts
    blas_init: bool
    spelled_as: str | None = None


class SettingResolved(Event, tag="setting_resolved", kw_only=True):
    """Which source won for a setting: ``field`` > ``env`` > ``default``; for ``dtype``, ``field`` or ``auto:<rule>``
    (:data:`pipeline.core.dtypes.AUTO_RULES`)."""

    field: str
    value: Any = None
    source: str
    env_var: str | None = None


class BackendsResolved(Event, tag="backends_resolved", kw_only=True):
    """resolve's decision: the pair, the rule per half, rejected candidates with reasons, ``not_attention`` layers,
    the ``speculative`` shape (None without speculative decoding) and per half the ``evidence`` for auto's choice."""

    prefill: str
    decode: str
    is_draft_override: bool
    rules: dict[str, str]
    rejected: dict[str, list[Rejection]] = {}
    not_attention: list[LayerGroup] = []
    speculative: SpeculativeParams | None = None
    evidence: dict[str, Evidence] = {}


class RankRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One rank's line in the many-ranks table; ``prefill``/``decode`` are ``"-"`` and ``error`` the code when its
    resolve failed."""

    rank: int
    host: str
    device: str
    prefill: str
    decode: str
    is_draft_override: bool = False
    error: str | None = None


class ResolutionAgreed(Event, tag="resolution_agreed", kw_only=True):
    """Every rank resolved the same pair and attention args: ``table`` one :class:`RankRow` per rank, ``duration_ms``.
    """

    world_size: int
    table: list[RankRow]
    duration_ms: float = 0.0


class RankStalled(Event, tag="rank_stalled", kw_only=True):
    """This rank waited ``waited_s`` at ``waiting_at`` and rank ``stalled_rank`` never arrived (one record per missing
    rank). ``last_state`` (``"never heard"`` when none), ``seconds_since_heartbeat`` (None when none), ``doing``
    (``""``)."""

    level: ClassVar[str] = "error"
    stalled_rank: int
    last_state: str
    seconds_since_heartbeat: float | None = None
    doing: str = ""
    waiting_at: str = ""
    waited_s: float = 0.0


class MemoryBalanced(Event, tag="memory_balanced", kw_only=True):
    """device-init's exchange of free device memory: bytes per rank (index = rank) and the allowed
    spread (``max_imbalance``, a fraction of the largest); written when every rank is within it."""

    free_bytes: list[int]
    max_imbalance: float
    duration_ms: float = 0.0


class BuildPlanned(Event, tag="build_planned", kw_only=True):
    """build-mode's decision: mode, hybrid, instances ``[{role, backend, workspace}]`` and workspaces."""

    mode: Mode
    hybrid: bool
    instances: list[InstancePlan]
    workspaces: list[WorkspacePlan]


class BackendBuilt(Event, tag="backend_built", kw_only=True):
    """One backend instance constructed (``duration_ms`` includes any JIT reported separately)."""

    role: str
    backend: str
    duration_ms: float


class StepSkipped(Event, tag="step_skipped", kw_only=True):
    """A step deliberately not done because it does not apply (e.g. zbal memory off NPU), and why."""

    what: str
    reason: str


class FeatureDowngraded(Event, tag="feature_downgraded", kw_only=True):
    """An allowed downgrade, a warning (TBO dropped on a draft worker; CUDA graphs off for an uncapturable decode
    backend). ``avoid``: the fields that avoid it; with ``strict`` it is refused."""

    level: ClassVar[str] = "warning"
    what: str
    reason: str
    avoid: dict[str, Any] = {}


class ReferenceFallback(Event, tag="reference_fallback", kw_only=True):
    """Auto-selection put ``torch_native`` on an accelerator, a warning: ``halves``, ``device``, ``rejected``, ``avoid``
    (the field accepting it explicitly; ``strict`` refuses instead), ``message``."""

    level: ClassVar[str] = "warning"
    halves: list[str]
    backend: str
    device: str
    rejected: dict[str, list[Rejection]] = {}
    avoid: dict[str, Any] = {}
    message: str = ""


class LazyMemInitialized(Event, tag="npu_lazy_mem_initialized", kw_only=True):
    """NPU zbal lazy memory was initialised with these sizes (bytes) and world facts."""

    bytes: int
    rank_arg: int
    world_size: int


class BackendsAnnotated(Event, tag="backends_annotated", kw_only=True):
    """annotate's effect: the resolved names set on the top-level backend object."""

    target: str
    prefill: str
    decode: str


class ResourcesReleased(Event, tag="resources_released", kw_only=True):
    """What a failed run (or ``close()``) released: workspace ids and backend roles."""

    released: list[str]


class RunFailed(Event, tag="run_failed", kw_only=True):
    """The run entered ``failed``: the one ErrorInfo and what was released."""

    level: ClassVar[str] = "error"
    error: ErrorInfo
    released: list[str] = []


class RunInterrupted(Event, tag="run_interrupted", kw_only=True):
    """The process is going away mid-run (signal or uncaught exception): the last record, with ``state`` and ``error``.
    """

    level: ClassVar[str] = "error"
    reason: Literal["signal", "uncaught_exception"]
    signal: str | None = None
    error: ErrorInfo


class RunFinished(Event, tag="run_finished", kw_only=True):
    """The run reached ``done``; ``duration_ms`` from device-init to done."""

    duration_ms: float


class InstanceVerified(Event, tag="instance_verified", kw_only=True):
    """One built instance checked on a real batch against the float64 reference."""

    role: str
    backend: str
    max_rel_err: float
    tol: float
    passed: bool
    duration_ms: float = 0.0  # wall time of this instance's check (0 in traces written before it was recorded)


class RunnerStarted(Event, tag="runner_started", kw_only=True):
    """The runner's outer ``initialize()`` began: its own settings (layers, memory budget, aux layers)."""

    config: dict[str, Any]


class RunnerTransition(Event, tag="runner_transition", kw_only=True):
    """The runner's outer machine moved ``from`` → ``to`` by ``trigger``; ``duration_ms`` spent in ``from``."""

    from_state: str = msgspec.field(name="from")
    to: str
    trigger: str
    duration_ms: float


class DistributedInitialized(Event, tag="distributed_initialized", kw_only=True):
    """init-distributed: the world this rank belongs to and whether a CPU process group exists."""

    world_size: int
    has_cpu_group: bool
    source: str


class ModelLoaded(Event, tag="model_loaded", kw_only=True):
    """load-model: the attention stack built (random weights, fixed seed), its bytes, ``num_layers``,
    ``attention_layers`` and ``skipped_layers`` (``[{kind, layer_ids}]``; both None in older traces)."""

    num_layers: int
    num_hidden_layers: int
    param_bytes: int
    dtype: str
    seed: int
    aux_hidden_state_layers: list[int] | None = None
    attention_layers: int | None = None
    skipped_layers: list[dict[str, Any]] | None = None


class MemoryPoolSized(Event, tag="memory_pool_sized", kw_only=True):
    """init-memory-pool: size source, tokens and bytes of ``req_to_token`` and K/V; ``graph_bytes_estimate`` (decode
    graphs' pool, taken from the ``mem_fraction`` budget before ``budget_bytes``; 0 without graphs or in older traces).
    """

    source: str
    budget_bytes: int | None = None
    bytes_per_token: int
    num_token_slots: int
    max_reqs: int
    max_context_len: int
    page_size: int
    req_to_token_bytes: int
    kv_bytes: int
    graph_bytes_estimate: int = 0


class CudaGraphCaptured(Event, tag="cuda_graph_captured", kw_only=True):
    """One CUDA graph captured: ``bs``, capture time (warm-up included), ``mode`` (``decode``, ``target_verify``,
    ``draft_decode``). ``graph_bytes``: added to the shared private pool; ``device_bytes``: free memory before minus
    after (may be <= 0); ``graph_bytes_estimate``: :mod:`pipeline.memory.graphs`'s estimate (all 0 in older traces)."""

    bs: int
    capture_ms: float
    backend: str
    graph_bytes: int = 0
    device_bytes: int = 0
    graph_bytes_estimate: int = 0
    mode: str = "decode"


class CudaGraphMemory(Event, tag="cuda_graph_memory", kw_only=True):
    """Graph capture done: measured against :mod:`pipeline.memory.graphs`'s estimates (bytes). Estimates:
    ``pool_estimate``, ``state_estimate``, ``warmup_estimate`` (``blas_workspace_bytes`` of it), ``total_estimate``;
    measured: ``pool_bytes`` (``memory_snapshot()``), ``step_device_bytes``, ``prime_device_bytes``
    (:func:`pipeline.platforms.cuda.prime_capture`'s one-time costs; 0 when paid before or in older traces)."""

    backend: str
    batch_sizes: list[int]
    pool_estimate: int
    state_estimate: int
    warmup_estimate: int
    blas_workspace_bytes: int
    total_estimate: int
    pool_bytes: int
    step_device_bytes: int
    prime_device_bytes: int = 0

    @property
    def kept_estimate(self) -> int:
        """Bytes the capture step keeps: ``total_estimate`` less the warm-up's temporaries (compare
        ``step_device_bytes``)."""
        return self.total_estimate - self.warmup_estimate + self.blas_workspace_bytes


class ModelStepVerified(Event, tag="model_step_verified", kw_only=True):
    """One extend/decode step checked against the float64 dense reference; ``reference``: ``rounded``, ``mla-absorbed``
    or ``mla-unabsorbed`` (``""`` in older traces)."""

    step: str
    mode: str
    batch_size: int
    graph: bool
    max_rel_err: float
    tol: float
    passed: bool
    reference: str = ""


class RunnerReady(Event, tag="runner_ready", kw_only=True):
    """The runner reached ``ready``: total ``duration_ms``, the captured decode batch sizes and how the
    ranks agreed on the resolution (``single rank``, ``resolution_agreed``, or the recorded skip reason)."""

    duration_ms: float
    graph_batch_sizes: list[int] = []
    rank_agreement: str = ""


class CommandStarted(Event, tag="command_started", kw_only=True):
    """A command-line launch began: subcommand and arguments. Such a launch is ok only with ``command_finished`` exit 0.
    """

    command: str
    argv: list[str] = []


class CommandFinished(Event, tag="command_finished", kw_only=True):
    """The command's last record, on every exit it controls: ``exit_code`` (README's table; 130 after
    SIGINT) and ``duration_ms`` since ``command_started``."""

    command: str
    exit_code: int
    duration_ms: float


class Heartbeat(Event, tag="heartbeat", kw_only=True):
    """Emitted while a long step (JIT compile, graph capture) runs; ``started_ns`` (wall clock) and ``message``."""

    what: str
    elapsed_s: float
    started_ns: Ns = 0
    message: str = ""


class PhaseTime(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One named phase of a start: ``seconds`` of wall time; ``parent`` is ``""`` for a top-level phase
    (top-level phases are disjoint) or the phase it breaks down; ``detail`` e.g. a JIT variant's status."""

    name: str
    seconds: float
    parent: str = ""
    detail: str = ""


class StartupSummary(Event, tag="startup_summary", kw_only=True):
    """Where a launch's wall time went (:mod:`pipeline.observe.startup`), the last record before ``command_finished``.
    ``wall_s`` from ``process_start_ns`` (0 when unknown): ``created_ns`` moved past ``idle_before_start_s``;
    ``coverage`` = top-level phases / ``wall_s``."""

    wall_s: float
    phases: list[PhaseTime]
    unaccounted_s: float
    coverage: float
    process_start_ns: Ns = 0
    created_ns: Ns = 0
    idle_before_start_s: float = 0.0


class SlowPhase(Event, tag="slow_phase", kw_only=True):
    """A phase exceeded ``--slow-phase-s`` / ``ATTN_SETUP_SLOW_PHASE_S``, a warning; ``state``: the phase (or its
    parent)."""

    level: ClassVar[str] = "warning"
    retrospective: ClassVar[bool] = True  # about a phase that ended: not the state the run is in
    phase: str
    parent: str = ""
    seconds: float
    threshold_s: float


class JitVariantLoaded(Event, tag="jit_variant_loaded", kw_only=True):
    """A FlashInfer JIT variant loaded (``cached`` or ``compiling``), ``seconds`` from ``started_ns``, key ``fields``.
    """

    variant: str
    status: str
    seconds: float
    started_ns: Ns = 0
    fields: dict[str, Any] = {}


class EnvVarLookalike(Event, tag="env_var_lookalike", kw_only=True):
    """A set environment variable attn-setup does not read looks like one it does (a typo that would
    otherwise be ignored without a word): a warning naming the known variable."""

    level: ClassVar[str] = "warning"
    name: str
    known: str


AnyEvent = Union[
    RunStarted, StateTransition, DeviceInitialized, SettingResolved, BackendsResolved, ResolutionAgreed, BuildPlanned,
    RankStalled, MemoryBalanced,
    BackendBuilt, StepSkipped, FeatureDowngraded, ReferenceFallback, LazyMemInitialized, BackendsAnnotated,
    InstanceVerified, ResourcesReleased,
    Heartbeat, RunFailed, RunFinished, RunInterrupted, RunnerStarted, RunnerTransition, DistributedInitialized,
    ModelLoaded, MemoryPoolSized, CudaGraphCaptured, CudaGraphMemory, ModelStepVerified, RunnerReady, CommandStarted,
    CommandFinished,
    StartupSummary, SlowPhase, EnvVarLookalike, JitVariantLoaded,
]
EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]
_BY_TAG: dict[str, type[Event]] = {c.__struct_config__.tag: c for c in EVENT_TYPES}  # type: ignore[misc]


def event_name(cls: type[Event]) -> str:
    """The ``event`` tag of a record type (its stable snake_case name)."""
    return cls.__struct_config__.tag  # type: ignore[return-value]


def catalogue() -> list[tuple[str, str, list[str]]]:
    """(event name, level, fields beyond the common ones) for every record type — the README table."""
    common = set(Event.__struct_fields__)
    rows = []
    for cls in EVENT_TYPES:
        enc = dict(zip(cls.__struct_fields__, cls.__struct_encode_fields__))
        rows.append((event_name(cls), cls.level, [enc[f] for f in cls.__struct_fields__ if f not in common]))
    return rows


def catalogue_markdown() -> str:
    """The README's log-event table (between the ``events:begin``/``events:end`` markers)."""
    lines = ["| event | level | fields (besides schema_version, ts_ns, run_id, rank, launch_id, state, outcome) |",
             "|---|---|---|"]
    for name, level, fields in catalogue():
        lines.append(f"| `{name}` | {level} | {', '.join(f'`{f}`' for f in fields)} |")
    return "\n".join(lines)


def print_catalogue(stream: Any = None) -> int:
    """Write :func:`catalogue_markdown` to ``stream`` (stdout); returns 0, and ends quietly on a closed pipe."""
    import os
    import sys

    out = sys.stdout if stream is None else stream
    try:
        out.write(catalogue_markdown() + "\n")
        out.flush()
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        except (OSError, ValueError):  # not a file descriptor (a test's stream): nothing will flush to a pipe
            pass
    return 0


if __name__ == "__main__":  # python -m pipeline.core.events  → prints the README table
    raise SystemExit(print_catalogue())

