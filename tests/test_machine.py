"""The setup table's machine: the legal path, every illegal trigger order, guards, failure from each state."""

from __future__ import annotations

import pytest

from pipeline.core.errors import OrderingError
from pipeline.core.steps import GuardError, TableMachine
from pipeline.setup.context import SetupModel
from pipeline.setup.table import SETUP, State

ORDER = [State(s) for s in SETUP.order]
TERMINAL = tuple(State(s) for s in SETUP.terminal)
# (trigger, source, dest, guard): the table's rows, as this test reads them
STEPS = [(s.trigger, State(s.state), State(SETUP.next_state(s)), s.guards[0].name) for s in SETUP.steps]


def SetupMachine(on_transition=None) -> TableMachine:  # noqa: N802 - builds the machine as the library does
    return TableMachine(SETUP, SetupModel(), on_transition=on_transition)


class _Ok:
    def complete(self):
        return True


class _Res:
    class pair:  # noqa: N801 - mimics Resolution.pair
        prefill, decode = "torch_native", "torch_native"


FILL = {"device_ready": ("device_facts", object()), "resolved": ("resolution", _Res()),
        "built": ("backends", _Ok()), "lazy_mem_settled": ("lazy_mem", "skipped: test"),
        "annotated": ("names_set", True)}


def _advance(m: SetupMachine, upto: State) -> None:
    for trigger, src, _, _ in STEPS:
        if m.state == upto:
            return
        attr, value = FILL[trigger]
        setattr(m.model, attr, value)
        m.fire(trigger)


def test_legal_path_visits_every_state_in_order():
    """Firing the five triggers in order walks device-init → … → done and reports each move."""
    seen = []
    m = SetupMachine(on_transition=lambda s, d, t, ms: seen.append((s, d, t)))
    _advance(m, State.DONE)
    assert [s for s, _, _ in seen] + [State.DONE] == ORDER
    assert [t for _, _, t in seen] == [t for t, *_ in STEPS]


ILLEGAL = [(s, t) for s in ORDER for t, src, *_ in STEPS if src != s]


@pytest.mark.parametrize("state,trigger", ILLEGAL)
def test_every_out_of_order_trigger_is_refused(state, trigger):
    """A trigger fired in any state other than its own raises OrderingError naming both states."""
    m = SetupMachine()
    _advance(m, state)
    source = next(s for t, s, *_ in STEPS if t == trigger)
    with pytest.raises(OrderingError) as ei:
        m.fire(trigger)
    info = ei.value.info
    assert info.state == state.value
    assert source.value in info.message and state.value in info.message
    assert m.state == state


@pytest.mark.parametrize("trigger,guard", [(t, g) for t, _, _, g in STEPS])
def test_guard_blocks_without_the_states_work(trigger, guard):
    """In the right state but without its result, the guard refuses and names its invariant."""
    m = SetupMachine()
    src = next(s for t, s, *_ in STEPS if t == trigger)
    _advance(m, src)
    assert not m.may(trigger)
    with pytest.raises(GuardError) as ei:
        m.fire(trigger)
    assert guard in ei.value.info.message
    assert m.state == src


@pytest.mark.parametrize("state", [s for s in ORDER if s not in TERMINAL])
def test_failure_from_every_state_is_terminal(state):
    """fail moves any non-terminal state to failed, after which nothing moves."""
    m = SetupMachine()
    _advance(m, state)
    m.fire("fail")
    assert m.state == State.FAILED
    for trigger in [t for t, *_ in STEPS] + ["fail"]:
        with pytest.raises(OrderingError):
            m.fire(trigger)


def test_done_is_terminal():
    """A finished run cannot fail or continue: a retry is a new run."""
    m = SetupMachine()
    _advance(m, State.DONE)
    with pytest.raises(OrderingError):
        m.fire("fail")


def test_may_asks_without_moving():
    """may_<trigger> evaluates the guard and leaves the state unchanged."""
    m = SetupMachine()
    m.model.device_facts = object()
    assert m.may("device_ready") and m.state == State.DEVICE_INIT
    assert not m.may("resolved")


def test_unknown_trigger_is_typed():
    """An unknown trigger name is an OrderingError listing the real triggers."""
    with pytest.raises(OrderingError) as ei:
        SetupMachine().fire("capture")
    assert "device_ready" in ei.value.info.allowed
