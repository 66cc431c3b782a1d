"""The caches of the setup's hot path give exactly what the uncached code gives.

``layer_kinds`` is kept per spec, ``StepTable.transitions()`` is built once per table and the events' float-field
map is computed per tag on first use; each is checked here against the computation it replaced, over every
bundled config, both step tables and every record type.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core import spec as S
from pipeline.core.errors import ModelConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.runtime.table import RUNNER
from pipeline.setup.table import SETUP

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "examples" / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_layer_kinds_cached_equals_computed(path):
    m = load_model_spec(path)
    first, second = S.layer_kinds(m), m.layer_kinds()
    assert first == second == S._layer_kinds(m)
    assert first is not second  # a new list each call: a caller appending to it changes nothing here
    first.clear()
    assert m.layer_kinds() == S._layer_kinds(m)


def test_layer_kinds_follows_in_place_layer_types_change():
    m = load_model_spec(CONFIGS[0])
    kinds = m.layer_kinds()
    assert [k.kind for k in kinds] == sorted({t for t in m.layer_types if t in S.ATTENTION_LAYER_TYPES},
                                            key=m.layer_types.index)
    m.layer_types[0] = "mamba"  # the list is the one field a frozen spec can still change
    assert 0 not in {i for k in m.layer_kinds() for i in k.layer_ids}
    assert m.layer_kinds() == S._layer_kinds(m)
    m.layer_types[1] = "sliding"  # this spec has no sliding_window: the error is raised every call, not cached
    if m.sliding_window is None:
        for _ in range(2):
            with pytest.raises(ModelConfigError):
                m.layer_kinds()


def test_layer_kinds_cache_is_bounded_and_by_identity():
    base = load_model_spec(CONFIGS[0])
    specs = [msgspec.structs.replace(base, num_attention_heads=base.num_attention_heads * (i + 1))
             for i in range(S._KINDS_CACHE_MAX + 5)]
    for i, m in enumerate(specs):
        assert m.layer_kinds()[0].num_heads == base.num_attention_heads * (i + 1)
    assert len(S._KINDS_CACHE) <= S._KINDS_CACHE_MAX
    for i, m in enumerate(specs):  # evicted ones are computed again, equal
        assert m.layer_kinds() == S._layer_kinds(m)


@pytest.mark.parametrize("table", [SETUP, RUNNER], ids=lambda t: t.machine)
def test_transitions_equal_the_table(table):
    st = table.State
    want = [dict(trigger=s.trigger, source=st(s.state), dest=st(table.next_state(s)),
                 conditions=[g.name for g in table.guards(s)]) for s in table.steps]
    want.append(dict(trigger="fail", source=[st(s.state) for s in table.steps], dest=st(table.failed)))
    a, b = table.transitions(), table.transitions()
    assert a == b == want
    a[0]["conditions"].append("x")  # fresh dicts and lists each call
    a[-1]["source"].clear()
    assert table.transitions() == want


def test_float_fields_lazy_equal_eager():
    memo: dict = {}
    want = {ev.event_name(c): wire._float_spec(mi.type_info(c), memo) for c in ev.EVENT_TYPES}
    assert dict(wire.FLOAT_FIELDS) == want
    assert len(wire.FLOAT_FIELDS) == len(ev.EVENT_TYPES) and set(wire.FLOAT_FIELDS) == set(want)
    assert wire.FLOAT_FIELDS.get("no_such_event") is None
    with pytest.raises(KeyError):
        wire.FLOAT_FIELDS["no_such_event"]
    assert any(isinstance(v, dict) and any(isinstance(x, tuple) for x in v.values()) for v in want.values())


def test_nonfinite_float_reads_back_in_a_fresh_process(tmp_path):
    """The first lookup happens inside decode_line (nothing computed at import)."""
    import subprocess
    import sys

    rec = ev.Heartbeat(ts_ns=1, run_id="r", rank=0, state="resolve", what="jit", elapsed_s=float("nan"))
    line = wire.encode(rec)
    assert b'"NaN"' in line
    code = ("import sys, math; from pipeline.core import wire; "
            "r = wire.decode_line(sys.stdin.buffer.read()); print(math.isnan(r.elapsed_s))")
    out = subprocess.run([sys.executable, "-c", code], input=line, capture_output=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.stdout.strip() == b"True"


def test_catalogue_unchanged_by_laziness():
    assert json.loads(json.dumps(ev.catalogue()))  # every record type still listed
    assert len(ev.catalogue()) == len(ev.EVENT_TYPES)


@pytest.mark.parametrize("table", [SETUP, RUNNER], ids=lambda t: t.machine)
def test_shared_machine_rules_keep_no_model_and_machines_move_alone(table):
    """Every TableMachine of a table registers its model with the table's one pytransitions Machine and removes
    it at once: two machines move independently, and a dropped one is collected."""
    import gc
    import weakref

    from pipeline.core.errors import OrderingError
    from pipeline.core.steps import TableMachine
    from pipeline.runtime.table import RunnerModel
    from pipeline.setup.context import SetupModel

    model = SetupModel if table is SETUP else RunnerModel
    st, first = table.State, table.State(table.steps[0].state)
    a, b = TableMachine(table, model()), TableMachine(table, model())
    assert table.machine_rules.models == [] and a.state == b.state == first
    for g in table.guards(table.steps[0]):  # a's first guard holds, b's does not
        setattr(a.model, g.name, lambda: True)
    assert a.fire(table.steps[0].trigger) == st(table.next_state(table.steps[0]))
    assert b.state == first and not b.may(table.steps[0].trigger)
    with pytest.raises(OrderingError):
        b.fire(table.steps[1].trigger)
    assert b.fire("fail") == st(table.failed) and a.state == st(table.next_state(table.steps[0]))
    ref = weakref.ref(a.model)
    del a
    gc.collect()
    assert ref() is None and table.machine_rules.models == []


def test_a_setup_reads_free_memory_once_and_still_refuses_a_pool_that_cannot_fit():
    """build-mode's check reads the device's free memory for the pools and its apply allocates without a second
    read (on CPU each read is a /proc/meminfo, ~50 µs); a pool larger than that reading is refused in build-mode
    with no pool allocated."""
    from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
    from pipeline.core.errors import ConfigError
    from pipeline.platforms.cpu import host_available_bytes
    from pipeline.platforms.cpu import CpuPlatform
    from pipeline.setup.build import build_attention_backends

    class Counting(CpuPlatform):
        def __init__(self, free: int) -> None:
            super().__init__()
            self.free, self.reads = free, 0

        def memory_available(self, index: int = 0) -> int:
            self.reads += 1
            return self.free

    installed = {"torch": True, "triton": False, "flashinfer-python": False}
    req = SetupRequest(args=AttentionArgs(), model=load_model_spec(CONFIGS[0]), device="cpu",
                       pool=PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64))
    plat = Counting(host_available_bytes())
    with build_attention_backends(req, platform=plat, installed=installed) as out:
        assert out.pools["kv_pool"] is not None
    assert plat.reads == 1
    small = Counting(1 << 20)  # 1 MiB free: the 64-slot pools of a 32-layer model need more
    with pytest.raises(ConfigError) as e:
        build_attention_backends(req, platform=small, installed=installed)
    assert (e.value.info.code, e.value.info.state, small.reads) == ("pool_exceeds_memory", "build-mode", 1)
