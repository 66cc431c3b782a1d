"""Event records: one per transition and per decision, schema-versioned, a tagged union.

Every record carries ``schema_version``, ``ts_ns`` (wall clock, ns), ``run_id``, ``rank``, ``state``
and ``outcome`` ∈ {ok, skipped, failed}; the ``event`` tag names it (stable snake_case). A run's
records, one JSON object a line, are its trace: :func:`decode_line` reads one back into its type.

Schema policy: ``schema_version`` rises when a field is removed or changes meaning; adding a field
with a default does not. Readers accept versions ``1 ..= SCHEMA_VERSION`` (``launch_id`` was added
with a default, so traces written before it read as launch ``""``).

Wire form (:func:`encode` / :func:`decode_line`): JSON has no NaN or infinity, and msgspec would
write them as ``null`` — a value the reader then refuses for a ``float`` field, dropping the whole
record. So a non-finite float is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
(the spelling protobuf's JSON mapping uses for them) and a ``float`` field holding one of those
strings reads back as the float; ``null`` in a ``float`` field that cannot be None (what older
versions wrote for them) reads back as NaN. Inside free-form fields
(``Any``: a request, a config) the string stays a string. A string holding a lone UTF-16 surrogate
(which UTF-8 cannot encode) is written with the surrogate as the text ``\\udXXX``; a free-form value
nested deeper than readers keep is written as ``"<nested too deep>"``. Every record
therefore encodes, and every record encoded reads back (``tests/test_event_wire.py`` checks it over
every record type with hypothesis).
"""

from __future__ import annotations

import math
import threading
from typing import Annotated, Any, Callable, ClassVar, Iterator, Literal, Mapping, Optional, Union

import msgspec
import msgspec.inspect as mi

from pipeline.core.contracts import (
    SCHEMA_VERSION, DeviceFacts, ErrorInfo, InstancePlan, LayerGroup, Mode, Rejection, WorkspacePlan,
)

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
    :data:`pipeline.core.dtypes.AUTO_RULES` that chose it."""

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


class InstanceVerified(Event, tag="instance_verified", kw_only=True):
    """One built instance checked on a real batch against the float64 reference."""

    role: str
    backend: str
    max_rel_err: float
    tol: float
    passed: bool
    duration_ms: float = 0.0  # wall time of this instance's check (0 in traces written before it was recorded)


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
    started_ns: Ns = 0
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
    """One decode CUDA graph captured: batch size and capture time (warm-up run included).

    ``graph_bytes``: bytes this batch size's capture added to the graphs' private memory pool (the sizes share one
    pool, captured largest first, so smaller sizes mostly reuse it); ``device_bytes``: device memory free before
    the capture minus free after (``torch.cuda.mem_get_info``; can be 0 or below when the allocator released
    cached blocks to make room). Both 0 in traces written before they were measured.
    """

    bs: int
    capture_ms: float
    backend: str
    graph_bytes: int = 0
    device_bytes: int = 0


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
    (``process_start_ns``, 0 when unknown) to this record; ``coverage`` = top-level phases / ``wall_s``."""

    wall_s: float
    phases: list[PhaseTime]
    unaccounted_s: float
    coverage: float
    process_start_ns: Ns = 0


class SlowPhase(Event, tag="slow_phase", kw_only=True):
    """A phase took longer than the threshold (``--slow-phase-s`` / ``ATTN_SETUP_SLOW_PHASE_S``): a warning."""

    level: ClassVar[str] = "warning"
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
    ModelLoaded, MemoryPoolSized, CudaGraphCaptured, ModelStepVerified, RunnerReady, CommandStarted, CommandFinished,
    StartupSummary, SlowPhase, EnvVarLookalike, JitVariantLoaded,
]
EVENT_TYPES: tuple[type[Event], ...] = AnyEvent.__args__  # type: ignore[attr-defined]
_BY_TAG: dict[str, type[Event]] = {c.__struct_config__.tag: c for c in EVENT_TYPES}  # type: ignore[misc]

_decoder = msgspec.json.Decoder(AnyEvent)
_encoder = msgspec.json.Encoder()

# Envelope fields: identifiers the library writes itself, never redacted (a secret equal to a state
# name or a run id must not rewrite the record's identity).
ENVELOPE = ("event", "schema_version", "ts_ns", "run_id", "rank", "launch_id", "state", "outcome")
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float_text(x: float) -> str:
    return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")


def clean_str(s: str) -> str:
    """Public name of :func:`_clean_str` (the redactor escapes secrets the same way)."""
    return _clean_str(s)


def _clean_str(s: str) -> str:
    """``s`` unchanged, or with lone surrogates written as ``\\udXXX`` text (UTF-8 cannot hold them)."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


MAX_DEPTH = 64  # readers skip records nested deeper (``too_deep``); ours nest 6 deep
_VALUE_DEPTH = MAX_DEPTH - 8  # below a field, leaving room for the record around it
TOO_DEEP = "<nested too deep>"


def _wire(x: Any, redact: Optional[Callable[[str], str]], depth: int = 0, closed: Any = None) -> Any:
    """Builtins ready for JSON: non-finite floats as text, strings cleaned (and redacted, except where
    ``closed`` marks a Literal/Enum value, which redaction would make invalid), and a container nested
    deeper than a reader keeps replaced by :data:`TOO_DEEP`."""
    t = type(x)
    if t is str:
        return redact(_clean_str(x)) if redact is not None and closed is not True else _clean_str(x)
    if t is float:
        return x if math.isfinite(x) else _float_text(x)
    if t is dict or t is list or t is tuple:
        if depth >= _VALUE_DEPTH:
            return TOO_DEEP
        sub = closed[1] if isinstance(closed, tuple) else None
        if t is dict:
            keyed = closed if isinstance(closed, dict) else None
            return {_clean_str(k) if type(k) is str else k:
                    _wire(v, redact, depth + 1, keyed.get(k) if keyed is not None else sub) for k, v in x.items()}
        return [_wire(v, redact, depth + 1, sub) for v in x]
    return x


def _closed_spec(t: Any, memo: dict[type, Any]) -> Any:
    """Where a msgspec type holds Literal/Enum values: True, a dict field → spec (a Struct),
    ("seq"/"map", spec) for containers, or None."""
    if isinstance(t, (mi.LiteralType, mi.EnumType)):
        return True
    if isinstance(t, mi.UnionType):
        specs = [x for x in (_closed_spec(u, memo) for u in t.types) if x is not None]
        return specs[0] if specs else None
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        inner = _closed_spec(t.item_type, memo)
        return None if inner is None else ("seq", inner)
    if isinstance(t, mi.TupleType):
        specs = [x for x in (_closed_spec(u, memo) for u in t.item_types) if x is not None]
        return ("seq", specs[0]) if specs else None
    if isinstance(t, mi.DictType):
        inner = _closed_spec(t.value_type, memo)
        return None if inner is None else ("map", inner)
    if isinstance(t, mi.StructType):
        if t.cls in memo:
            return memo[t.cls]
        memo[t.cls] = None
        fields = {f.encode_name: x for f in t.fields if (x := _closed_spec(f.type, memo)) is not None}
        memo[t.cls] = fields or None
        return memo[t.cls]
    return None


_CLOSED: dict[type, dict[str, Any]] = {}


def to_wire(event: Event, redact: Optional[Callable[[str], str]] = None) -> dict[str, Any]:
    """The record as the JSON object written for it: builtins, non-finite floats as ``"NaN"`` /
    ``"Infinity"`` / ``"-Infinity"``, lone surrogates escaped, and — with ``redact`` — every string
    *value* outside the envelope (:data:`ENVELOPE`) and outside Literal/Enum fields passed through
    ``redact`` after escaping (keys never are; ``redact`` gets text as written, so it must match
    secrets in that form too — see :func:`pipeline.core.eventlog.redactor`)."""
    cls = type(event)
    closed = _CLOSED.get(cls)
    if closed is None:
        closed = _CLOSED[cls] = _closed_spec(mi.type_info(cls), {}) or {}
    obj = msgspec.to_builtins(event)
    return {k: (_wire(v, None) if k in ENVELOPE else _wire(v, redact, 0, closed.get(k))) for k, v in obj.items()}


def _finite(x: Any) -> bool:
    return x is None or type(x) is not float or math.isfinite(x)


def _needs_wire(x: Any, depth: int = 0) -> bool:
    """Whether a free-form value holds a non-finite float or nests too deep for the fast path."""
    t = type(x)
    if t is float:
        return not math.isfinite(x)
    if t is dict or t is list or t is tuple or isinstance(x, msgspec.Struct):
        if depth >= _VALUE_DEPTH - 2:  # a Struct's builtins may add a level or two
            return True
        if t is dict:
            return any(_needs_wire(v, depth + 1) for v in x.values())
        if t is list or t is tuple:
            return any(_needs_wire(v, depth + 1) for v in x)
        return any(_needs_wire(getattr(x, f), depth + 1) for f in x.__struct_fields__)
    return False


def encode(event: Event, redact: Optional[Callable[[str], str]] = None) -> bytes:
    """One JSON line (without the newline); see :func:`to_wire`. Never raises for a well-typed record,
    and never writes one a reader skips (a free-form value nested deeper than :data:`MAX_DEPTH`
    allows is written as :data:`TOO_DEEP`).

    Without ``redact``, a record with only finite floats and UTF-8-encodable strings (nearly all) is
    encoded by msgspec directly — the same bytes, without building its builtins first.
    """
    if redact is None:
        floats, anys = _fast_plan(type(event))
        if floats is not None and all(_finite(getattr(event, f)) for f in floats) and not any(
                _needs_wire(getattr(event, f)) for f in anys):
            try:
                return _encoder.encode(event)
            except UnicodeEncodeError:  # a lone surrogate: the wire form escapes it
                pass
    return _encoder.encode(to_wire(event, redact))


def _contains_any(t: Any, seen: set[type]) -> bool:
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.UnionType):
        return any(_contains_any(u, seen) for u in t.types)
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return _contains_any(t.item_type, seen)
    if isinstance(t, mi.TupleType):
        return any(_contains_any(u, seen) for u in t.item_types)
    if isinstance(t, mi.DictType):
        return _contains_any(t.value_type, seen)
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return False
        seen.add(t.cls)
        return any(_contains_any(f.type, seen) for f in t.fields)
    return False


_PLANS: dict[type, tuple[Optional[tuple[str, ...]], tuple[str, ...]]] = {}


def _fast_plan(cls: type) -> tuple[Optional[tuple[str, ...]], tuple[str, ...]]:
    """(top-level float fields, fields that may hold free-form values) of ``cls``; floats None when a
    float sits deeper inside a typed field (then the wire form is always built)."""
    plan = _PLANS.get(cls)
    if plan is None:
        info = mi.type_info(cls)
        spec = _float_spec(info, {}) or {}
        nested = any(v not in ("f", "f?") for v in spec.values())
        by_enc = {f.encode_name: f.name for f in info.fields}
        floats = None if nested else tuple(by_enc[k] for k in spec)
        anys = tuple(f.name for f in info.fields if _contains_any(f.type, set()))
        plan = _PLANS[cls] = (floats, anys)
    return plan


def _float_spec(t: Any, memo: dict[type, Any]) -> Any:
    """Where a msgspec type holds floats: "f" (a float), "f?" (a float or None), a dict field → spec (a
    Struct), ("seq", spec) / ("map", spec) for containers, or None (no float inside)."""
    if isinstance(t, mi.FloatType):
        return "f"
    if isinstance(t, mi.UnionType):
        specs = [s for s in (_float_spec(u, memo) for u in t.types) if s is not None]
        if not specs:
            return None
        return "f?" if specs[0] == "f" and t.includes_none else specs[0]
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        s = _float_spec(t.item_type, memo)
        return None if s is None else ("seq", s)
    if isinstance(t, mi.TupleType):
        specs = [s for s in (_float_spec(u, memo) for u in t.item_types) if s is not None]
        return ("seq", specs[0]) if specs else None
    if isinstance(t, mi.DictType):
        s = _float_spec(t.value_type, memo)
        return None if s is None else ("map", s)
    if isinstance(t, mi.StructType):
        if t.cls in memo:
            return memo[t.cls]
        memo[t.cls] = None
        fields = {f.encode_name: s for f in t.fields if (s := _float_spec(f.type, memo)) is not None}
        memo[t.cls] = fields or None
        return memo[t.cls]
    return None


def _restore(x: Any, spec: Any) -> Any:
    if spec == "f" or spec == "f?":
        if type(x) is str:
            return NONFINITE.get(x, x)
        # null in a float field that cannot be None: what msgspec wrote for NaN/inf before the text
        # form existed (a trace from an older attn-setup) — read it as NaN rather than drop the record
        return math.nan if x is None and spec == "f" else x
    if isinstance(spec, dict):
        if type(x) is not dict:
            return x
        return {k: (_restore(v, spec[k]) if k in spec else v) for k, v in x.items()}
    kind, inner = spec
    if kind == "seq" and type(x) is list:
        return [_restore(v, inner) for v in x]
    if kind == "map" and type(x) is dict:
        return {k: _restore(v, inner) for k, v in x.items()}
    return x


class _FloatFields(Mapping[str, Any]):
    """Event tag → where its float fields are (see :func:`_float_spec`; for ``"NaN"``/``"Infinity"`` text).

    Computed per tag on first lookup, not at import: ``msgspec.inspect.type_info`` over every record type
    took ~70 % of this module's import time, paid by every process (``plan`` included) whether or not it
    ever reads a record with a non-finite float.
    """

    def __init__(self) -> None:
        self._memo: dict[type, Any] = {}
        self._specs: dict[str, Any] = {}
        self._lock = threading.Lock()  # the memo holds a placeholder while a Struct is being walked

    def __getitem__(self, tag: str) -> Any:
        try:
            return self._specs[tag]
        except KeyError:
            cls = _BY_TAG[tag]  # KeyError for an unknown tag, as a dict
            with self._lock:
                if tag not in self._specs:
                    self._specs[tag] = _float_spec(mi.type_info(cls), self._memo)
            return self._specs[tag]

    def __iter__(self) -> Iterator[str]:
        return iter(_BY_TAG)

    def __len__(self) -> int:
        return len(_BY_TAG)


FLOAT_FIELDS: Mapping[str, Any] = _FloatFields()


def restore_floats(obj: dict[str, Any]) -> dict[str, Any]:
    """The decoded JSON object of a record with ``"NaN"``/``"Infinity"``/``"-Infinity"`` turned back
    into floats where the record type has a ``float`` field (nested Structs included)."""
    spec = FLOAT_FIELDS.get(obj.get("event")) if type(obj.get("event")) is str else None
    return obj if spec is None else _restore(obj, spec)


def decode_line(line: bytes | str) -> Event:
    """Decode one JSON line back into its typed record (raises ``msgspec.DecodeError``/``ValidationError``).

    Non-finite floats written as text (see the module docstring) read back as floats.
    """
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError:
        obj = msgspec.json.decode(line)
        if not isinstance(obj, dict):
            raise
        return msgspec.convert(restore_floats(obj), AnyEvent)


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
    lines = ["| event | level | fields (besides schema_version, ts_ns, run_id, rank, launch_id, state, outcome) |",
             "|---|---|---|"]
    for name, level, fields in catalogue():
        lines.append(f"| `{name}` | {level} | {', '.join(f'`{f}`' for f in fields)} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m pipeline.core.events  → prints the README table
    print(catalogue_markdown())
