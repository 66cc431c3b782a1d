"""The attention-setup state machine: the transition table as data, guards that name invariants.

::

    device-init ─device_ready─► resolve ─resolved─► build-mode ─built─► npu-lazy-mem
        ─lazy_mem_settled─► annotate ─annotated─► done          (any non-terminal ─fail─► failed)

``done`` and ``failed`` are terminal: a retry is a new run. A trigger fired out of order raises
:class:`OrderingError` naming the current state and the state the trigger belongs to; a trigger
whose guard does not hold raises :class:`GuardError` naming the invariant.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Callable, Optional

from transitions import Machine, MachineError

from pipeline.core.errors import OrderingError


class State(str, enum.Enum):
    DEVICE_INIT = "device-init"
    RESOLVE = "resolve"
    BUILD_MODE = "build-mode"
    NPU_LAZY_MEM = "npu-lazy-mem"
    ANNOTATE = "annotate"
    DONE = "done"
    FAILED = "failed"


ORDER = [State.DEVICE_INIT, State.RESOLVE, State.BUILD_MODE, State.NPU_LAZY_MEM, State.ANNOTATE, State.DONE]
TERMINAL = (State.DONE, State.FAILED)

# trigger, source, dest, guard (a method of the model), the invariant the guard protects
STEPS: list[tuple[str, State, State, str, str]] = [
    ("device_ready", State.DEVICE_INIT, State.RESOLVE, "has_device_facts",
     "device facts are recorded (and BLAS initialised on cuda/musa) before anything is resolved"),
    ("resolved", State.RESOLVE, State.BUILD_MODE, "has_resolution",
     "both halves resolved to registered, non-None backend names before any backend is built"),
    ("built", State.BUILD_MODE, State.NPU_LAZY_MEM, "has_backends",
     "every planned instance is built and every workspace accounted for"),
    ("lazy_mem_settled", State.NPU_LAZY_MEM, State.ANNOTATE, "has_lazy_mem_outcome",
     "NPU zbal lazy memory is initialised, or skipped with a recorded reason, before graph capture"),
    ("annotated", State.ANNOTATE, State.DONE, "has_names",
     "the resolved names are set on the top-level backend object"),
]


TRIGGER_SOURCE = {t: s for t, s, _, _, _ in STEPS}
GUARD_INVARIANT = {g: why for _, _, _, g, why in STEPS}


class GuardError(OrderingError):
    """A trigger fired in the right state but its guard's invariant does not hold."""

    code = "guard_blocked"


class SetupModel:
    """The machine's model: what each state produced, and the guards that read it."""

    def __init__(self) -> None:
        # Attribute names must not collide with trigger names (pytransitions adds a method per trigger).
        self.device_facts: Any = None
        self.resolution: Any = None
        self.backends: Any = None
        self.lazy_mem: Any = None  # "done" or a skip reason
        self.names_set = False
        self.state: State = State.DEVICE_INIT

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


class TableMachine:
    """A pytransitions ``Machine`` over a model, driven by a table of steps, with typed errors and timing.

    Shared by the attention machine (:class:`SetupMachine`) and the runner's (``pipeline.runtime.runner_machine``).
    Subclasses set ``STATES`` (an Enum), ``STEPS`` — ``(trigger, source, dest, guard or guards, invariant)`` —,
    ``TERMINAL``, ``INVARIANTS`` (guard → the invariant it protects), ``LABEL`` (how messages name a trigger)
    and ``REMEDY``. ``on_transition(from_state, to_state, trigger, duration_ms)`` is called after every move.
    """

    STATES: Any = None
    STEPS: list[tuple[str, Any, Any, Any, str]] = []
    TERMINAL: tuple[Any, ...] = ()
    INVARIANTS: dict[str, str] = {}
    LABEL = "trigger"
    REMEDY = "run the steps in order"

    def __init__(self, model: Any, on_transition: Optional[Callable[[Any, Any, str, float], None]] = None) -> None:
        self.model = model
        self._on_transition = on_transition
        self._entered = time.perf_counter()
        self._source = {t: src for t, src, _, _, _ in self.STEPS}
        Machine(model=self.model, states=self.STATES, transitions=table(self.STEPS, self.STATES, self.TERMINAL),
                initial=self.STEPS[0][1], auto_transitions=False, send_event=False)

    @property
    def state(self) -> Any:
        return self.model.state

    def may(self, trigger: str) -> bool:
        """Whether ``trigger`` would move now (guards evaluated, nothing changes)."""
        try:
            return bool(getattr(self.model, f"may_{trigger}")())
        except (AttributeError, MachineError):
            return False

    def fire(self, trigger: str) -> Any:
        """Fire ``trigger``; raises OrderingError / GuardError instead of moving illegally."""
        src = self.state
        if trigger != "fail" and trigger not in self._source:
            raise OrderingError(f"unknown {self.LABEL} {trigger!r}", state=src.value, flags=[("trigger", trigger)],
                                allowed=list(self._source) + ["fail"], remedy=self.REMEDY)
        try:
            moved = getattr(self.model, trigger)()
        except MachineError as e:
            expected = "any non-terminal state" if trigger == "fail" else self._source[trigger].value
            raise OrderingError(
                f"{self.LABEL} {trigger!r} is not allowed in state {src.value!r}; it belongs to {expected!r}",
                state=src.value, flags=[("trigger", trigger), ("current_state", src.value)],
                allowed=[t for t, s in self._source.items() if s == src] or ["none (terminal)"],
                remedy=self.REMEDY) from e
        if not moved:
            guards = _as_tuple(next(g for t, _, _, g, _ in self.STEPS if t == trigger))
            bad = next((g for g in guards if not getattr(self.model, g)()), guards[0])
            raise GuardError(f"guard {bad!r} blocked {trigger!r} in {src.value!r}: {self.INVARIANTS.get(bad, '')}",
                             state=src.value, flags=[("trigger", trigger), ("guard", bad)],
                             remedy="complete the current state's work before firing its trigger")
        now = time.perf_counter()
        duration_ms, self._entered = (now - self._entered) * 1e3, now
        if self._on_transition is not None:
            self._on_transition(src, self.state, trigger, duration_ms)
        return self.state


def _as_tuple(guards: Any) -> tuple[str, ...]:
    return (guards,) if isinstance(guards, str) else tuple(guards)


def table(steps: list[tuple[str, Any, Any, Any, str]], states: Any, terminal: tuple[Any, ...]) -> list[dict[str, Any]]:
    """pytransitions' transition dicts for a step table, plus ``fail`` from every non-terminal state."""
    return [dict(trigger=t, source=s, dest=d, conditions=list(_as_tuple(g))) for t, s, d, g, _ in steps] + [
        dict(trigger="fail", source=[s for s in states if s not in terminal], dest=terminal[-1])]


class SetupMachine(TableMachine):
    """The attention pipeline's machine over a :class:`SetupModel` (the table above)."""

    STATES, STEPS, TERMINAL, INVARIANTS = State, STEPS, TERMINAL, GUARD_INVARIANT
    REMEDY = "run the pipeline's steps in order; a finished or failed run cannot continue — start a new run"

    def __init__(self, model: Optional[SetupModel] = None,
                 on_transition: Optional[Callable[[State, State, str, float], None]] = None) -> None:
        super().__init__(model or SetupModel(), on_transition)


TRANSITIONS: list[dict[str, Any]] = table(STEPS, State, TERMINAL)
