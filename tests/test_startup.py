"""startup_summary, slow_phase and --metrics-file (§6)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_main
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.errors import UsageError
from pipeline.observe.startup import process_start_ns, slow_threshold, summarize
from conftest import ROOT
import os

S = 1_000_000_000


def _rec(cls, t_s, **kw):
    return cls(ts_ns=int(t_s * S), run_id="r", state="x", **kw)


def _synthetic():
    """A launch with known times (seconds from a process start at t=100)."""
    return [
        _rec(ev.CommandStarted, 100.5, command="run"),
        _rec(ev.RunnerStarted, 101.0, config={}),
        _rec(ev.RunnerTransition, 101.2, from_state="load-model", to="init-memory-pool", trigger="t", duration_ms=200.0),
        _rec(ev.StateTransition, 101.25, from_state="resolve", to="build-mode", trigger="t", duration_ms=30.0),
        _rec(ev.RunnerTransition, 101.3, from_state="attention", to="capture-cuda-graphs", trigger="t",
             duration_ms=100.0),
        _rec(ev.CudaGraphCaptured, 101.5, bs=8, capture_ms=150.0, backend="flashinfer", graph_bytes=4096),
        _rec(ev.RunnerTransition, 101.6, from_state="capture-cuda-graphs", to="ready", trigger="t", duration_ms=300.0),
        _rec(ev.RunnerReady, 101.6, duration_ms=600.0),
        _rec(ev.InstanceVerified, 102.6, role="primary", backend="torch_native", max_rel_err=0.0, tol=1.0,
             passed=True, duration_ms=990.0),
        _rec(ev.ModelStepVerified, 104.1, step="extend", mode="extend", batch_size=4, graph=False, max_rel_err=0.0,
             tol=1.0, passed=True),
    ]


def test_summarize_arithmetic():
    """Every phase against hand arithmetic on the synthetic times; unaccounted = wall - top-level phases."""
    jit = [{"variant": "decode-cuda_core/bf16-bf16/d128/swa0/cap0/sm90", "status": "compiling", "seconds": 12.5}]
    s = summarize(_synthetic(), start_ns=100 * S, end_ns=int(104.3 * S), jit=jit)
    top = {p.name: p.seconds for p in s["phases"] if not p.parent}
    want = {"startup": 0.5, "preflight": 0.5, "load-model": 0.2, "attention": 0.1, "capture-cuda-graphs": 0.3,
            "verification": 1.0, "model-steps": 1.5, "release": 0.2}
    assert top == pytest.approx(want, abs=1e-6)
    kids = {(p.parent, p.name): (p.seconds, p.detail) for p in s["phases"] if p.parent}
    assert kids == {("attention", "resolve"): pytest.approx((0.03, "")),
                    ("capture-cuda-graphs", "bs=8"): pytest.approx((0.15, "4096 bytes")),
                    ("verification", "primary"): pytest.approx((0.99, "torch_native")),
                    ("attention", "jit:" + jit[0]["variant"]): pytest.approx((12.5, "compiling"))}
    assert s["wall_s"] == pytest.approx(4.3)
    assert s["unaccounted_s"] == pytest.approx(4.3 - sum(want.values()), abs=1e-6)
    assert s["coverage"] == pytest.approx(sum(want.values()) / 4.3, abs=1e-4)


def test_summarize_refused_before_the_runner():
    """A refusal in preflight: startup and preflight (to run_failed), nothing else, no release phase."""
    from pipeline.core.contracts import ErrorInfo

    recs = [_rec(ev.CommandStarted, 10.2, command="run"),
            _rec(ev.RunFailed, 10.9, error=ErrorInfo(code="x", state="resolve", message="m"))]
    s = summarize(recs, start_ns=10 * S, end_ns=11 * S)
    assert [(p.name, p.seconds) for p in s["phases"]] == [("startup", pytest.approx(0.2)),
                                                           ("preflight", pytest.approx(0.7))]
    assert s["unaccounted_s"] == pytest.approx(0.1)


def test_process_start_is_the_spawn_time():
    """The child's own start time lies between the parent's clock before spawning and the child's first line."""
    t0 = time.time_ns()
    out = subprocess.run([sys.executable, "-c", "import time;t=time.time_ns();from pipeline.observe.startup import "
                          "process_start_ns as p;print(p(), t)"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent)
    start, first_line = map(int, out.stdout.split())
    assert t0 - 20_000_000 <= start <= first_line  # one clock tick (10 ms) of resolution, twice
    assert process_start_ns() < time.time_ns()


@pytest.mark.parametrize("flag,env,ok", [(None, None, None), ("2.5", None, 2.5), (None, "7", 7.0),
                                         ("1", "9", 1.0), ("0", None, False), ("-1", None, False),
                                         ("abc", None, False), ("inf", None, False), (None, "nan", False),
                                         (None, "", None)])
def test_slow_threshold_flag_env_and_refusals(monkeypatch, flag, env, ok):
    """flag > env > off; a value that is not a finite number > 0 is a UsageError naming the one it came from."""
    if env is None:
        monkeypatch.delenv("ATTN_SETUP_SLOW_PHASE_S", raising=False)
    else:
        monkeypatch.setenv("ATTN_SETUP_SLOW_PHASE_S", env)
    if ok is False:
        with pytest.raises(UsageError) as e:
            slow_threshold(flag)
        assert e.value.info.flags[0].name == ("--slow-phase-s" if flag is not None else "ATTN_SETUP_SLOW_PHASE_S")
        assert e.value.info.remedy
    else:
        assert slow_threshold(flag) == ok


def _parse_metrics(text):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_render_parses_and_escapes():
    """OpenMetrics text parsed back by prometheus_client: every phase, graph bytes, JIT counts; odd label text kept."""
    from pipeline.observe.metrics import render

    jit = [{"variant": 'a"b\\c', "status": "compiling", "seconds": 3.0},
           {"variant": "v2", "status": "cached", "seconds": 0.1}, {"variant": "v3", "status": "cached", "seconds": 0.1}]
    recs = _synthetic()
    s = ev.StartupSummary(ts_ns=1, run_id="r\n1", state="done", **summarize(recs, start_ns=100 * S, end_ns=int(104.3 * S), jit=jit))
    fam = _parse_metrics(render(s, recs))
    phases = {(x.labels["phase"], x.labels["parent"]): x.value for x in fam["attn_setup_startup_phase_seconds"].samples}
    assert phases == {(p.name, p.parent): pytest.approx(p.seconds) for p in s.phases}
    assert ('jit:a"b\\c', "attention") in phases
    assert {x.labels["run_id"] for x in fam["attn_setup_startup_phase_seconds"].samples} == {"r\n1"}
    assert [(x.labels["bs"], x.value) for x in fam["attn_setup_cuda_graph_bytes"].samples] == [("8", 4096.0)]
    assert {x.labels["status"]: x.value for x in fam["attn_setup_jit_variants"].samples} == {"compiling": 1.0,
                                                                                              "cached": 2.0}
    assert fam["attn_setup_startup_unaccounted_seconds"].samples[0].value == pytest.approx(s.unaccounted_s)


def test_run_writes_summary_metrics_and_slow_phase(tmp_path):
    """A CPU run: --metrics-file equals the logged summary; --slow-phase-s warns for exactly the phases above it;
    inspect --json shows the same summary (key ``summary``)."""
    log, prom = tmp_path / "a.jsonl", tmp_path / "m.prom"
    p = run_main("run", "--device", "cpu", "--json", "--num-layers", "1", "--decode-steps", "1", "--log-file",
                 str(log), "--metrics-file", str(prom), "--slow-phase-s", "0.05")
    assert p.returncode == 0, p.stderr[-2000:]
    records = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    s = next(r for r in records if isinstance(r, ev.StartupSummary))
    slow = [r for r in records if isinstance(r, ev.SlowPhase)]
    assert sorted((r.phase, r.parent) for r in slow) == sorted((x.name, x.parent) for x in s.phases if x.seconds > 0.05)
    assert slow and all(r.seconds > r.threshold_s == 0.05 for r in slow)
    fam = _parse_metrics(prom.read_text())
    got = {(x.labels["phase"], x.labels["parent"]): x.value for x in fam["attn_setup_startup_phase_seconds"].samples}
    assert got == {(x.name, x.parent): pytest.approx(x.seconds) for x in s.phases}
    q = run_main("inspect", "--json", str(log))
    import msgspec

    assert json.loads(q.stdout)["runs"][0]["summary"] == json.loads(p.stdout)["summary"] == msgspec.to_builtins(s)
    assert "startup summary" in run_main("inspect", str(log)).stdout


def test_refused_run_still_ends_with_summary(tmp_path):
    """Exit 3 (refused in preflight): the summary is still the last record before command_finished, and the
    metrics file is written."""
    log, prom = tmp_path / "a.jsonl", tmp_path / "m.prom"
    p = run_main("run", "--device", "cpu", "--json", "--attention-backend", "flashmla", "--log-file", str(log),
                 "--metrics-file", str(prom))
    assert p.returncode == 3
    records = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    assert isinstance(records[-2], ev.StartupSummary) and isinstance(records[-1], ev.CommandFinished)
    assert [x.name for x in records[-2].phases if not x.parent] == ["startup", "preflight"]
    assert {x.parent for x in records[-2].phases} == {"", "preflight"}  # the refusal's setup states ran there
    assert "attn_setup_startup_phase_seconds" in _parse_metrics(prom.read_text())


@pytest.mark.parametrize("bad", ["DIR", "FILE/m.prom", "FIFO"])
def test_metrics_file_unwritable_is_a_usage_error(tmp_path, bad):
    """A directory, a path under a file (a folder that cannot be made) or a FIFO: exit 2 naming --metrics-file, and
    the target is left as it was (the summary written at exit never renames over it)."""
    import os
    import stat

    (tmp_path / "FILE").write_text("x")
    if bad == "FIFO":
        os.mkfifo(tmp_path / "FIFO")
    path = tmp_path if bad == "DIR" else tmp_path / bad
    p = run_main("run", "--device", "cpu", "--json", "--metrics-file", str(path), "--log-file",
                 str(tmp_path / "a.jsonl"))
    assert p.returncode == 2
    err = json.loads(p.stdout)["error"]
    assert err["flags"][0]["name"] == "--metrics-file" and err["remedy"]
    assert (tmp_path / "FILE").read_text() == "x"
    if bad == "FIFO":
        assert stat.S_ISFIFO(os.stat(path).st_mode)


def test_write_metrics_never_renames_over_a_file_that_is_not_regular(tmp_path):
    """write_metrics on a FIFO (standing in for /dev/zero, which the atomic rename replaced when run as root) raises
    OSError and leaves it."""
    import os
    import stat

    from pipeline.observe.metrics import write_metrics

    os.mkfifo(tmp_path / "f")
    with pytest.raises(OSError):
        write_metrics(str(tmp_path / "f"), None)
    assert stat.S_ISFIFO(os.stat(tmp_path / "f").st_mode) and os.listdir(tmp_path) == ["f"]


def test_perfetto_slices_for_verification_model_steps_and_jit():
    """Two ranks: each rank's track (tid = rank) has a verify slice per instance (its duration, ending at the
    record), one model-steps slice (last verification to last step) and one slice per JIT variant from its start."""
    from pipeline.observe.perfetto import chrome_trace
    from pipeline.observe.runs import Run, Trace

    runs = []
    for rank in (0, 1):
        recs = [r if r.rank == rank else type(r)(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "rank": rank})
                for r in _synthetic()]
        recs.insert(3, ev.JitVariantLoaded(ts_ns=int(101.26 * S), run_id="r", rank=rank, state="attention",
                                           variant="prefill-fa2/bf16-bf16/d128/swa0/cap0/sm90", status="compiling",
                                           seconds=0.02, started_ns=int(101.24 * S)))
        runs.append(Run(run_id="r", rank=rank, records=recs))
    evs = chrome_trace(Trace(runs=runs))["traceEvents"]
    t0 = min(e["ts"] for e in evs if e.get("ph") == "X")
    for rank in (0, 1):
        mine = {e["name"]: e for e in evs if e.get("ph") == "X" and e["tid"] == rank}
        v = mine["verify primary (torch_native)"]
        assert v["dur"] == pytest.approx(990_000.0) and v["ts"] + v["dur"] == pytest.approx(mine["model steps"]["ts"])
        assert mine["model steps"]["dur"] == pytest.approx(1.5e6)
        j = mine["jit compiling prefill-fa2/bf16-bf16/d128/swa0/cap0/sm90"]
        assert j["dur"] == pytest.approx(20_000.0) and j["ts"] - t0 == pytest.approx(
            mine["verify primary (torch_native)"]["ts"] - t0 - (102.6 - 0.99 - 101.24) * 1e6, abs=1.0)


def test_a_cold_start_is_named_in_the_summary_and_the_progress_line():
    """``import torch`` measured inside ``startup`` is its child with why it took long (bytecode compiled on a first
    run), ``startup``'s detail says it was a cold start, and the progress line leads with it; a warm import is a
    child too, without the lead (~11 s in startup, unexplained)."""
    from pipeline.core import events as ev
    from pipeline.observe.progress import cold_start_lead
    from pipeline.observe.startup import summarize, timed_torch_import

    cmd = ev.CommandStarted(run_id="r", rank=0, state="args", outcome="ok", ts_ns=int(12e9), command="run", argv=[])
    why = ("no cached bytecode for torch (installed with --no-compile, or its __pycache__ removed): "
           "Python compiled it on this import (cached for later runs)")
    s = summarize([cmd], start_ns=int(1e9), end_ns=int(13e9), startup_parts=[("import torch", 9.5, why)])
    startup, child = s["phases"][0], s["phases"][1]
    assert (startup.name, startup.seconds) == ("startup", pytest.approx(11.0)) and "cold start" in startup.detail
    assert (child.name, child.parent, child.seconds, child.detail) == ("import torch", "startup", 9.5, why)
    assert s["coverage"] == pytest.approx(1.0, abs=0.1)  # children are not counted twice
    assert cold_start_lead({"seconds": 9.5, "cold": True, "detail": why}) == f"startup: import torch 9.5 s ({why})"
    warm = summarize([cmd], start_ns=int(1e9), end_ns=int(13e9), startup_parts=[("import torch", 2.0, "cached")])
    assert "cold" not in warm["phases"][0].detail and cold_start_lead({"seconds": 2.0, "cold": False}) == ""
    assert timed_torch_import() == {"seconds": 0.0, "cold": False, "detail": "already imported"}  # torch is loaded


GOLDEN = ROOT / "tests" / "data" / "golden"


LOG = str(GOLDEN / "ok_default.jsonl")


def test_readme_shows_the_summary_as_run_and_as_inspect_print_it():
    """README's startup-summary samples: ``run``'s table (its title and box) and ``inspect``'s plain text."""
    section = (ROOT / "docs" / "startup.md").read_text(encoding="utf-8")
    assert "startup summary (seconds; children indented under their phase)\n┏" in section
    assert "\n  startup summary (seconds):\n    startup " in section
    assert "a first run in a fresh environment, where Python compiles" not in section
    assert "--no-compile" in section and "PYTHONDONTWRITEBYTECODE" in section


def test_a_cold_torch_import_is_named_only_without_cached_bytecode(tmp_path):
    """An empty ``PYTHONPYCACHEPREFIX`` (no bytecode cached for torch) is a cold import, named with its causes;
    the next import in the same environment reads the cache Python wrote."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"), PYTHONPATH=str(ROOT))
    code = "import json; from pipeline.observe.startup import timed_torch_import as t; print(json.dumps(t()))"
    first, second = (json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                               text=True, check=True, timeout=300).stdout) for _ in range(2))
    assert first["cold"] and "--no-compile" in first["detail"] and "compiled" in first["detail"], first
    assert not second["cold"] and second["detail"] == "cached bytecode", second
