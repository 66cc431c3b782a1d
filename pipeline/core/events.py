"""Event records: one per transition and per decision, schema-versioned, a tagged union (:data:`AnyEvent`).

Details: docs/internals.md, ``pipeline.core.events``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec

from pipeline.core.contracts import (DeviceFacts, ErrorInfo, Evidence, InstancePlan, LayerGroup, Mode, Rejection,
    SCHEMA_VERSION, SpeculativeParams, WorkspacePlan)


Outcome = Literal["ok", "skipped", "failed"]
Ns = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # wall-clock ns (time.time_ns() fits int64)


class Event(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="event"):
    """Fields every record carries. ``level`` (class attribute) is the log level it is emitted at.

    ``launch_id`` identifies one process's :class:`~pipeline.core.eventlog.EventLog` (a launch): two
    launches that share a ``run_id`` and a log file (``ATTN_SETUP_RUN_ID`` reused, a retried start)
    stay separate runs when read back. ``""`` in traces written before the field existed.
    The reader refuses ``schema_version < 1``, ``ts_ns`` outside ``[0, 2**63)`` and ``rank < 0``
    (values the writer never produces).
    """

    level: ClassVar[str] = "info"
    schema_version: Annotated[int, msgspec.Meta(ge=1)] = SCHEMA_VERSION
    ts_ns: Ns
    run_id: str
    rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    launch_id: str = ""
    state: str
    outcome: Outcome = "ok"


class RunStarted(Event, tag="run_started", kw_only=True):
    """The inputs (redacted request, model, packages) and versions, so the run can be replayed. ``packages``: each
    distribution's presence as resolve saw it — False, True, or the installed version resolve checked against the
    supported range (traces recorded before that hold booleans, replayed as before)."""

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
    """Which source won for a setting: ``field`` > ``env`` > ``default`` for those sglang also reads
    from the environment; for ``dtype`` (state ``resolve``) ``field`` or ``auto:<rule>``, the rule of
    :data:`pipeline.core.dtypes.AUTO_RULES` that chose it."""

    field: str
    value: Any = None
    source: str
    env_var: str | None = None


class BackendsResolved(Event, tag="backends_resolved", kw_only=True):
    """resolve's decision: the pair, the rule per half, every rejected candidate with reasons, the
    model's layers that no attention backend serves (``not_attention``: linear attention, mamba) and the
    speculative shape served (``speculative``: steps, top-k, draft tokens and where they came from; None without
    speculative decoding) and, per half, the evidence for auto's choice (``evidence``: the measured table's row,
    ``unmeasured`` or ``explicit``)."""

    prefill: str
    decode: str
    is_draft_override: bool
    rules: dict[str, str]
    rejected: dict[str, list[Rejection]] = {}
    not_attention: list[LayerGroup] = []
    speculative: SpeculativeParams | None = None
    evidence: dict[str, Evidence] = {}


class RankRow(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One rank's line in the many-ranks table: where it runs and what it resolved.

    ``prefill``/``decode`` are ``"-"`` and ``error`` holds the error code when that rank's own
    resolve failed.
    """

    rank: int
    host: str
    device: str
    prefill: str
    decode: str
    is_draft_override: bool = False
    error: str | None = None


class ResolutionAgreed(Event, tag="resolution_agreed", kw_only=True):
    """Every rank of the launch resolved the same pair with the same attention args (resolve state).

    ``table`` has one :class:`RankRow` per rank, in rank order; ``duration_ms`` is the exchange.
    """

    world_size: int
    table: list[RankRow]
    duration_ms: float = 0.0


class RankStalled(Event, tag="rank_stalled", kw_only=True):
    """This rank waited ``waited_s`` seconds at ``waiting_at`` and rank ``stalled_rank`` never arrived
    (one record per missing rank, written by every waiting rank just before it fails).

    ``last_state``: the stalled rank's last published state (``"never heard"`` when none);
    ``seconds_since_heartbeat``: age of its last heartbeat (None when none); ``doing``: what it
    reported being busy with (``""`` when unknown). See :mod:`pipeline.setup.rank_watch`.
    """

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
    """One of the allowed downgrades, a warning: TBO dropped on a draft worker; CUDA graphs off on a CUDA
    device because the decode backend cannot be captured. ``avoid``: the fields that avoid it
    (``{"disable_cuda_graph": true}``, ``{"enable_two_batch_overlap": false}``); with ``strict`` it is refused."""

    level: ClassVar[str] = "warning"
    what: str
    reason: str
    avoid: dict[str, Any] = {}


class ReferenceFallback(Event, tag="reference_fallback", kw_only=True):
    """Auto-selection put ``torch_native``, the slow reference backend, on an accelerator: a warning.

    ``halves``: the halves that fell back; ``device``: type and arch; ``rejected``: every auto
    candidate refused for those halves, with every reason; ``avoid``: the field that accepts the
    reference backend explicitly (with ``strict`` the start is refused instead); ``message``: one line.
    """

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
    """The process is going away mid-run: a signal (``SIGTERM``) or an uncaught exception.

    The last record such a run writes; ``state`` is the state it was in, ``error`` says why.
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
    """load-model: the attention stack built (random weights, fixed seed) and its size in bytes.

    ``num_layers``: the hidden layers the stack spans (ids ``0..num_layers-1``); ``attention_layers``: how many of
    them are attention layers, built; ``skipped_layers``: the others (``[{kind, layer_ids}]``: a hybrid's
    linear-attention / mamba layers, not built). Both None in traces written before they were logged."""

    num_layers: int
    num_hidden_layers: int
    param_bytes: int
    dtype: str
    seed: int
    aux_hidden_state_layers: list[int] | None = None
    attention_layers: int | None = None
    skipped_layers: list[dict[str, Any]] | None = None


class MemoryPoolSized(Event, tag="memory_pool_sized", kw_only=True):
    """init-memory-pool: where the size came from, tokens and bytes of ``req_to_token`` and the K/V buffers.

    ``graph_bytes_estimate``: the decode CUDA graphs' estimated private pool (:mod:`pipeline.memory.graphs`), taken
    out of a ``mem_fraction`` budget before the pools were sized (``budget_bytes`` is what was left for them) and
    counted with them against free memory; 0 without graphs and in traces written before it was estimated."""

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
    """One decode CUDA graph captured: batch size and capture time (warm-up run included).

    ``graph_bytes``: bytes this batch size's capture added to the graphs' private memory pool (the sizes share one
    pool, captured largest first, so smaller sizes mostly reuse it); ``device_bytes``: device memory free before
    the capture minus free after (``torch.cuda.mem_get_info``; can be 0 or below when the allocator released
    cached blocks to make room). Both 0 in traces written before they were measured. ``graph_bytes_estimate``:
    what :mod:`pipeline.memory.graphs` estimated this size's capture adds to the pool (0 in older traces). ``mode``:
    the captured step (``decode``; a speculative worker's ``target_verify`` or ``draft_decode``, whose ``bs``
    requests hold ``num_draft_tokens`` or ``topk`` rows each).
    """

    bs: int
    capture_ms: float
    backend: str
    graph_bytes: int = 0
    device_bytes: int = 0
    graph_bytes_estimate: int = 0
    mode: str = "decode"


class CudaGraphMemory(Event, tag="cuda_graph_memory", kw_only=True):
    """Decode-graph capture done: what it took against what :mod:`pipeline.memory.graphs` estimated (bytes).

    Estimated, by part: ``pool_estimate`` (the graphs' private pool), ``state_estimate`` (buffers kept for replay:
    the runner's inputs, the backend's graph state and per-size wrappers), ``warmup_estimate`` (the warm-up stream's
    cached temporaries and its cuBLAS workspace, ``blas_workspace_bytes`` of it), ``total_estimate`` (their sum,
    what pool sizing set aside). Measured: ``pool_bytes`` (the private pool's segments,
    ``torch.cuda.memory_snapshot()``) and ``step_device_bytes`` (free device memory before the capture step's first
    buffer minus after its last capture). ``prime_device_bytes``: free device memory the process's one-time capture
    costs took before the pool budget was read (:func:`pipeline.platforms.cuda.prime_capture`: PyTorch's
    stream pool, lazily loaded graph machinery), outside the step and its estimate; 0 when the process had paid them
    before, and in older traces.
    """

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
        """Bytes the estimate says the capture step keeps once it is done: ``total_estimate`` less the warm-up's
        temporaries (``warmup_estimate`` minus its cuBLAS workspace), which ``torch.cuda.graph`` gives back with the
        ``empty_cache()`` before each capture. Compare it with ``step_device_bytes`` (measured after the last
        capture); ``total_estimate`` is the step's peak, what pool sizing sets aside."""
        return self.total_estimate - self.warmup_estimate + self.blas_workspace_bytes


class ModelStepVerified(Event, tag="model_step_verified", kw_only=True):
    """One extend/decode step of the attention stack checked against the float64 dense reference.

    ``reference``: which one (:attr:`pipeline.runtime.model_steps.StepCheck.reference`): ``rounded``, or for an MLA
    stack ``mla-absorbed`` (the kernel check) and ``mla-unabsorbed`` (the absorption check, two records per step);
    ``""`` in traces written before it was recorded."""

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
    """A command-line launch began (``attn-setup run``): the subcommand and its arguments.

    A launch that has one is ok (``inspect``) only when its ``command_finished`` says exit code 0:
    one killed after the runner reached ``ready`` but before its checks ended is incomplete.
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
    """Emitted while a long step (JIT compile, graph capture) is still running.

    ``started_ns`` (wall clock) is when the step began, so a timeline can draw it as a slice;
    ``message`` reads "still in <state>: <what> after N s".
    """

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
    """Where the wall time of a launch went (:mod:`pipeline.observe.startup`): the last record before
    ``command_finished``, on every exit it controls. ``wall_s`` from the process start
    (``process_start_ns``, 0 when unknown) to this record; ``coverage`` = top-level phases / ``wall_s``.
    The process start is its creation (``created_ns``, the kernel's ``fork`` time; 0 when unknown) moved past
    ``idle_before_start_s``: the time between creation and attn-setup's first code in which the process did not
    run (a shell's earlier commands before it ``exec``'d Python), which no phase and not ``wall_s`` counts."""

    wall_s: float
    phases: list[PhaseTime]
    unaccounted_s: float
    coverage: float
    process_start_ns: Ns = 0
    created_ns: Ns = 0
    idle_before_start_s: float = 0.0


class SlowPhase(Event, tag="slow_phase", kw_only=True):
    """A phase took longer than the threshold (``--slow-phase-s`` / ``ATTN_SETUP_SLOW_PHASE_S``): a warning,
    logged when the phase ends (:mod:`pipeline.observe.startup`), ``state`` = the phase (a child that is not a
    state: its parent)."""

    level: ClassVar[str] = "warning"
    retrospective: ClassVar[bool] = True  # about a phase that ended: not the state the run is in
    phase: str
    parent: str = ""
    seconds: float
    threshold_s: float


class JitVariantLoaded(Event, tag="jit_variant_loaded", kw_only=True):
    """A FlashInfer JIT variant a backend of this run loaded: found ``cached`` or ``compiling`` (then
    compiled), ``seconds`` from ``started_ns`` (wall clock); ``fields``: the variant's key fields (kind,
    backend, dtypes, head dims, sliding window / softcap switches, arch). Written at the end of ``run``."""

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
    """Write :func:`catalogue_markdown` to ``stream`` (stdout) for ``python -m pipeline.core.events``; returns the
    exit code, 0. A reader that leaves early (``| head -3``) ends it quietly, as it does the CLI's commands: the
    rest is dropped and stdout pointed at /dev/null, so the interpreter's last flush finds no closed pipe."""
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

