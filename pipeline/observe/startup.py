"""Startup accounting: where every second of an ``attn-setup run`` went (``startup_summary``).

Details: docs/internals.md, ``pipeline.observe.startup``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, NamedTuple, Optional

from pipeline.core import events as ev
from pipeline.core.numbers import ascii_float


_ENDS = (ev.CommandStarted, ev.RunnerStarted, ev.RunFailed, ev.RunInterrupted, ev.RunnerTransition,
         ev.StateTransition, ev.CudaGraphCaptured, ev.InstanceVerified)


def phase_state(name: str, parent: str) -> str:
    """The ``state`` a ``slow_phase`` record gets: the phase's own name for a top-level phase or a state; its
    parent for a child that is not a state (``bs=8``, a verified instance, ``import torch``, ``jit:…``)."""
    if not parent or parent in ("attention", "preflight"):  # setup states sit under attention or preflight
        return name
    return parent


class SlowPhaseWatch:
    """Log a ``slow_phase`` warning as each phase above ``threshold_s`` ends (docs/internals.md).

    ``start_ns``: the process start (wall clock, ns; None: ``startup`` is left to the summary);
    ``startup_parts``: ``(name, seconds, detail)`` measured inside ``startup`` (``import torch``).
    :attr:`seen` holds the ``(name, parent)`` of every phase judged here, warned or not, so the summary
    does not judge them again.
    """

    def __init__(self, log: Any, threshold_s: float, *, start_ns: Optional[int] = None,
                 startup_parts: Iterable[tuple[str, float, str]] = ()) -> None:
        self.log, self.threshold_s, self.start_ns = log, threshold_s, start_ns
        self.startup_parts = list(startup_parts)
        self.seen: set[tuple[str, str]] = set()
        self._cmd: Any = None
        self._runner = False
        self._preflight_done = False

    def install(self) -> "SlowPhaseWatch":
        """Start observing the log; returns self."""
        self.log.observers.append(self)
        return self

    def judge(self, name: str, parent: str, seconds: float) -> None:
        """Record the phase as judged, and warn when it took longer than the threshold."""
        self.seen.add((name, parent))
        seconds = round(max(seconds, 0.0), 6)
        if seconds > self.threshold_s:
            self.log.emit(ev.SlowPhase, state=phase_state(name, parent), phase=name, parent=parent, seconds=seconds,
                          threshold_s=self.threshold_s)

    def __call__(self, r: ev.Event) -> None:
        """Called with every record the log emits, right after it was written."""
        if not isinstance(r, _ENDS):
            return
        if isinstance(r, ev.CommandStarted):
            self._cmd = r
            if self.start_ns is not None:
                self.judge("startup", "", (r.ts_ns - self.start_ns) / 1e9)
                for name, sec, _ in self.startup_parts:
                    self.judge(name, "startup", sec)
        elif isinstance(r, (ev.RunnerStarted, ev.RunFailed, ev.RunInterrupted)):
            if self._cmd is not None and not self._preflight_done:
                self._preflight_done = True
                self.judge("preflight", "", (r.ts_ns - self._cmd.ts_ns) / 1e9)
            self._runner = self._runner or isinstance(r, ev.RunnerStarted)
        elif isinstance(r, ev.RunnerTransition):
            self.judge(r.from_state, "", r.duration_ms / 1e3)
        elif isinstance(r, ev.StateTransition):
            self.judge(r.from_state, "attention" if self._runner else "preflight", r.duration_ms / 1e3)
        elif isinstance(r, ev.CudaGraphCaptured):
            self.judge(f"bs={r.bs}", "capture-cuda-graphs", r.capture_ms / 1e3)
        else:
            self.judge(r.role, "verification", r.duration_ms / 1e3)


SLOW_PHASE_ENV = "ATTN_SETUP_SLOW_PHASE_S"
SLOW_PHASE_FLAG = "--slow-phase-s"


def process_created_ns() -> Optional[int]:
    """Wall-clock ns at which the kernel created this process, from ``/proc/self/stat`` (Linux; None elsewhere).

    Field 22 (``starttime``) counts clock ticks since boot on the boot-time clock; the offset between
    ``CLOCK_BOOTTIME`` now and then, taken from ``time.time_ns()``, is the creation on the wall clock
    (resolution one tick, 10 ms at the usual 100 Hz). It is the ``fork``, not the ``exec``: see :func:`process_start`.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # fields after "comm": state is field 3
        hz = os.sysconf("SC_CLK_TCK")
        since_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - ticks * 1_000_000_000 // hz
        return time.time_ns() - since_ns
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class ProcessStart(NamedTuple):
    """Where ``startup`` begins: ``start_ns`` = ``created_ns`` + ``idle_ns`` (wall clock, ns)."""

    start_ns: int  # when the process started running: its creation, moved past the time it did not run
    created_ns: int  # the kernel's creation time (the fork): process_created_ns()
    idle_ns: int  # between creation and attn-setup's first code, the time the process did not run (not in wall)


def process_start() -> Optional[ProcessStart]:
    """The startup summary's origin: the process's creation (:func:`process_created_ns`) moved later by the time it
    did not run before attn-setup's first code (:mod:`pipeline.core.launch_clock`: wall time since creation less the
    time it ran or waited for a CPU). Linux keeps no ``exec`` time, and a shell may create the process long before
    it ``exec``'s Python — ``( pip install … && attn-setup run … )`` runs ``pip`` while this process waits —, so
    that wait is left out instead of counted as startup. It can only leave time out: the interpreter's own waits on
    disk before our first code are left out too, and the shell's few ms of CPU before ``exec`` stay in. None when
    the creation time is unknown (not Linux)."""
    from pipeline.core import launch_clock

    created = process_created_ns()
    if created is None:
        return None
    active = launch_clock.FIRST_CODE_ACTIVE_NS
    idle = 0 if active is None else max(0, launch_clock.FIRST_CODE_NS - created - active)
    return ProcessStart(start_ns=created + idle, created_ns=created, idle_ns=idle)


def process_start_ns() -> Optional[int]:
    """:func:`process_start`'s ``start_ns`` (None when unknown)."""
    start = process_start()
    return None if start is None else start.start_ns


def _phase(name: str, seconds: float, parent: str = "", detail: str = "") -> ev.PhaseTime:
    return ev.PhaseTime(name=name, seconds=round(max(seconds, 0.0), 6), parent=parent, detail=detail)


def _span(a: Optional[ev.Event], b: Optional[ev.Event]) -> Optional[float]:
    return None if a is None or b is None else (b.ts_ns - a.ts_ns) / 1e9


def _runner_phases(records: list[ev.Event], jit: Iterable[dict[str, Any]]) -> list[ev.PhaseTime]:
    out: list[ev.PhaseTime] = []
    runner = False  # setup states before the runner started ran in preflight (a refusal logged through the pipeline)
    for r in records:
        runner = runner or isinstance(r, ev.RunnerStarted)
        if isinstance(r, ev.RunnerTransition):
            out.append(_phase(r.from_state, r.duration_ms / 1e3))
        elif isinstance(r, ev.StateTransition):
            out.append(_phase(r.from_state, r.duration_ms / 1e3, parent="attention" if runner else "preflight"))
        elif isinstance(r, ev.CudaGraphCaptured):
            out.append(_phase(f"bs={r.bs}", r.capture_ms / 1e3, parent="capture-cuda-graphs",
                              detail=f"{r.graph_bytes} bytes" if r.graph_bytes else ""))
    for j in jit:
        out.append(_phase(f"jit:{j['variant']}", j["seconds"], parent="attention", detail=j["status"]))
    return out


def _checks(records: list[ev.Event], start: Optional[ev.Event]) -> list[ev.PhaseTime]:
    inst = [r for r in records if isinstance(r, ev.InstanceVerified)]
    steps = [r for r in records if isinstance(r, ev.ModelStepVerified)]
    out: list[ev.PhaseTime] = []
    if inst:
        out.append(_phase("verification", _span(start, inst[-1]) or 0.0))
        out += [_phase(r.role, r.duration_ms / 1e3, parent="verification", detail=r.backend) for r in inst]
    if steps:
        out.append(_phase("model-steps", _span(inst[-1] if inst else start, steps[-1]) or 0.0))
    return out


def timed_torch_import() -> dict[str, Any]:
    """Import torch, timed: ``{seconds, cold, detail}`` — ``cold`` when its bytecode was compiled by this import,
    judged by torch's package bytecode (``importlib.util.cache_from_source(torch.__file__)``, which follows
    ``PYTHONPYCACHEPREFIX``): written after the import began (none was cached: an install with ``pip install
    --no-compile``, a removed ``__pycache__``; Python cached it for later runs), or still missing after it (Python
    could not write it either: ``PYTHONDONTWRITEBYTECODE``, a read-only install; every import compiles it). A normal
    ``pip install`` compiles bytecode at install time, so its first run is not cold. ``seconds`` is 0 when torch was
    already imported. Called once, before the run's log opens (not the hot path)."""
    import importlib.util
    import sys

    if "torch" in sys.modules:
        return {"seconds": 0.0, "cold": False, "detail": "already imported"}
    wall0, t0 = time.time(), time.perf_counter()
    import torch

    seconds = time.perf_counter() - t0
    try:
        pyc = importlib.util.cache_from_source(torch.__file__)
        mtime = os.stat(pyc).st_mtime
    except (OSError, NotImplementedError, ValueError, TypeError):
        mtime = None
    if mtime is None:
        return {"seconds": seconds, "cold": True,
                "detail": "no cached bytecode for torch and none written: Python compiled it on this import and "
                          "will on every one (PYTHONDONTWRITEBYTECODE, or a read-only install)"}
    if mtime >= wall0 - 1.0:
        return {"seconds": seconds, "cold": True,
                "detail": "no cached bytecode for torch (installed with --no-compile, or its __pycache__ removed): "
                          "Python compiled it on this import (cached for later runs)"}
    return {"seconds": seconds, "cold": False, "detail": "cached bytecode"}


def summarize(records: Iterable[ev.Event], *, start_ns: Optional[int], end_ns: int,
              jit: Iterable[dict[str, Any]] = (), startup_parts: Iterable[tuple[str, float, str]] = (),
              created_ns: Optional[int] = None) -> dict[str, Any]:
    """The ``startup_summary`` fields of one launch's ``records`` (in order).

    ``start_ns``: the process start (wall clock, ns, :func:`process_start`; None when unknown: ``startup`` then
    starts at the first record); ``created_ns``: the process's creation, when known (``start_ns`` minus it is
    ``idle_before_start_s``, outside the wall); ``end_ns``: when the summary is taken; ``jit``: the FlashInfer
    backends' ``jit_report`` entries (``{variant, status, seconds}``); ``startup_parts``: ``(name, seconds, detail)``
    measured inside ``startup`` (``import torch``, :func:`timed_torch_import`), shown as its children. Returns
    ``{wall_s, phases, unaccounted_s, coverage, process_start_ns, created_ns, idle_before_start_s}``; ``coverage`` =
    top-level seconds / ``wall_s`` (1.0 for a zero wall).
    """
    records = list(records)
    first = lambda cls: next((r for r in records if isinstance(r, cls)), None)  # noqa: E731
    cmd, runner_started, ready = first(ev.CommandStarted), first(ev.RunnerStarted), first(ev.RunnerReady)
    origin = start_ns if start_ns is not None else (records[0].ts_ns if records else end_ns)
    phases: list[ev.PhaseTime] = []
    if cmd is not None:
        parts = list(startup_parts)
        cold = any("compiled" in d for _, _, d in parts)
        phases.append(_phase("startup", (cmd.ts_ns - origin) / 1e9, detail="interpreter, imports, arguments"
                             + ("; cold start: bytecode compiled (see import torch)" if cold else "")))
        phases += [_phase(name, sec, parent="startup", detail=d) for name, sec, d in parts]
        stop = runner_started or first(ev.RunFailed) or first(ev.RunInterrupted)
        phases.append(_phase("preflight", ((stop.ts_ns if stop else end_ns) - cmd.ts_ns) / 1e9))
    phases += _runner_phases(records, jit)
    checks = _checks(records, ready)
    phases += checks
    last = [r for r in records if isinstance(r, (ev.InstanceVerified, ev.ModelStepVerified))]
    fail = next((r for r in reversed(records) if isinstance(r, (ev.RunFailed, ev.RunInterrupted, ev.RunnerReady))),
                None)
    mark = last[-1] if last else fail
    if mark is not None and runner_started is not None:
        phases.append(_phase("release", (end_ns - mark.ts_ns) / 1e9, detail="closing what was built"))
    wall = max((end_ns - origin) / 1e9, 0.0)
    named = sum(p.seconds for p in phases if not p.parent)
    return {"wall_s": round(wall, 6), "phases": phases, "unaccounted_s": round(wall - named, 6),
            "coverage": round(named / wall, 4) if wall > 0 else 1.0, "process_start_ns": start_ns or 0,
            "created_ns": created_ns or 0, "idle_before_start_s": _idle_s(start_ns, created_ns)}


def _idle_s(start_ns: Optional[int], created_ns: Optional[int]) -> float:
    return round(max(start_ns - created_ns, 0) / 1e9, 6) if start_ns and created_ns else 0.0


def slow_threshold(flag_value: Optional[float]) -> Optional[float]:
    """The ``slow_phase`` threshold in seconds: ``--slow-phase-s`` > ``ATTN_SETUP_SLOW_PHASE_S`` > off.

    Raises UsageError (exit 2) naming the flag or the variable for a value that is not a number > 0.
    """
    from pipeline.core.errors import UsageError

    name, raw = (SLOW_PHASE_FLAG, flag_value) if flag_value is not None else (SLOW_PHASE_ENV,
                                                                             os.environ.get(SLOW_PHASE_ENV))
    if raw is None or (isinstance(raw, str) and not raw.strip()):   # blank as unset, as the other ATTN_SETUP_* variables
        return None
    try:
        value = ascii_float(str(raw))
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{name} {raw!r} is not a number of seconds > 0", code="usage", flags=[(name, raw)],
                         allowed=["a finite number > 0"], remedy=f"set {name} to e.g. 30, or leave it unset")
    return value


def emit_summary(log: Any, *, start_ns: Optional[int], jit: Iterable[dict[str, Any]] = (),
                 slow_s: Optional[float] = None, startup_parts: Iterable[tuple[str, float, str]] = (),
                 judged: Iterable[tuple[str, str]] = (), created_ns: Optional[int] = None) -> ev.StartupSummary:
    """Emit ``slow_phase`` warnings (phases over ``slow_s`` seconds) and the ``startup_summary``; returns it.

    ``judged``: ``(name, parent)`` of the phases already judged as they ended
    (:class:`pipeline.observe.startup.SlowPhaseWatch`); only the others are judged here — those known only
    now (``verification``, ``model-steps``, ``release``, the JIT variants) —, each tagged with its phase
    (:func:`pipeline.observe.startup.phase_state`), not with the state the run ended in."""

    s = summarize(log.records, start_ns=start_ns, end_ns=time.time_ns(), jit=jit, startup_parts=startup_parts,
                  created_ns=created_ns)
    done = set(judged)
    if slow_s is not None:
        for p in s["phases"]:
            if p.seconds > slow_s and (p.name, p.parent) not in done:
                log.emit(ev.SlowPhase, state=phase_state(p.name, p.parent), phase=p.name, parent=p.parent,
                         seconds=p.seconds, threshold_s=slow_s)
    return log.emit(ev.StartupSummary, state=log.current_state, **s)

