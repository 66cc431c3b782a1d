"""Order invariants of the setup table's machine (pipeline/setup/table.py), with hypothesis.

Random sequences of triggers (and of the states' work being done or not) are checked against a
reference written here: a trigger moves only from its own source state and only when its guard's
work is done; everything else raises the typed OrderingError (GuardError when only the guard
failed) and leaves the state unchanged; ``done`` is reached only through every state in order.

CI runs 300 examples per property. For 10 000:
``ATTN_SETUP_HYPOTHESIS_EXAMPLES=10000 python -m pytest tests/test_order_properties.py -q``
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.errors import OrderingError
from pipeline.core.steps import GuardError, TableMachine
from pipeline.setup.context import SetupModel
from pipeline.setup.table import SETUP, State

ORDER = [State(s) for s in SETUP.order]
STEPS = [(s.trigger,) for s in SETUP.steps]


def SetupMachine(on_transition=None) -> TableMachine:  # noqa: N802 - builds the machine as the library does
    return TableMachine(SETUP, SetupModel(), on_transition=on_transition)

EXAMPLES = int(os.environ.get("ATTN_SETUP_HYPOTHESIS_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TRIGGERS = [t for t, *_ in STEPS]


class _Ok:
    def complete(self):
        return True


class _Pair:
    prefill, decode = "torch_native", "torch_native"


class _Res:
    pair = _Pair()


# trigger → (model attribute its guard reads, a value that satisfies it); hand-written from machine.py
WORK = {"device_ready": ("device_facts", object()), "resolved": ("resolution", _Res()), "built": ("backends", _Ok()),
        "lazy_mem_settled": ("lazy_mem", "skipped: test"), "annotated": ("names_set", True)}
NEXT = {"device-init": ("device_ready", "resolve"), "resolve": ("resolved", "build-mode"),
        "build-mode": ("built", "npu-lazy-mem"), "npu-lazy-mem": ("lazy_mem_settled", "annotate"),
        "annotate": ("annotated", "done")}

actions = st.lists(st.one_of(
    st.tuples(st.just("fire"), st.sampled_from(TRIGGERS + ["fail", "bogus"])),
    st.tuples(st.just("work"), st.sampled_from(TRIGGERS)),
), max_size=30)


def _apply(m: SetupMachine, done: set[str], action: tuple[str, str]) -> None:
    """Do one action on ``m`` and check it against the reference."""
    kind, name = action
    before = m.state.value
    if kind == "work":
        attr, value = WORK[name]
        setattr(m.model, attr, value)
        done.add(name)
        return
    legal_trigger, dest = NEXT.get(before, (None, None))
    if name == "fail" and before not in ("done", "failed"):
        assert m.fire("fail") is State.FAILED
    elif name == legal_trigger and name in done:
        assert m.fire(name).value == dest
    else:
        try:
            m.fire(name)
        except OrderingError as e:
            guard_only = name == legal_trigger and name not in done
            assert isinstance(e, GuardError) is guard_only
            assert e.info.state == before and e.info.code in ("out_of_order", "guard_blocked") and e.info.remedy
        else:
            raise AssertionError(f"{name!r} moved the machine out of {before!r}")
        assert m.state.value == before


@SETTINGS
@given(actions)
def test_random_triggers_follow_the_reference(seq):
    seen: list[tuple[str, str, str]] = []
    m = SetupMachine(on_transition=lambda s, d, t, ms: seen.append((s.value, d.value, t)))
    done: set[str] = set()
    for a in seq:
        _apply(m, done, a)
    path = [s for s, _, _ in seen] + [m.state.value]
    if m.state is State.DONE:
        assert path == [s.value for s in ORDER]
    else:  # a prefix of the order, possibly ending in failed
        tail = path[:-1] if m.state is State.FAILED else path
        assert tail == [s.value for s in ORDER][: len(tail)]
    assert all(t != "fail" or d == "failed" for _, d, t in seen)


@SETTINGS
@given(st.lists(st.sampled_from(TRIGGERS + ["fail"]), max_size=12))
def test_terminal_states_refuse_everything(extra):
    """After done or failed, every trigger (fail included) raises OrderingError and nothing moves."""
    for end in ("done", "failed"):
        m = SetupMachine()
        for t in TRIGGERS:
            if end == "failed" and t == "built":
                m.fire("fail")
                break
            setattr(m.model, *WORK[t])
            m.fire(t)
        for t in extra:
            try:
                m.fire(t)
            except OrderingError as e:
                assert not isinstance(e, GuardError) and e.info.state == end
            else:
                raise AssertionError(f"{t!r} moved a terminal machine")
            assert m.state.value == end
