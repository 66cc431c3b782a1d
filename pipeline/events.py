"""Event records: one per transition and per decision, schema-versioned, a tagged union.

Every record carries ``schema_version``, ``ts_ns`` (wall clock, ns), ``run_id``, ``rank``, ``state``
and ``outcome`` ∈ {ok, skipped, failed}; the ``event`` tag names it (stable snake_case). A run's
records, one JSON object a line, are its trace: :func:`decode_line` reads one back into its type.

Schema policy: ``schema_version`` rises when a field is removed or changes meaning; adding a field
with a default does not. Readers accept versions ``<= SCHEMA_VERSION``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

import msgspec

from pipeline.contracts import (
    SCHEMA_VERSION, DeviceFacts, ErrorInfo, InstancePlan, LayerGroup, Mode, Rejection, WorkspacePlan,
)

Outcome = Literal["ok", "skipped", "failed"]


class Event(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="event"):
    """Fields every record carries. ``level`` (class attribute) is the log level it is emitted at."""

    level: ClassVar[str] = "info"
    schema_version: int = SCHEMA_VERSION
    ts_ns: int
    run_id: str
    rank: int = 0
    state: str
    outcome: Outcome = "ok"


class RunStarted(Event, tag="run_started", kw_only=True):
    """The inputs (redacted request, model, packages) and versions, so the run can be replayed."""

    request: dict[str, Any]
    versions: dict[str, str | None] = {}
    packages: dict[str, bool] = {}
    platform: str = ""


class StateTransition(Event, tag="state_transition", kw_only=True):
    """The machine moved ``from`` → ``to`` by ``trigger``; ``duration_ms`` spent in ``from``."""

    from_state: str = msgspec.field(name="from")
    to: str
    trigger: str
    duration_ms: float


class DeviceInitialized(Event, tag="device_initialized", kw_only=True):
    """device-init's result: the device facts and whether BLAS was initialised (cuda/musa only)."""

    facts: DeviceFacts
    blas_init: bool


class SettingResolved(Event, tag="setting_resolved", kw_only=True):
    """Which source won for a setting: ``field`` > ``env`` > ``default`` for those sglang also reads
    from the environment; for ``dtype`` (state ``resolve``) ``field`` or ``auto:<rule>``, the rule of
    :data:`pipeline.dtypes.AUTO_RULES` that chose it."""

    field: str
    value: Any = None
    source: str
    env_var: str | None = None


class BackendsResolved(Event, tag="backends_resolved", kw_only=True):
    """resolve's decision: the pair, the rule per half, every rejected candidate with reasons, and the
    model's layers that no attention backend serves (``not_attention``: linear attention, mamba)."""

    prefill: str
    decode: str
    is_draft_override: bool
    rules: dict[str, str]
    rejected: dict[str, list[Rejection]] = {}
    not_attention: list[LayerGroup] = []


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


class InstanceVerified(Event, tag="instance_verified", kw_only=True):
    """One built instance checked on a real batch against the float64 reference."""

    role: str
    backend: str
    max_rel_err: float
    tol: float
    passed: bool


class ResourcesReleased(Event, tag="resources_released", kw_only=True):
    """What a failed run (or ``close()``) released: workspace ids and backend roles."""

    released: list[str]


class Heartbeat(Event, tag="heartbeat", kw_only=True):
    """Emitted while a long step (JIT compile, graph capture) is still running.

    ``started_ns`` (wall clock) is when the step began, so a timeline can draw it as a slice;
    ``message`` reads "still in <state>: <what> after N s".
    """

    what: str
    elapsed_s: float
    started_ns: int = 0
    message: str = ""


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
    """load-model: the attention stack built (random weights, fixed seed) and its size in bytes."""

    num_layers: int
    num_hidden_layers: int
    param_bytes: int
    dtype: str
    seed: int
    aux_hidden_state_layers: list[int] | None = None


class MemoryPoolSized(Event, tag="memory_pool_sized", kw_only=True):
    """init-memory-pool: where the size came from, tokens and bytes of ``req_to_token`` and the K/V buffers."""

    source: str
    budget_bytes: int | None = None
    bytes_per_token: int
    num_token_slots: int
    max_reqs: int
    max_context_len: int
    page_size: int
    req_to_token_bytes: int
    kv_bytes: int


class CudaGraphCaptured(Event, tag="cuda_graph_captured", kw_only=True):
    """One decode CUDA graph captured: batch size and capture time (warm-up run included)."""

    bs: int
    capture_ms: float
    backend: str


class ModelStepVerified(Event, tag="model_step_verified", kw_only=True):
    """One extend/decode step of the attention stack checked against the float64 dense reference."""

    step: str
    mode: str
    batch_size: int
    graph: bool
    max_rel_err: float
    tol: float
    passed: bool


class RunnerReady(Event, tag="runner_ready", kw_only=True):
    """The runner reached ``ready``: total ``duration_ms``, the captured decode batch sizes and how the
    ranks agreed on the resolution (``single rank``, ``resolution_agreed``, or the recorded skip reason)."""

    duration_ms: float
    graph_batch_sizes: list[int] = []
    rank_agreement: str = ""


AnyEvent = Union[
    RunStarted, StateTransition, DeviceInitialized, SettingResolved, BackendsResolved, ResolutionAgreed, BuildPlanned,
    BackendBuilt, StepSkipped, FeatureDowngraded, ReferenceFallback, LazyMemInitialized, BackendsAnnotated,
    InstanceVerified, ResourcesReleased,
    Heartbeat, RunFailed, RunFinished, RunInterrupted, RunnerStarted, RunnerTransition, DistributedInitialized,
    ModelLoaded, MemoryPoolSized, CudaGraphCaptured, ModelStepVerified, RunnerReady,
]
EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]

_decoder = msgspec.json.Decoder(AnyEvent)
_encoder = msgspec.json.Encoder()


def encode(event: Event) -> bytes:
    """One JSON line (without the newline)."""
    return _encoder.encode(event)


def decode_line(line: bytes | str) -> Event:
    """Decode one JSON line back into its typed record (raises ``msgspec.DecodeError``/``ValidationError``)."""
    return _decoder.decode(line)


def event_name(cls: type[Event]) -> str:
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
    lines = ["| event | level | fields (besides schema_version, ts_ns, run_id, rank, state, outcome) |",
             "|---|---|---|"]
    for name, level, fields in catalogue():
        lines.append(f"| `{name}` | {level} | {', '.join(f'`{f}`' for f in fields)} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m pipeline.events  → prints the README table
    print(catalogue_markdown())
