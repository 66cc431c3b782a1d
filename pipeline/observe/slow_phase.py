"""``slow_phase`` warnings as each phase ends (``--slow-phase-s`` / ``ATTN_SETUP_SLOW_PHASE_S``).

:class:`SlowPhaseWatch` is an observer of the run's :class:`pipeline.core.eventlog.EventLog`: it looks at the
records that end a phase and, when the phase took longer than the threshold, logs a ``slow_phase`` warning right
then, tagged with that phase (``state`` = the phase's name; a child that is not a state of its own — a captured
batch size, a verified instance, ``import torch`` — is tagged with its parent). The phases and their seconds are
those of the ``startup_summary`` (:func:`pipeline.observe.startup.summarize`), measured the same way:

- ``startup`` (and ``import torch`` under it) when ``command_started`` is logged;
- ``preflight`` when the runner starts (or the start is refused first);
- each runner state at its ``runner_transition``, each setup state at its ``state_transition``;
- each ``bs=N`` at its ``cuda_graph_captured``, each verified instance at its ``instance_verified``.

The rest is known only when the summary is taken — ``verification`` and ``model-steps`` (their ends are the last
records of their kind), ``release`` and the FlashInfer JIT variants (reported at the end) —: those warnings come
with the summary (:func:`pipeline.observe.startup.emit_summary`), still tagged with their phase.

Only records that end a phase are looked at (one ``isinstance`` per record emitted); nothing runs per layer.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from pipeline.core import events as ev

_ENDS = (ev.CommandStarted, ev.RunnerStarted, ev.RunFailed, ev.RunInterrupted, ev.RunnerTransition,
         ev.StateTransition, ev.CudaGraphCaptured, ev.InstanceVerified)


def phase_state(name: str, parent: str) -> str:
    """The ``state`` a ``slow_phase`` record gets: the phase's own name for a top-level phase or a state; its
    parent for a child that is not a state (``bs=8``, a verified instance, ``import torch``, ``jit:…``)."""
    if not parent or parent in ("attention", "preflight"):  # setup states sit under attention or preflight
        return name
    return parent


class SlowPhaseWatch:
    """Log a ``slow_phase`` warning as each phase above ``threshold_s`` ends (module docstring).

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
