"""One RunView: run's report and a trace read back (inspect) give the same timelines and the same verification
failure; the timeline rules checked on hand-written records against hand-written rows."""

from __future__ import annotations

import json

from conftest import run_main
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.observe.runs import outcomes, step_skips, timeline
from pipeline.runtime.runner import verification_failure
from pipeline.observe.trace import read_trace
from pipeline.observe.runs import Run

MS = 1_000_000


def _t(ts_ms, frm, to, dur, cls=ev.StateTransition):
    return cls(ts_ns=ts_ms * MS, run_id="r", state=frm, from_state=frm, to=to, trigger="t", duration_ms=dur)


def _skip(ts_ms, state, what):
    return ev.StepSkipped(ts_ns=ts_ms * MS, run_id="r", state=state, what=what, reason="x")


def test_step_skips_come_from_the_tables():
    assert step_skips() == {"npu_lazy_mem", "cuda_graph_capture"}


def test_setup_timeline_rows_by_hand():
    recs = [_t(10, "device-init", "resolve", 10.0), _t(12, "resolve", "build-mode", 2.0),
            _t(15, "build-mode", "npu-lazy-mem", 3.0), _skip(15, "npu-lazy-mem", "npu_lazy_mem"),
            _skip(11, "resolve", "cuda_graph"),  # a decision inside resolve: resolve still ran
            _t(16, "npu-lazy-mem", "annotate", 1.0), _t(16, "annotate", "done", 0.25)]
    recs.sort(key=lambda r: r.ts_ns)
    want = [("device-init", "ok", 10.0), ("resolve", "ok", 2.0), ("build-mode", "ok", 3.0),
            ("npu-lazy-mem", "skipped", 1.0), ("annotate", "ok", 0.25), ("done", "ok", 0.0)]
    assert [(r["state"], r["outcome"], r["duration_ms"]) for r in outcomes(recs, "setup")] == want
    rows = timeline(recs, "setup")
    assert rows[0]["start_ns"] == 0 and rows[1]["start_ns"] == 10 * MS and rows[-1]["start_ns"] == 16 * MS


def test_failed_and_unfinished_runs():
    failed = [_t(1, "device-init", "resolve", 1.0), _t(3, "resolve", "failed", 2.0)]
    assert [(r["state"], r["outcome"]) for r in outcomes(failed, "setup")] == [
        ("device-init", "ok"), ("resolve", "failed"), ("failed", "failed")]
    cut = [_t(1, "device-init", "resolve", 1.0), _skip(9, "resolve", "cuda_graph")]
    # the report lists the states left; the trace view adds the one the run was last seen in
    assert [r["state"] for r in outcomes(cut, "setup")] == ["device-init"]
    last = timeline(cut, "setup")[-1]
    assert (last["state"], last["outcome"], last["duration_ms"]) == ("resolve", "incomplete", 8.0)
    assert timeline(cut, "setup", failed=True)[-1]["outcome"] == "failed"
    assert outcomes([_skip(1, "device-init", "x")], "setup") == []


def test_runner_machine_uses_its_own_records_and_skip():
    recs = [_t(1, "load-model", "attention", 1.0, ev.RunnerTransition), _t(5, "device-init", "resolve", 1.0),
            _skip(6, "capture-cuda-graphs", "cuda_graph_capture"),
            _t(7, "attention", "capture-cuda-graphs", 6.0, ev.RunnerTransition),
            _t(8, "capture-cuda-graphs", "ready", 1.0, ev.RunnerTransition)]
    assert [(r["state"], r["outcome"]) for r in outcomes(recs, "runner")] == [
        ("load-model", "ok"), ("attention", "ok"), ("capture-cuda-graphs", "skipped"), ("ready", "ok")]


def _verified(passed_inst, passed_step):
    return [ev.InstanceVerified(ts_ns=1, run_id="r", state="done", role="primary", backend="torch_native",
                                max_rel_err=0.0 if passed_inst else 0.5, tol=1e-2, passed=passed_inst),
            ev.ModelStepVerified(ts_ns=2, run_id="r", state="ready", step="decode1", mode="decode", batch_size=2,
                                 graph=True, max_rel_err=0.0 if passed_step else 0.25, tol=2e-2, passed=passed_step)]


def test_one_verification_failure_builder():
    assert verification_failure(_verified(True, True)) is None
    e = verification_failure(_verified(False, False))
    assert (e.code, e.state) == ("verification_failed", "done")
    assert e.message == ("instances failed verification against the float64 reference: primary (torch_native: "
                         "5.00e-01 > 1e-02); model steps failed verification against the float64 reference: "
                         "decode1 (graph: 2.50e-01 > 2e-02)")
    only_step = verification_failure(_verified(True, False))
    assert only_step.state == "ready" and only_step.message.startswith("model steps failed")
    # a trace without its run_failed record still reads as failed by the same rule
    assert Run(run_id="r", rank=0, records=_verified(False, False)).failure == e


def test_an_mla_step_failure_names_its_reference_and_derived_tolerance():
    """An MLA stack's checks say which reference failed them, and a derived tolerance keeps its digits
    (``1e-02`` would hide what the step was held to); a trace written before ``reference`` reads as before."""
    def step(ref, err, tol):
        return ev.ModelStepVerified(ts_ns=2, run_id="r", state="ready", step="decode#143", mode="decode",
                                    batch_size=4, graph=False, max_rel_err=err, tol=tol, passed=err <= tol,
                                    reference=ref)
    e = verification_failure([step("mla-absorbed", 0.004, 1e-2), step("mla-unabsorbed", 0.0311, 0.0212)])
    assert e.message == ("model steps failed verification against the float64 reference: "
                         "decode#143 (eager, mla-unabsorbed: 3.11e-02 > 2.12e-02)")
    old = wire.decode_line(b'{"event":"model_step_verified","schema_version":1,"ts_ns":2,"run_id":"r","rank":0,'
                         b'"state":"ready","outcome":"failed","step":"decode#1","mode":"decode","batch_size":4,'
                         b'"graph":false,"max_rel_err":0.02,"tol":0.01,"passed":false}')
    assert old.reference == "" and verification_failure([old]).message.endswith("decode#1 (eager: 2.00e-02 > 1e-02)")


def test_run_report_and_inspect_agree(tmp_path):
    log = tmp_path / "run.jsonl"
    p = run_main("run", "--device", "cpu", "--log-file", str(log), "--json", "--decode-steps", "1")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    (run,) = read_trace(str(log)).runs
    for key, rows in (("states", run.states()), ("runner_states", run.runner_states())):
        assert report[key] == [{"state": r["state"], "outcome": r["outcome"], "duration_ms": round(r["duration_ms"], 3)}
                               for r in rows]
        assert report[key] and report[key][-1]["outcome"] == "ok"
    assert [s["state"] for s in report["runner_states"]][-1] == "ready"
    assert [s["state"] for s in report["states"]][-1] == "done"
