"""One definition of what a run's records say: its state timelines (which state ran, was skipped, failed or
never ended) and its verification failure.

``attn-setup run``'s report (from the records it just wrote) and :class:`pipeline.observe.trace.Run`
(``inspect``, ``graph``, Perfetto: from a trace file) both read them here, so the two cannot disagree.

The machines, their terminal states and the ``step_skipped`` ``what`` that marks a whole state as skipped
come from the step tables (:data:`pipeline.setup.table.SETUP`, :data:`pipeline.runtime.table.RUNNER`), not
from a list spelled here. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Optional, Sequence

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import DeviceFacts, ErrorInfo
from pipeline.core.steps import StepTable

__all__ = ["machines", "step_skips", "VERIFY_REMEDY", "ms_to_ns", "s_to_ns", "timeline", "outcomes",
           "verification_failure", "device_view", "device_from"]


@functools.lru_cache(maxsize=None)
def machines() -> dict[str, StepTable]:
    """``{"setup": SETUP, "runner": RUNNER}`` (imported on first use: reading a trace needs them, ``plan`` does not)."""
    from pipeline.runtime.table import RUNNER
    from pipeline.setup.table import SETUP

    return {SETUP.machine: SETUP, RUNNER.machine: RUNNER}


@functools.lru_cache(maxsize=None)
def step_skips() -> frozenset[str]:
    """``step_skipped`` ``what`` values that mean a whole state did no work (npu-lazy-mem, capture-cuda-graphs), from
    the tables; other step_skipped records (cuda_graph in resolve, rank_agreement) are decisions inside a state
    that ran."""
    return frozenset(s.skip for t in machines().values() for s in t.steps if s.skip)

_NS_LIMIT = 1 << 62
VERIFY_REMEDY = "the backend computes wrong attention for this model; report it with the log"


def ms_to_ns(ms: float) -> int:
    """Milliseconds → integer ns, saturating: NaN → 0, ±inf and absurd values clamp to ±2**62 ns.

    Recorded durations come from files that may hold anything (``1e308``, ``"NaN"``); a timeline
    must still be drawable from them.
    """
    if ms != ms:
        return 0
    ns = ms * 1e6
    return int(max(-_NS_LIMIT, min(_NS_LIMIT, ns))) if math.isfinite(ns) else (_NS_LIMIT if ns > 0 else -_NS_LIMIT)


def s_to_ns(sec: float) -> int:
    """Seconds → integer ns, saturating like :func:`ms_to_ns`."""
    return ms_to_ns(sec * 1e3) if sec == sec else 0


def timeline(records: Sequence[ev.Event], machine: str, first: Optional[ev.Event] = None,
             failed: bool = False) -> list[dict[str, Any]]:
    """``[{state, start_ns, duration_ms, outcome}]``: one row per state of ``machine`` (``setup``/``runner``)
    entered, in order, from its transition records after ``first`` (default: the first record).

    ``outcome``: ok · skipped (the state's own step was skipped: :func:`step_skips`) · failed (left by ``fail``,
    or the last state of a run that ``failed`` without reaching a terminal state) · incomplete (the state the run
    was last seen in, when it never ended). A state began ``duration_ms`` before it was left (its own clock, which
    also covers work done before the first record was written). Empty without records.
    """
    if not records:
        return []
    table = machines()[machine]
    first = records[0] if first is None else first
    skipped = {r.state for r in records if isinstance(r, ev.StepSkipped) and r.what in step_skips()}
    start, cur = first.ts_ns, first.state
    rows: list[dict[str, Any]] = []
    for t in records:
        if type(t) is not table.event:
            continue
        outcome = "failed" if t.to == table.failed else ("skipped" if t.from_state in skipped else "ok")
        rows.append({"state": t.from_state, "start_ns": min(start, t.ts_ns - ms_to_ns(t.duration_ms)),
                     "duration_ms": t.duration_ms, "outcome": outcome})
        start, cur = t.ts_ns, t.to
    if cur in table.terminal:
        rows.append({"state": cur, "start_ns": start, "duration_ms": 0.0,
                     "outcome": "ok" if cur == table.success else "failed"})
    else:
        rows.append({"state": cur, "start_ns": start, "duration_ms": max(0, records[-1].ts_ns - start) / 1e6,
                     "outcome": "failed" if failed else "incomplete"})
    return rows


def outcomes(records: Sequence[ev.Event], machine: str) -> list[dict[str, Any]]:
    """``[{state, outcome, duration_ms}]`` of the states ``machine`` left or ended in (run's report: ``states``,
    ``runner_states``): :func:`timeline`'s rows without the start and without a state never left; durations
    rounded to µs."""
    table = machines()[machine]
    if not any(type(r) is table.event for r in records):
        return []
    rows = timeline(records, machine)
    if rows[-1]["state"] not in table.terminal:
        rows = rows[:-1]
    return [{"state": r["state"], "outcome": r["outcome"], "duration_ms": round(r["duration_ms"], 3)} for r in rows]


def tol_text(tol: float) -> str:
    """A tolerance as the reports print it: one digit when that is exact (``1e-02``), else three
    (``1.43e-02``: the MLA absorption check's tolerance is derived per step, :mod:`pipeline.runtime.model_steps`)."""
    short = f"{tol:.0e}"
    return short if float(short) == tol else f"{tol:.2e}"


def verification_failure(records: Iterable[ev.Event]) -> Optional[ErrorInfo]:
    """The ``verification_failed`` ErrorInfo of the failed ``instance_verified`` and ``model_step_verified``
    records (None when none failed): each instance as ``role (backend: max_rel_err > tol)``, each model step as
    ``step (graph|eager: max_rel_err > tol)`` — ``step (eager, mla-unabsorbed: …)`` when an MLA reference judged it
    (the ``rounded`` reference and traces without one are not named). ``state``: ``done`` when an instance failed
    (setup's last state), else ``ready`` (the runner's)."""
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


def device_view(facts: DeviceFacts, spelled_as: Optional[str] = None, **extra: Any) -> dict[str, Any]:
    """The device as every command's JSON shows it (``run``, ``plan``, ``inspect``): the
    :class:`~pipeline.core.contracts.DeviceFacts` fields (``type``, ``index``, ``name`` …), ``arch`` (``sm90``,
    None without a compute capability), ``spelled_as`` (the device as the user wrote it, when that differs) and
    ``extra`` (``blas_init`` where device-init ran)."""
    return {**msgspec.to_builtins(facts), "arch": facts.arch, "spelled_as": spelled_as, **extra}


def device_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """:func:`device_view` of a run's ``device_initialized`` record (None when device-init did not run)."""
    d = next((r for r in records if isinstance(r, ev.DeviceInitialized)), None)
    return None if d is None else device_view(d.facts, d.spelled_as, blas_init=d.blas_init)


def device_text(d: dict[str, Any]) -> str:
    """A :func:`device_view` in one line, as ``run`` and ``inspect`` both print it after ``device:``:
    ``cuda:0 NVIDIA H200 (sm90), written as CUDA:0`` (``cpu x86_64`` on a CPU: one device, no index)."""
    where = d["type"] if d["type"] == "cpu" else f"{d['type']}:{d['index']}"
    text = f"{where} {d.get('name') or ''}".rstrip() + (f" ({d['arch']})" if d.get("arch") else "")
    return text + (f", written as {d['spelled_as']}" if d.get("spelled_as") else "")
