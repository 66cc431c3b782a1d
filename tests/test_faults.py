"""Fault injection at every state and every backend construction step (torch_native on CPU).

Each fault must leave the machine in ``failed`` with one ``run_failed`` record carrying the
ErrorInfo, release everything allocated (weak references to the pools' tensors, the workspace
buffers and the backends die) and leave the process able to run a new start.
"""

from __future__ import annotations

import gc

import pytest

from pipeline.core import events as ev
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, SetupRequest
from pipeline.core.eventlog import EventLog
from pipeline.core.faults import Faults, InjectedFault, points_of_run

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}

# The fault points a successful run visits, in order — written from pipeline/faults.py's scheme.
STATES = ["device-init", "resolve"]
NORMAL = (["state:device-init", "state:device-init:done", "state:resolve", "state:resolve:done", "state:build-mode",
           "build:pools", "build:workspace:ws-shared", "build:instance:primary", "build:instance:primary:built",
           "build:compose", "state:build-mode:done", "state:npu-lazy-mem", "state:npu-lazy-mem:done",
           "state:annotate", "state:annotate:done"])
TBO_INSTANCES = [p for r in ("tbo.primary", "tbo.child0", "tbo.child1")
                 for p in (f"build:instance:{r}", f"build:instance:{r}:built")]
TBO = NORMAL[:7] + TBO_INSTANCES + NORMAL[9:]
STATE_OF = {"state:device-init": "device-init", "state:device-init:done": "device-init", "state:resolve": "resolve",
            "state:resolve:done": "resolve", "state:npu-lazy-mem": "npu-lazy-mem",
            "state:npu-lazy-mem:done": "npu-lazy-mem", "state:annotate": "annotate", "state:annotate:done": "annotate"}


@pytest.fixture(scope="module")
def tiny():
    """Llama-3.1-8B's attention shape with 2 layers and 64 KV slots (zeroing 32 full layers costs seconds)."""
    import json

    from conftest import CONFIGS
    from pipeline.core.contracts import PoolFacts
    from pipeline.core.model_spec import load_model_spec

    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg["num_hidden_layers"] = 2
    return load_model_spec(cfg), PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64, page_size=1)


def _req(model_pool, **args):
    model, pool = model_pool
    if args.get("enable_two_batch_overlap"):  # sglang's TBO needs an EP all-to-all (or attention DP)
        args.setdefault("moe_a2a_backend", "deepep")
    return SetupRequest(args=AttentionArgs(**args), model=model, pool=pool, device="cpu")


def _state_of(point: str) -> str:
    return STATE_OF.get(point, "build-mode")


@pytest.mark.parametrize("tbo,expected", [(False, NORMAL), (True, TBO)])
def test_a_clean_run_visits_every_point_in_order(tiny, tbo, expected):
    visited = points_of_run(lambda f: build_attention_backends(
        _req(tiny, enable_two_batch_overlap=tbo), installed=INSTALLED, faults=f).close())
    assert visited == expected


def _fail_at(point, req, make_error=None):
    """Run with a fault at ``point``; returns (faults, log, error type, error info) without keeping the traceback."""
    faults = Faults(at=[point], make_error=make_error)
    log = EventLog("fault-test", 0)
    try:
        build_attention_backends(req, installed=INSTALLED, log=log, faults=faults)
    except BaseException as e:  # noqa: BLE001 - the test inspects whatever was raised
        kind, msg = type(e), str(e)
    else:
        raise AssertionError(f"no fault raised at {point}")
    return faults, log, kind, msg


@pytest.mark.parametrize("tbo,point", [(False, p) for p in NORMAL] + [(True, p) for p in TBO_INSTANCES])
def test_fault_fails_records_releases_and_a_new_run_succeeds(tiny, tbo, point):
    req = _req(tiny, enable_two_batch_overlap=tbo)
    faults, log, kind, _ = _fail_at(point, req)
    assert kind is InjectedFault and faults.fired == [point]
    transitions = [r for r in log.records if isinstance(r, ev.StateTransition)]
    assert transitions[-1].to == "failed" and transitions[-1].from_state == _state_of(point)
    failed = [r for r in log.records if isinstance(r, ev.RunFailed)]
    assert len(failed) == 1 and isinstance(log.records[-1], ev.RunFailed)
    info = failed[0].error
    assert (info.code, info.state) == ("injected_fault", _state_of(point))
    assert [(f.name, f.value) for f in info.flags] == [("fault_point", point)] and info.remedy
    visited = faults.visited
    if "build:pools" in visited[:-1]:  # the pools were allocated before the fault: they are listed as released
        assert {"pool:kv_pool", "pool:req_to_token_pool"} <= set(failed[0].released)
    if "build:workspace:ws-shared" in visited[:-1]:
        assert "workspace:ws-shared" in failed[0].released
    built = [p.split(":")[2] for p in visited[:-1] if p.endswith(":built")]
    assert {f"backend:{r}" for r in built} <= set(failed[0].released)
    gc.collect()
    assert faults.alive() == [], "buffers or backends outlived the failed run"
    with build_attention_backends(req, installed=INSTALLED) as out:
        assert out.attn_backend.prefill_attention_backend_str == "torch_native"


@pytest.mark.parametrize("point", ["state:resolve", "build:instance:primary", "state:annotate:done"])
def test_untyped_crash_is_recorded_as_internal_error(tiny, point):
    faults, log, kind, msg = _fail_at(point, _req(tiny), make_error=lambda p: RuntimeError(f"boom {p}"))
    assert kind is RuntimeError
    info = [r for r in log.records if isinstance(r, ev.RunFailed)][0].error
    assert info.code == "internal_error" and info.message == f"RuntimeError: boom {point}"
    assert info.state == _state_of(point)
    gc.collect()
    assert faults.alive() == []


def test_close_on_success_releases_everything(tiny):
    """close(): weak references to pools' tensors, workspace buffers and backends all die."""
    faults = Faults()
    out = build_attention_backends(_req(tiny, enable_two_batch_overlap=True), installed=INSTALLED,
                                   faults=faults)
    assert len(faults.objects) > 10 and faults.alive()
    released = out.close()
    assert {"backend:tbo.primary", "backend:tbo.child0", "backend:tbo.child1", "workspace:ws-shared",
            "pool:kv_pool", "pool:req_to_token_pool"} == set(released)
    del out
    gc.collect()
    assert faults.alive() == []


def test_without_faults_nothing_is_consulted(tiny, monkeypatch):
    """Shipped path: no Faults object → the hook is never called."""
    calls = []
    monkeypatch.setattr(Faults, "hit", lambda self, *a: calls.append(a))
    build_attention_backends(_req(tiny), installed=INSTALLED).close()
    assert calls == []


def test_a_kept_exception_keeps_no_buffer_alive(tiny):
    """A caller holding the raised exception (and its traceback) keeps no pool, workspace or backend alive."""
    req = _req(tiny, enable_two_batch_overlap=True)
    for point in points_of_run(lambda f: build_attention_backends(req, installed=INSTALLED, faults=f).close()):
        faults = Faults(at=[point])
        with pytest.raises(InjectedFault) as kept:
            build_attention_backends(req, installed=INSTALLED, faults=faults)
        gc.collect()
        assert kept.value.__traceback__ is not None and faults.alive() == [], point
