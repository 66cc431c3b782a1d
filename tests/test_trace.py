"""Trace reading: round-trip of every record type, schema policy, tolerant reading, last words."""

import json
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.observe import trace as tr
from pipeline.core.contracts import DeviceFacts, ErrorInfo, InstancePlan, Mode, Rejection, WorkspacePlan
from pipeline.core.eventlog import EventLog

ERR = ErrorInfo(code="capability_mismatch", state="resolve", message="m", remedy="r")
SAMPLES = {
    ev.RunStarted: dict(request={"device": "cpu"}, versions={"python": "3.11"}, packages={"torch": True}),
    ev.StateTransition: dict(from_state="resolve", to="build-mode", trigger="resolved", duration_ms=1.5),
    ev.DeviceInitialized: dict(facts=DeviceFacts(type="cuda", compute_capability=(9, 0)), blas_init=True),
    ev.SettingResolved: dict(field="zbal_local_mem_size", value=7, source="env", env_var="X"),
    ev.BackendsResolved: dict(prefill="a", decode="b", is_draft_override=False, rules={"prefill": "auto"},
                              rejected={"prefill": [Rejection(backend="c", reasons=["x"])]}),
    ev.BuildPlanned: dict(mode=Mode.TBO, hybrid=False, instances=[InstancePlan(role="p", backend="a", workspace="w")],
                          workspaces=[WorkspacePlan(id="w", owner="p", bytes=3, shared_by=["p"])]),
    ev.BackendBuilt: dict(role="p", backend="a", duration_ms=2.0),
    ev.StepSkipped: dict(what="npu_lazy_mem", reason="cpu"),
    ev.FeatureDowngraded: dict(what="cuda_graph", reason="cpu", avoid={"disable_cuda_graph": True}),
    ev.ReferenceFallback: dict(halves=["prefill", "decode"], backend="torch_native", device="sm100",
                               rejected={"prefill": [Rejection(backend="flashinfer", reasons=["arch sm100"])]},
                               avoid={"attention_backend": "torch_native"}, message="m"),
    ev.LazyMemInitialized: dict(bytes=4096, rank_arg=1, world_size=2),
    ev.BackendsAnnotated: dict(target="T", prefill="a", decode="b"),
    ev.InstanceVerified: dict(role="p", backend="a", max_rel_err=1e-3, tol=1e-2, passed=True),
    ev.ResourcesReleased: dict(released=["backend:p"]),
    ev.Heartbeat: dict(what="jit", elapsed_s=10.0, started_ns=5, message="still"),
    ev.RunFailed: dict(error=ERR, released=["x"]),
    ev.RunFinished: dict(duration_ms=3.0),
    ev.RunInterrupted: dict(reason="signal", signal="SIGTERM", error=ERR),
    ev.RunnerStarted: dict(config={"num_layers": 2}),
    ev.RunnerTransition: dict(from_state="load-model", to="init-memory-pool", trigger="model_loaded", duration_ms=1.0),
    ev.DistributedInitialized: dict(world_size=2, has_cpu_group=False, source="arguments"),
    ev.ModelLoaded: dict(num_layers=2, num_hidden_layers=32, param_bytes=10, dtype="bfloat16", seed=0,
                         aux_hidden_state_layers=[0, 1]),
    ev.MemoryPoolSized: dict(source="bytes", budget_bytes=1 << 20, bytes_per_token=8, num_token_slots=64, max_reqs=2,
                             max_context_len=16, page_size=1, req_to_token_bytes=128, kv_bytes=512),
    ev.RankStalled: dict(stalled_rank=1, last_state="resolve", seconds_since_heartbeat=0.25,
                         doing="compiling FlashInfer JIT variant decode-cuda_core/bf16-bf16/d128",
                         waiting_at="the resolution exchange", waited_s=3.1),
    ev.MemoryBalanced: dict(free_bytes=[80 << 30, 79 << 30], max_imbalance=0.1, duration_ms=1.5),
    ev.ResolutionAgreed: dict(world_size=2, table=[ev.RankRow(rank=r, host="h", device=f"cuda:{r}", prefill="fa3",
                                                           decode="fa3") for r in (0, 1)], duration_ms=1.5),
    ev.CudaGraphCaptured: dict(bs=8, capture_ms=12.5, backend="flashinfer"),
    ev.CudaGraphMemory: dict(backend="flashinfer", batch_sizes=[1, 2, 4, 8], pool_estimate=2097152,
                             state_estimate=44040192, warmup_estimate=35651584, blas_workspace_bytes=33554432,
                             total_estimate=81788928, pool_bytes=2097152, step_device_bytes=62914560),
    ev.ModelStepVerified: dict(step="decode#0", mode="decode", batch_size=4, graph=True, max_rel_err=1e-3, tol=1e-2,
                               passed=True),
    ev.RunnerReady: dict(duration_ms=5.0, graph_batch_sizes=[1, 2], rank_agreement="single rank"),
    ev.CommandStarted: dict(command="run", argv=["--device", "cpu"]),
    ev.CommandFinished: dict(command="run", exit_code=0, duration_ms=12.0),
    ev.StartupSummary: dict(wall_s=9.5, phases=[ev.PhaseTime(name="startup", seconds=0.7),
                                                ev.PhaseTime(name="resolve", seconds=0.003, parent="attention")],
                            unaccounted_s=0.01, coverage=0.99, process_start_ns=5),
    ev.SlowPhase: dict(phase="load-model", seconds=31.0, threshold_s=30.0),
    ev.EnvVarLookalike: dict(name="SGLANG_FLASHINFER_WORKSPACE_SIZ", known="SGLANG_FLASHINFER_WORKSPACE_SIZE"),
    ev.JitVariantLoaded: dict(variant="decode-cuda_core/bf16-bf16/d128/swa0/cap0/sm90", status="compiling",
                              seconds=18.5, started_ns=7, fields={"arch": "sm90", "head_dim_qk": 128}),
}


def test_every_record_type_has_a_sample():
    assert set(SAMPLES) == set(ev.EVENT_TYPES)


@pytest.mark.parametrize("cls", ev.EVENT_TYPES, ids=lambda c: ev.event_name(c))
def test_round_trip_every_record_type(cls, tmp_path):
    rec = cls(ts_ns=123, run_id="r", rank=1, state="resolve", **SAMPLES[cls])
    assert wire.decode_line(wire.encode(rec)) == rec
    path = tmp_path / "t.jsonl"
    path.write_bytes(wire.encode(rec) + b"\n")
    t = tr.read_trace(path)
    assert t.skipped_lines == 0 and t.runs[0].records == [rec] and (t.runs[0].run_id, t.runs[0].rank) == ("r", 1)


def _line(**over):
    obj = {"event": "run_finished", "schema_version": 1, "ts_ns": 1, "run_id": "r", "rank": 0, "state": "done",
           "outcome": "ok", "duration_ms": 1.0, **over}
    return json.dumps(obj).encode()


def test_schema_policy_and_tolerance(tmp_path, monkeypatch):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\n".join([
        _line(), b"{not json", _line(schema_version=99), _line(event="from_the_future"),
        _line(new_field="x", ts_ns=2), b'{"event": "run_finished", "ts_ns": "bad"}', _line(ts_ns=3)[:20]]))
    t = tr.read_trace(p)
    assert [s.reason for s in t.skipped] == ["not_json", "newer_schema", "unknown_event", "invalid_record", "not_json"]
    assert [s.line for s in t.skipped] == [2, 3, 4, 6, 7]
    assert t.dropped_fields == 1 and [r.ts_ns for r in t.runs[0].records] == [1, 2]
    # an old version passes through its upgrader (simulated: this reader at version 2, the line at 1)
    from pipeline.observe import trace

    monkeypatch.setattr(trace, "SCHEMA_VERSION", 2)
    monkeypatch.setattr(trace, "UPGRADERS", {1: lambda o: {**{k: v for k, v in o.items() if k != "ms"}, "duration_ms": o["ms"]}})
    old = tmp_path / "old.jsonl"
    old.write_bytes(_line(schema_version=1, ms=4.0, duration_ms=None).replace(b'"duration_ms": null, ', b""))
    rec = tr.read_trace(old).runs[0].records[0]
    assert rec.duration_ms == 4.0 and rec.schema_version == 2


@pytest.mark.parametrize("version", [0, -1, True, "1", 1.0])
def test_schema_version_below_one_or_not_an_integer_is_invalid(tmp_path, version):
    """Version 1 is the first ever written: 0, negatives and non-integers are invalid records."""
    p = tmp_path / "t.jsonl"
    p.write_bytes(_line(schema_version=version) + b"\n" + _line(ts_ns=2))
    t = tr.read_trace(p)
    assert [s.reason for s in t.skipped] == ["invalid_record"] and [r.ts_ns for r in t.runs[0].records] == [2]


def test_missing_file_and_nothing_readable(tmp_path):
    t = tr.read_trace([tmp_path / "nope.jsonl"])
    assert t.unreadable_files == [str(tmp_path / "nope.jsonl")] and t.runs == []
    from pipeline.core.errors import UsageError
    with pytest.raises(UsageError) as e:
        t.require_records()
    assert e.value.info.code == "trace_unreadable" and e.value.exit_code == 2


def test_heartbeat_records(tmp_path):
    log = EventLog("hb", 0, tmp_path / "hb.jsonl")
    log.emit(ev.StepSkipped, state="build-mode", what="x", reason="y")
    with log.heartbeat("jit compile of decode kernel", every_s=0.05):
        time.sleep(0.28)
    log.close()
    beats = tr.read_trace(tmp_path / "hb.jsonl").runs[0].all(ev.Heartbeat)
    assert 3 <= len(beats) <= 6
    assert all(b.state == "build-mode" and b.what == "jit compile of decode kernel" for b in beats)
    assert [b.elapsed_s for b in beats] == sorted(b.elapsed_s for b in beats) and beats[0].elapsed_s >= 0.05
    assert beats[0].message.startswith("still in build-mode: jit compile of decode kernel after")
    assert len({b.started_ns for b in beats}) == 1


SCRIPT = """
import os, signal, sys
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.eventlog import EventLog
log = EventLog("sig", 0, sys.argv[1])
log.install_signal_handlers()
log.emit(ev.StateTransition, state="build-mode", from_state="resolve", to="build-mode", trigger="resolved", duration_ms=1.0)
if sys.argv[2] == "term":
    os.kill(os.getpid(), signal.SIGTERM)
    import time; time.sleep(5)
raise RuntimeError("boom in build")
"""


@pytest.mark.parametrize("how", ["term", "raise"])
def test_sigterm_and_uncaught_exception_write_a_last_event(tmp_path, how):
    path = tmp_path / "t.jsonl"
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(path), how], capture_output=True, timeout=60)
    last = tr.read_trace(path).runs[0].records[-1]
    assert isinstance(last, ev.RunInterrupted) and last.state == "build-mode" and last.outcome == "failed"
    if how == "term":
        assert p.returncode == -15 and last.reason == "signal" and last.signal == "SIGTERM"
        assert last.error.code == "interrupted"
    else:
        assert p.returncode == 1 and last.reason == "uncaught_exception"
        assert last.error.code == "internal_error" and "boom in build" in last.error.message
    run = tr.read_trace(path).runs[0]
    assert run.status == "failed" and run.states()[-1] == {**run.states()[-1], "state": "build-mode", "outcome": "failed"}


# -- 6. inspect orders one launch's records by file position, not wall clock --------------------------------------
def _clock_stepped_back(tmp_path, shift_ns: int = -3600 * 10**9, first: int = 10):
    """``cli_run_ok.jsonl`` with the ``ts_ns`` of its records ``first``+ moved by ``shift_ns`` (a clock step)."""
    import json

    from conftest import ROOT

    lines = (ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl").read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        d = json.loads(line)
        d["ts_ns"] += shift_ns if i >= first else 0
        out.append(json.dumps(d))
    path = tmp_path / "clockback.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path


def test_inspect_survives_a_wall_clock_step_back(tmp_path):
    """The finding: records 10+ an hour back made ``attention`` appear twice, one copy ``incomplete``; the states
    are now those of the unshifted trace, the run ok."""
    import json

    from conftest import ROOT, run_main

    good = ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl"
    want = json.loads(run_main("inspect", "--json", str(good)).stdout)["runs"][0]
    proc = run_main("inspect", "--json", str(_clock_stepped_back(tmp_path)))
    run = json.loads(proc.stdout)["runs"][0]
    assert proc.returncode == 0 and run["ok"] and run["status"] == "ok", run["status"]
    assert [(s["state"], s["outcome"]) for s in run["runner_states"]] == [
        ("init-distributed", "ok"), ("load-model", "ok"), ("init-memory-pool", "ok"), ("attention", "ok"),
        ("capture-cuda-graphs", "skipped"), ("ready", "ok")]
    assert [s["state"] for s in run["states"]] == [s["state"] for s in want["states"]]


def test_inspect_diff_keeps_runner_ready_after_a_clock_step(tmp_path):
    """``inspect --diff`` of the trace against its clock-stepped copy lost ``runner:ready``; now every state."""
    from conftest import ROOT, run_main

    good = ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl"
    import json

    proc = run_main("inspect", "--diff", str(good), str(_clock_stepped_back(tmp_path)), "--json")
    assert proc.returncode == 0, proc.stderr
    states = json.loads(proc.stdout)["diff"]["ranks"][0]["states"]
    assert {"machine": "runner", "state": "ready", "a_ms": 0.0, "b_ms": 0.0, "delta_ms": 0.0} in states
    assert all(s["delta_ms"] == 0.0 for s in states) and len(states) == 12, states


def test_pieces_of_one_launch_in_two_files_still_merge_in_time_order(tmp_path):
    """A log split in two files, passed tail first: the pieces join by their first records' time, lines once."""
    import json

    from conftest import ROOT, run_main

    lines = (ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl").read_text().splitlines(keepends=True)
    head, tail = tmp_path / "head.jsonl", tmp_path / "tail.jsonl"
    head.write_text("".join(lines[:20]))
    tail.write_text("".join(lines[12:]))  # overlapping copies
    run = json.loads(run_main("inspect", "--json", str(tail), str(head)).stdout)["runs"][0]
    want = json.loads(run_main("inspect", "--json", str(ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl"))
                      .stdout)["runs"][0]
    assert run["ok"] and run["runner_states"] == want["runner_states"] and run["states"] == want["states"]
