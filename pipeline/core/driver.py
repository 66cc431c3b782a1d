"""One driver for every step table (:mod:`pipeline.core.steps`), in four modes.

- **run** (:func:`run`, :func:`run_step`): per step ``decide`` → ``log`` → ``check`` → ``apply`` → fire the
  trigger, with the fault points ``state:<state>`` before and ``state:<state>:done`` after; a decision made
  earlier for the same inputs (``given``, a :class:`Decided` of a preflight) is taken instead of deciding
  again, and a refusal found then is raised at its own step (so the log shows where it happened);
- **plan** and **preflight** (:func:`decide`): per step ``decide`` → ``check`` only, nothing applied; the
  first refusal ends the walk and is kept in the returned :class:`Decided` (``plan`` decides for a named
  device profile, ``preflight`` for this machine's device before anything is allocated);
- **replay** (:func:`replay`): per step ``decide`` against the facts a trace recorded, then the step's
  ``compare`` rows are checked against the recorded values; a decision or check that fails must fail as
  recorded; :class:`Stop` ends the comparison where the recorded run ended.

Torch-free; what a step does is the step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pipeline.core.errors import AttnSetupError
from pipeline.core.faults import Faults, check as fault_point
from pipeline.core.steps import Step, StepTable, TableMachine

__all__ = ["Decided", "Stop", "decide", "run", "run_step", "replay"]


@dataclass
class Decided:
    """What a decide-only walk found: each step's decision by state, in table order, and the refusal that
    stopped it (``(state, error)``; the state's decision is present when its ``check`` refused it, absent
    when its ``decide`` did). ``inputs``: what the decisions were made from (a caller's key: a run takes
    them only for equal inputs)."""

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
    """One step in run mode (see the module docstring); returns its decision. Raises what the step raises."""
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
    """Decide every step of ``table`` for ``ctx`` (built from the recorded inputs) and compare with ``recorded``.

    ``recorded``: the run's records (``.records``, ``.first(cls)``, ``.all(cls)``); ``error``: the ErrorInfo of
    its failure, or None. ``check(state, field, recorded, now)`` raises on a difference. A step's typed refusal
    must match the recorded failure of its state (``error.code`` and ``error.message``), and a state that
    failed as recorded before its decision was logged must refuse now. Raises :class:`Stop` where the recorded
    run ended (a state never entered, a failure, a decision not recorded).
    """
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
