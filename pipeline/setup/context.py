"""What the setup machine's steps share: :class:`SetupModel` (what each step established, read by guards) and
:class:`SetupContext` (inputs, decisions and, in run mode, the log, machine and what was built)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional

from pipeline.core import events as ev
from pipeline.core.contracts import BuildPlan, DeviceFacts, Resolution, SetupRequest
from pipeline.core.eventlog import EventLog
from pipeline.core.faults import Faults
from pipeline.core.settings import Setting

SINGLE_RANK = "single rank: agrees trivially"


class DeviceDecision(NamedTuple):
    """device-init's decision: the device facts and whether BLAS is initialised (cuda/musa, as sglang)."""

    facts: DeviceFacts
    blas: bool


class BuildDecision(NamedTuple):
    """build-mode's decision: the settings that sized the workspaces (the ones logged), each backend's workspace
    bytes, the plan and whether decode CUDA graphs are captured (:class:`states.build_mode.GraphDecision`)."""

    settings: list[Setting]
    workspace_bytes: dict[str, int]
    plan: BuildPlan
    graphs: Any

    def graph_max_bs(self, request: SetupRequest, device: DeviceFacts) -> int:
        """The largest decode batch captured as a graph on ``device`` (0 without graphs): the last capture size."""
        from states.build_mode import graph_max_bs

        return graph_max_bs(request.args, request.pool.max_reqs, self.graphs.capture, device=device,
                            world_size=request.tp_size)


class LazyDecision(NamedTuple):
    """npu-lazy-mem's decision: the zbal size setting and :class:`states.npu_lazy_mem.LazyMemDecision`."""

    setting: Setting
    decision: Any


class Agreement(NamedTuple):
    """How the ranks agreed on the resolution: ``agreed`` (one rank, or every rank's resolution exchanged and
    equal) or not checked (``detail`` says why: no rank group was given)."""

    agreed: bool
    detail: str


@dataclass
class Built:
    """What build-mode made: the top-level backend, the decode backend (group) and every instance by role."""

    plan: Optional[BuildPlan] = None
    attn_backend: Any = None
    decode_attn_backend: Any = None
    decode_attn_backend_group: list[Any] = field(default_factory=list)
    instances: dict[str, Any] = field(default_factory=dict)

    def complete(self) -> bool:
        return self.plan is not None and self.attn_backend is not None and all(
            i.role in self.instances for i in self.plan.instances)


class SetupModel:
    """The setup machine's model: what each step established; the guards read only this."""

    def __init__(self) -> None:
        # Attribute names must not collide with trigger names (pytransitions adds a method per trigger).
        self.device_facts: Optional[DeviceFacts] = None
        self.resolution: Optional[Resolution] = None
        self.backends: Any = None   # Built
        self.lazy_mem: Any = None   # "done" or the skip reason
        self.names_set = False
        self.state: Any = None

    def has_device_facts(self) -> bool:
        return self.device_facts is not None

    def has_resolution(self) -> bool:
        r = self.resolution
        return r is not None and bool(r.pair.prefill) and bool(r.pair.decode)

    def has_backends(self) -> bool:
        return self.backends is not None and self.backends.complete()

    def has_lazy_mem_outcome(self) -> bool:
        return self.lazy_mem is not None

    def has_names(self) -> bool:
        return self.names_set


class SetupContext:
    """One setup's inputs, decisions and effects. ``facts``: given instead of read from ``platform`` (``plan``, replay);
    ``installed``: given presence (None: imports checked against metadata); ``env``: where ``SGLANG_*`` settings are
    read. Run mode: the log, ``pools`` (None: built here), CPU / rank groups, test-only ``faults``."""

    def __init__(self, request: SetupRequest, *, platform: Any = None, facts: Optional[DeviceFacts] = None,
                 installed: Optional[Mapping[str, bool]] = None, env: Mapping[str, str] = os.environ,
                 log: Optional[EventLog] = None, pools: Optional[Mapping[str, Any]] = None, cpu_group: Any = None,
                 rank_group: Any = None, faults: Optional[Faults] = None) -> None:
        from pipeline.backends.packages import installed_by_import

        self.request, self.platform, self.facts, self.env = request, platform, facts, env
        self.import_errors: dict[str, str] = {}
        self.installed_given = installed is not None
        self.installed = dict(installed) if installed is not None else installed_by_import(errors=self.import_errors)
        self.log, self.faults, self.rank_group = log, faults, rank_group
        self.cpu_group = cpu_group if cpu_group is not None or rank_group is None else rank_group.cpu_group
        self.given_pools = pools
        self.pools: dict[str, Any] = dict(pools or {})
        self.workspace_pool: Any = None
        self.torch_device = "cpu"
        self.built = Built()
        self.agreement = Agreement(True, SINGLE_RANK)
        self.model = SetupModel()
        self.machine: Any = None
        # many ranks with a store: heartbeats and named stalls (pipeline.setup.rank_watch)
        self.watch: Any = None
        self.beats: Any = None  # the watch's heartbeat thread while a run is in progress
        if rank_group is not None and request.world_size > 1:
            from pipeline.setup.rank_watch import watch_for

            self.watch = watch_for(rank_group)
        # the decisions, kept by the driver under each step's ``result``
        self.device: Optional[DeviceDecision] = None
        self.resolution: Optional[Resolution] = None
        self.build: Optional[BuildDecision] = None
        self.lazy: Optional[LazyDecision] = None

    @property
    def state(self) -> str:
        return self.machine.state.value

    def emit(self, cls: type[ev.Event], **fields: Any) -> None:
        """Log a record in the current state."""
        self.log.emit(cls, state=self.state, **fields)

    def emit_skips(self, skips: Any) -> None:
        """A downgrade is a ``feature_downgraded`` warning; a feature that does not apply here a ``step_skipped``."""
        for s in skips:
            if s.downgrade:
                self.emit(ev.FeatureDowngraded, outcome="skipped", what=s.what, reason=s.reason, avoid=dict(s.avoid))
            else:
                self.emit(ev.StepSkipped, outcome="skipped", what=s.what, reason=s.reason)
