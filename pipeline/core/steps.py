"""Step tables: one record per step of a state machine, and everything derived from the table (docs/internals.md)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, NamedTuple, Optional

from transitions import Machine, MachineError

from pipeline.core.errors import AttnSetupError, OrderingError
from pipeline.core.faults import check as fault_point, Faults

__all__ = ['Guard', 'Step', 'StepTable', 'TableMachine', 'GuardError', 'Decided', 'Stop', 'decide', 'run', 'run_step', 'replay']


class Guard(NamedTuple):
    """A condition a trigger needs: ``name`` (a method of the machine's model returning bool), the invariant it
    protects, and the step whose work establishes it (named in errors; default: the step it guards)."""

    name: str
    invariant: str
    set_by: str = ""


@dataclass(frozen=True)
class Step:
    """One step of a machine (see docs/internals.md, ``pipeline.core.steps`` for the phases and their modes)."""

    state: str
    trigger: str
    guards: tuple[Guard, ...]
    result: str = ""
    decide: Optional[Callable[[Any], Any]] = None
    log: Optional[Callable[[Any, Any], None]] = None
    check: Optional[Callable[[Any, Any], None]] = None
    apply: Optional[Callable[[Any, Any], None]] = None
    compare: Optional[Callable[[Any, Any], Iterable[tuple[str, Any, Any]]]] = None
    skips: Optional[Callable[[Any, Any], list[Any]]] = None
    refused: Optional[Callable[[Any, BaseException], None]] = None
    pre: tuple[Guard, ...] = ()
    what: str = ""
    emits: tuple[type, ...] = ()
    faults: tuple[str, ...] = ()
    skip: str = ""
    name: str = ""

    @property
    def member(self) -> str:
        """The state's Enum member name (``DEVICE_INIT`` for ``device-init``, unless ``name`` says otherwise)."""
        return self.name or self.state.upper().replace("-", "_")


@dataclass(frozen=True)
class StepTable:
    """A machine's steps in order, its success state and how its messages name things. ``machine`` (``setup``,
    ``runner``); ``success``: terminal state; ``event``: the move's record type; ``label``: how an error names a
    trigger; ``remedy``: out-of-order advice; ``enum_name``/``module``: the derived Enum's identity."""

    machine: str
    steps: tuple[Step, ...]
    success: str
    event: type
    enum_name: str
    module: str
    failed: str = "failed"
    label: str = "trigger"
    remedy: str = "run the steps in order"
    State: Any = field(init=False, repr=False, compare=False)
    _transitions: tuple = field(init=False, repr=False, compare=False)  # what transitions() copies

    def __post_init__(self) -> None:
        members = [(s.member, s.state) for s in self.steps]
        members += [(self.success.upper(), self.success), (self.failed.upper(), self.failed)]
        object.__setattr__(self, "State", enum.Enum(self.enum_name, members, type=str, module=self.module))
        st = self.State  # built once: every run builds a Machine from them
        rows = [(s.trigger, st(s.state), st(self.next_state(s)), tuple(g.name for g in self.guards(s)))
                for s in self.steps]
        rows.append(("fail", tuple(st(s.state) for s in self.steps), st(self.failed), None))
        object.__setattr__(self, "_transitions", tuple(rows))

    @property
    def order(self) -> list[str]:
        """Every state the machine passes through on success, in order (the success state last)."""
        return [s.state for s in self.steps] + [self.success]

    @property
    def terminal(self) -> tuple[str, str]:
        """(success, failed)."""
        return self.success, self.failed

    def step(self, state: str) -> Step:
        """The step whose work runs in ``state`` (KeyError for a terminal or unknown state)."""
        for s in self.steps:
            if s.state == state:
                return s
        raise KeyError(state)

    def next_state(self, step: Step) -> str:
        """The state ``step``'s trigger moves to."""
        i = self.steps.index(step)
        return self.steps[i + 1].state if i + 1 < len(self.steps) else self.success

    def guards(self, step: Step) -> tuple[Guard, ...]:
        """Every guard ``step``'s trigger checks: its preconditions (``pre``), then its own."""
        return tuple(dict.fromkeys(step.pre + step.guards))

    @property
    def invariants(self) -> dict[str, str]:
        """guard name → the invariant it protects."""
        return {g.name: g.invariant for s in self.steps for g in self.guards(s)}

    def fault_points(self, inner: Optional[Callable[[Step], Iterable[str]]] = None) -> list[str]:
        """The fault points a successful run visits, in order: ``state:<s>``, the step's own (``inner(step)``
        when given, else its ``faults`` patterns), ``state:<s>:done``."""
        out: list[str] = []
        for s in self.steps:
            out += [f"state:{s.state}", *(inner(s) if inner else s.faults), f"state:{s.state}:done"]
        return out

    def transitions(self) -> list[dict[str, Any]]:
        """pytransitions' transition dicts: each step's trigger with its guards, and ``fail`` from every
        non-terminal state."""
        return [dict(trigger=trig, source=src, dest=dst, conditions=list(conds)) if conds is not None else
                dict(trigger=trig, source=list(src), dest=dst) for trig, src, dst, conds in self._transitions]

    @cached_property
    def machine_rules(self) -> Machine:
        """One shared pytransitions ``Machine`` with this table's states and transitions, built on first use;
        :class:`TableMachine` adds each run's model and removes it at once."""
        return Machine(model=[], states=list(self.State), transitions=self.transitions(),
                       initial=self.State(self.steps[0].state), auto_transitions=False, send_event=False)

    def diagram_model(self) -> Any:
        """A model object with every guard as a method (what a diagram shows as conditions; all False)."""
        names = {g.name for s in self.steps for g in self.guards(s)}
        return type(f"{self.enum_name}Model", (), {n: (lambda self: False) for n in names})()


class GuardError(OrderingError):
    """A trigger fired in the right state but its guard's invariant does not hold."""

    code = "guard_blocked"


class TableMachine:
    """A pytransitions ``Machine`` over ``model`` for ``table``, with typed errors and timing.
    ``on_transition(from_state, to_state, trigger, duration_ms)`` after every move; :meth:`fire` raises OrderingError /
    GuardError; :meth:`require_state` and :meth:`require` check before work starts."""

    def __init__(self, table: StepTable, model: Any,
                 on_transition: Optional[Callable[[Any, Any, str, float], None]] = None) -> None:
        self.table, self.model = table, model
        self._on_transition = on_transition
        self._entered = time.perf_counter()
        self._source = {s.trigger: table.State(s.state) for s in table.steps}
        # the table's states and transitions are built once (:attr:`StepTable.machine_rules`); adding the model
        # gives it the trigger methods and its initial state, and removing it leaves those and drops the reference
        shared = table.machine_rules
        shared.add_model(model)
        shared.remove_model(model)

    @property
    def state(self) -> Any:
        return self.model.state

    def start_clock(self) -> None:
        """Start timing the current state now (a machine built early, e.g. before a preflight, times its first
        state from when its work begins, not from construction)."""
        self._entered = time.perf_counter()

    def may(self, trigger: str) -> bool:
        """Whether ``trigger`` would move now (guards evaluated, nothing changes)."""
        try:
            return bool(getattr(self.model, f"may_{trigger}")())
        except (AttributeError, MachineError):
            return False

    def fire(self, trigger: str) -> Any:
        """Fire ``trigger``; raises OrderingError / GuardError instead of moving illegally."""
        t, src = self.table, self.state
        if trigger != "fail" and trigger not in self._source:
            raise OrderingError(f"unknown {t.label} {trigger!r}", state=src.value, flags=[("trigger", trigger)],
                                allowed=list(self._source) + ["fail"], remedy=t.remedy)
        try:
            moved = getattr(self.model, trigger)()
        except MachineError as e:
            expected = "any non-terminal state" if trigger == "fail" else self._source[trigger].value
            raise OrderingError(
                f"{t.label} {trigger!r} is not allowed in state {src.value!r}; it belongs to {expected!r}",
                state=src.value, flags=[("trigger", trigger), ("current_state", src.value)],
                allowed=[tr for tr, s in self._source.items() if s == src] or ["none (terminal)"],
                remedy=t.remedy) from e
        if not moved:
            step = next(s for s in t.steps if s.trigger == trigger)
            guards = t.guards(step)
            bad = next((g for g in guards if not getattr(self.model, g.name)()), guards[0])
            raise GuardError(f"guard {bad.name!r} blocked {trigger!r} in {src.value!r}: {bad.invariant}",
                             state=src.value, flags=[("trigger", trigger), ("guard", bad.name)],
                             remedy="complete the current state's work before firing its trigger")
        now = time.perf_counter()
        duration_ms, self._entered = (now - self._entered) * 1e3, now
        if self._on_transition is not None:
            self._on_transition(src, self.state, trigger, duration_ms)
        return self.state

    def require_state(self, state: str) -> None:
        """Raise OrderingError unless the machine is in ``state`` (naming the steps still missing, or that it
        already ran, or that the machine failed)."""
        t, cur = self.table, self.state
        if cur.value == state:
            return
        if cur.value == t.failed:
            raise OrderingError(f"{state} refused: the {t.machine} failed; start a new {t.machine}", state=cur.value,
                                flags=[("step", state), ("current_state", cur.value)],
                                remedy=f"a failed {t.machine} cannot continue — fix the cause and start again")
        order = t.order
        i, j = order.index(cur.value), order.index(state)
        if j > i:
            missing = order[i:j]
            raise OrderingError(f"{state} refused: step(s) {', '.join(missing)} must run first ({t.machine} is in "
                                f"{cur.value!r})", state=cur.value, flags=[("step", state), ("missing", missing)],
                                allowed=[cur.value], remedy=f"run {missing[0]} first")
        raise OrderingError(f"{state} refused: it already ran ({t.machine} is in {cur.value!r})", state=cur.value,
                            flags=[("step", state), ("current_state", cur.value)], allowed=[cur.value],
                            remedy=f"each {t.machine} step runs once; start a new {t.machine}")

    def require(self, guards: Iterable[Guard], what: str) -> None:
        """Raise GuardError naming the first of ``guards`` that does not hold and the step that establishes it."""
        for g in guards:
            if not getattr(self.model, g.name)():
                raise GuardError(f"{what} refused: {g.invariant} does not hold (guard {g.name!r}; missing step: "
                                 f"{g.set_by})", state=self.state.value, flags=[("guard", g.name),
                                                                                ("missing_step", g.set_by)],
                                 remedy=f"complete {g.set_by} before {what}")


@dataclass
class Decided:
    """A decide-only walk: each state's decision in table order, the refusal that stopped it (``(state, error)``), and
    the ``inputs`` they were made from."""

    table: StepTable
    decisions: dict[str, Any] = field(default_factory=dict)
    refused: Optional[tuple[str, BaseException]] = None
    inputs: Any = None

    def __getitem__(self, state: str) -> Any:
        return self.decisions[state]

    def only(self, *states: str) -> "Decided":
        """The decisions (and refusal) of ``states`` only: what stays valid for a later run."""
        refused = self.refused if self.refused is not None and self.refused[0] in states else None
        return Decided(table=self.table, decisions={s: d for s, d in self.decisions.items() if s in states},
                       refused=refused, inputs=self.inputs)

    def raise_refusal(self) -> "Decided":
        """Raise the refusal if there is one; else return self."""
        if self.refused is not None:
            raise self.refused[1]
        return self


class Stop(Exception):
    """Replay cannot compare further: the recorded run ended here (the message says how)."""


def _decide(step: Step, ctx: Any, given: Optional[Decided]) -> Any:
    """The step's decision: the given one, the given refusal raised, or ``decide(ctx)``; kept on ``ctx``."""
    try:
        if given is not None and step.state in given.decisions:
            decision = given.decisions[step.state]
        elif given is not None and given.refused is not None and given.refused[0] == step.state:
            raise given.refused[1]
        else:
            decision = step.decide(ctx) if step.decide is not None else None
    except BaseException as exc:
        if step.refused is not None:
            step.refused(ctx, exc)
        raise
    if step.result:
        setattr(ctx, step.result, decision)
    return decision


def run_step(table: StepTable, step: Step, ctx: Any, machine: TableMachine, *, faults: Optional[Faults] = None,
             given: Optional[Decided] = None) -> Any:
    """One step in run mode (see docs/internals.md, ``pipeline.core.steps``); returns its decision. Raises what the step raises."""
    fault_point(faults, f"state:{step.state}")
    decision = _decide(step, ctx, given)
    if step.log is not None:
        step.log(ctx, decision)
    if step.check is not None:
        step.check(ctx, decision)
    if step.pre:
        machine.require(step.pre, step.what or step.state)
    if step.apply is not None:
        step.apply(ctx, decision)
    fault_point(faults, f"state:{step.state}:done")
    machine.fire(step.trigger)
    return decision


def run(table: StepTable, ctx: Any, machine: TableMachine, *, faults: Optional[Faults] = None,
        given: Optional[Decided] = None) -> None:
    """Every step in run mode, in table order, from the machine's first state to its success state."""
    for step in table.steps:
        run_step(table, step, ctx, machine, faults=faults, given=given)


def decide(table: StepTable, ctx: Any, *, inputs: Any = None) -> Decided:
    """Every step's ``decide`` and ``check``, nothing applied (plan, preflight); stops at the first typed
    refusal and keeps it (:meth:`Decided.raise_refusal` raises it) — also one found by a machine composed inside
    a step (a decision that is itself a refused :class:`Decided`). Other exceptions propagate."""
    out = Decided(table=table, inputs=inputs)
    for step in table.steps:
        try:
            decision = step.decide(ctx) if step.decide is not None else None
        except AttnSetupError as e:
            out.refused = (step.state, e)
            return out
        if step.result:
            setattr(ctx, step.result, decision)
        out.decisions[step.state] = decision
        if isinstance(decision, Decided) and decision.refused is not None:  # a machine composed inside refused
            out.refused = (step.state, decision.refused[1])
            return out
        try:
            if step.check is not None:
                step.check(ctx, decision)
        except AttnSetupError as e:
            out.refused = (step.state, e)
            return out
    return out


def replay(table: StepTable, ctx: Any, recorded: Any, error: Any, check: Callable[[str, str, Any, Any], None]) -> None:
    """Decide every step of ``table`` for ``ctx`` and compare with ``recorded`` (``.records``, ``.first``, ``.all``).
    ``error``: the recorded failure's ErrorInfo or None; ``check(state, field, recorded, now)`` raises on a difference.
    A typed refusal must match the recorded failure (code and message). Raises :class:`Stop` where the recorded run
    ended."""
    entered = {table.steps[0].state} | {r.to for r in recorded.records if isinstance(r, table.event)}
    for step in table.steps:
        if step.state not in entered:
            raise Stop(f"the trace ends before {step.state}")
        failed = error if error is not None and error.state == step.state else None
        try:
            decision = step.decide(ctx) if step.decide is not None else None
        except AttnSetupError as e:
            _refused_as_recorded(step, failed, e, check)
        if step.result:
            setattr(ctx, step.result, decision)
        logged = any(r.state == step.state and isinstance(r, step.emits) for r in recorded.records)
        if failed is not None and failed.code != "interrupted" and not logged:
            check(step.state, "error.code", failed.code, None)
        for fld, was, now in (step.compare(ctx, recorded, decision) if step.compare is not None else ()):
            check(step.state, fld, was, now)
        try:
            if step.check is not None:
                step.check(ctx, decision)
        except AttnSetupError as e:
            _refused_as_recorded(step, failed, e, check)
        if failed is not None:
            raise Stop(f"{step.state} failed as recorded ({failed.code}) after its decision: an effect, not replayed")


def _refused_as_recorded(step: Step, failed: Any, e: AttnSetupError, check: Callable[..., None]) -> None:
    check(step.state, "error.code", failed.code if failed is not None else None, e.info.code)
    check(step.state, "error.message", failed.message, e.info.message)
    raise Stop(f"failed in {step.state} as recorded")

