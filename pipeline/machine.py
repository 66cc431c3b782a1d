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

from pipeline.errors import OrderingError


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

TRANSITIONS: list[dict[str, Any]] = [
    dict(trigger=t, source=s, dest=d, conditions=[g]) for t, s, d, g, _ in STEPS
] + [dict(trigger="fail", source=[s for s in State if s not in TERMINAL], dest=State.FAILED)]

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


class SetupMachine:
    """Wraps a pytransitions ``Machine`` over a :class:`SetupModel`.

    ``on_transition(from_state, to_state, trigger, duration_ms)`` is called after every move.
    """

    def __init__(self, model: Optional[SetupModel] = None,
                 on_transition: Optional[Callable[[State, State, str, float], None]] = None) -> None:
        self.model = model or SetupModel()
        self._on_transition = on_transition
        self._entered = time.perf_counter()
        self._machine = Machine(model=self.model, states=State, transitions=TRANSITIONS, initial=State.DEVICE_INIT,
                                auto_transitions=False, send_event=False, after_state_change=None)

    @property
    def state(self) -> State:
        return self.model.state

    def may(self, trigger: str) -> bool:
        """Whether ``trigger`` would move now (guards evaluated, nothing changes)."""
        try:
            return bool(getattr(self.model, f"may_{trigger}")())
        except (AttributeError, MachineError):
            return False

    def fire(self, trigger: str) -> State:
        """Fire ``trigger``; raises OrderingError / GuardError instead of moving illegally."""
        src = self.state
        if trigger != "fail" and trigger not in TRIGGER_SOURCE:
            raise OrderingError(f"unknown trigger {trigger!r}", state=src.value, flags=[("trigger", trigger)],
                                allowed=list(TRIGGER_SOURCE) + ["fail"], remedy="use one of the machine's triggers")
        try:
            moved = getattr(self.model, trigger)()
        except MachineError as e:
            expected = "any non-terminal state" if trigger == "fail" else TRIGGER_SOURCE[trigger].value
            raise OrderingError(
                f"trigger {trigger!r} is not allowed in state {src.value!r}; it belongs to {expected!r}",
                state=src.value, flags=[("trigger", trigger), ("current_state", src.value)],
                allowed=[t for t, s in TRIGGER_SOURCE.items() if s == src] or ["none (terminal)"],
                remedy="run the pipeline's steps in order; a finished or failed run cannot continue — start a new run",
            ) from e
        if not moved:
            guard = next(g for t, _, _, g, _ in STEPS if t == trigger)
            raise GuardError(f"guard {guard!r} blocked {trigger!r} in {src.value!r}: {GUARD_INVARIANT[guard]}",
                             state=src.value, flags=[("trigger", trigger), ("guard", guard)],
                             remedy="complete the current state's work before firing its trigger")
        now = time.perf_counter()
        duration_ms = (now - self._entered) * 1e3
        self._entered = now
        if self._on_transition is not None:
            self._on_transition(src, self.state, trigger, duration_ms)
        return self.state
