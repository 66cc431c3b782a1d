"""Terminal progress: shown on a TTY only, read from the run's records, never in --json."""

from __future__ import annotations

import io
import time
import types

import pytest

from conftest import run_main
from pipeline.core import events as ev
from pipeline.core.contracts import InstancePlan, Mode
from pipeline.observe.progress import StartupProgress, describe, wanted

S = 1_000_000_000


def _r(cls, t, **kw):
    return cls(ts_ns=int(t * S), run_id="r", state="x", **kw)


def _plan(t, n):
    inst = [InstancePlan(role=f"tbo.child{i}", backend="torch_native", workspace="ws-shared") for i in range(n)]
    return _r(ev.BuildPlanned, t, mode=Mode.TBO, hybrid=False, instances=inst, workspaces=[])


def test_describe_follows_the_records():
    recs = [_r(ev.CommandStarted, 0, command="run")]
    assert describe(recs, 1 * S) == "preflight (1 s)"
    recs.append(_r(ev.RunnerTransition, 2, from_state="init-distributed", to="load-model", trigger="t",
                   duration_ms=1.0))
    assert describe(recs, int(4.4 * S)) == "load-model (2 s)"
    recs += [_plan(5, 3), _r(ev.RunnerTransition, 6, from_state="attention", to="capture-cuda-graphs", trigger="t",
                             duration_ms=1.0),
             _r(ev.CudaGraphCaptured, 7, bs=8, capture_ms=1.0, backend="flashinfer", graph_bytes=3 << 20)]
    assert describe(recs, 9 * S, graph_sizes=4) == "capture-cuda-graphs: bs 2 of 4, 3.0 MiB so far (3 s)"
    recs.append(_r(ev.Heartbeat, 9.5, what="capturing decode CUDA graphs", elapsed_s=3.0))
    recs.append(_r(ev.RunnerReady, 10, duration_ms=1.0))
    assert describe(recs, 11 * S) == "verification: instance 1 of 4 (1 s)"  # 3 instances + the TBO wrapper
    for i in range(4):
        recs.append(_r(ev.InstanceVerified, 12 + i, role=str(i), backend="b", max_rel_err=0.0, tol=1.0, passed=True))
    assert describe(recs, 17 * S) == "model steps: 0 checked (2 s)"


def test_describe_names_the_long_step_of_a_heartbeat():
    recs = [_r(ev.RunnerTransition, 1, from_state="init-memory-pool", to="attention", trigger="t", duration_ms=1.0),
            _r(ev.Heartbeat, 20, what="compiling decode-cuda_core/bf16-bf16/d128/swa0/cap0/sm90", elapsed_s=19.0)]
    assert describe(recs, 21 * S) == "attention: compiling decode-cuda_core/bf16-bf16/d128/swa0/cap0/sm90 (20 s)"


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("json_,no_progress,stream,want", [
    (False, False, _Tty(), True), (True, False, _Tty(), False), (False, True, _Tty(), False),
    (False, False, io.StringIO(), False)])
def test_wanted_only_on_a_terminal(json_, no_progress, stream, want):
    assert wanted(types.SimpleNamespace(json=json_, no_progress=no_progress), stream) is want


def test_progress_renders_on_a_fake_terminal():
    """rich Console(force_terminal=True) into a buffer: the line follows records appended while it runs."""
    from rich.console import Console

    buf = io.StringIO()
    log = types.SimpleNamespace(records=[])
    with StartupProgress(log, Console(file=buf, force_terminal=True, width=120), every_s=0.02):
        log.records.append(ev.RunnerTransition(ts_ns=time.time_ns(), run_id="r", state="x", from_state="a",
                                               to="load-model", trigger="t", duration_ms=1.0))
        time.sleep(0.3)
    assert "load-model (0 s)" in buf.getvalue()


def test_no_progress_off_a_terminal(tmp_path):
    """In-process (stderr is not a TTY) and with --no-progress: stderr holds no progress line."""
    p = run_main("run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "0", "--no-progress",
                 "--log-file", str(tmp_path / "a.jsonl"))
    assert p.returncode == 0 and "load-model (" not in p.stderr and "verification: instance" not in p.stderr
