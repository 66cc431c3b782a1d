"""The setup machine's event records: its inputs, every transition and decision from device-init to done, a refusal
or failure, and what was released. Import them from :mod:`pipeline.core.events`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from pipeline.core.contracts import DeviceFacts, ErrorInfo, InstancePlan, LayerGroup, Mode, Rejection, WorkspacePlan
from pipeline.core.event_base import Event


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
