"""Observability event records: heartbeats of a long step, the startup accounting (``startup_summary``,
``slow_phase``), FlashInfer JIT variants and environment look-alikes. Import them from :mod:`pipeline.core.events`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from pipeline.core.event_base import Event, Ns


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
    logged when the phase ends (:mod:`pipeline.observe.slow_phase`), ``state`` = the phase (a child that is not a
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
