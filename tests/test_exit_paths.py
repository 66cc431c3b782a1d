"""Every exit of `attn-setup run` writes a terminal record, and `inspect` never calls a failed start ok.

Crashes after the pipeline, a real Ctrl-C from outside, a trace file that stops accepting writes,
two launches sharing a run id and a log file, and huge logs read in bounded memory.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from pipeline.core import events as ev
from pipeline.cli import main
from pipeline.core.contracts import ErrorInfo
from pipeline.observe.trace import MAX_LINE_BYTES, TraceReader, read_trace

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--num-layers", "1", "--decode-steps", "1"]


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines()]


def _inspect(capsys, path: Path) -> tuple[int, dict]:
    code = main(["inspect", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_crash_after_the_pipeline_is_logged_and_inspect_says_failed(tmp_path, capsys, monkeypatch):
    """An exception in cmd after the runner is ready (the qk_rope_head_dim 63 kind): exit 1
    internal_error, and the log says so (run_failed, command_finished 1) — inspect exits 1."""
    import pipeline.runtime.model_steps

    def boom(*a, **k):
        raise RuntimeError("boom after the pipeline")

    monkeypatch.setattr(pipeline.runtime.model_steps, "verify_model_steps", boom)
    log = tmp_path / "l.jsonl"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), *FAST])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["error"]["code"] == "internal_error" and "boom" in out["error"]["message"]
    recs = _records(log)
    failed = [r for r in recs if r["event"] == "run_failed"]
    assert [f["error"]["code"] for f in failed] == ["internal_error"]
    assert recs[-1]["event"] == "command_finished" and recs[-1]["exit_code"] == 1
    assert any(r["event"] == "runner_transition" and r["to"] == "ready" for r in recs)  # the runner was ready
    code, report = _inspect(capsys, log)
    assert code == 1 and report["runs"][0]["status"] == "failed"
    assert report["runs"][0]["failure"]["code"] == "internal_error"


def test_failed_verification_is_a_run_failed(tmp_path, capsys, monkeypatch):
    """A verification that comes out NaN: written as text, a run_failed record, exit 1, inspect 1."""
    import pipeline.runtime.model_steps as ms

    real = ms.verify_model_steps

    def nan_steps(runner, decode_steps=3, **kw):  # kw: the speculative shape, if any
        return [*real(runner, decode_steps=decode_steps, **kw),
                ms.StepCheck(step="extend", mode="extend", batch_size=4, graph=False, max_rel_err=float("nan"), tol=2e-2)]

    monkeypatch.setattr(ms, "verify_model_steps", nan_steps)
    log = tmp_path / "l.jsonl"
    assert main(["run", "--device", "cpu", "--json", "--log-file", str(log), *FAST]) == 1
    capsys.readouterr()
    assert b'"max_rel_err":"NaN"' in log.read_bytes()
    code, report = _inspect(capsys, log)
    assert code == 1 and report["skipped_lines"] == 0 and report["runs"][0]["failure"]["code"] == "verification_failed"


def test_ctrl_c_from_outside(tmp_path):
    """A real SIGINT to a running `attn-setup run`: exit 130, no traceback, run_interrupted and
    command_finished 130 in the log, inspect exits 1."""
    log = tmp_path / "l.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", "--device", "cpu", "--log-file", str(log),
                             *FAST], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 120
    while not (log.exists() and b'"runner_started"' in log.read_bytes()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err and b"interrupted" in err
    recs = _records(log)
    assert any(r["event"] == "run_interrupted" and r["signal"] == "SIGINT" for r in recs)
    assert recs[-1]["event"] == "command_finished" and recs[-1]["exit_code"] == 130
    run = read_trace(log).runs[0]
    assert run.status == "failed" and run.failure.code == "interrupted"


class _FillsUp:
    """A file object whose writes fail with ENOSPC after ``ok`` of them (a disk filling up)."""

    def __init__(self, fh, ok: int) -> None:
        self.fh, self.ok = fh, ok

    def write(self, data: bytes) -> int:
        if self.ok <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.ok -= 1
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def test_log_that_fills_up_is_exit_2_naming_the_flag(tmp_path, capsys, monkeypatch):
    """Writes that start failing mid-run: the run stops there (nothing verified), no traceback, exit 2
    log_write_failed naming --log-file, and every line that did get written is a whole, readable record."""
    import pipeline.core.eventlog

    real = pipeline.core.eventlog.open_regular
    monkeypatch.setattr(pipeline.core.eventlog, "open_regular", lambda *a, **k: _FillsUp(real(*a, **k), ok=5))
    log = tmp_path / "l.jsonl"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), *FAST])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"]["code"] == "log_write_failed" and out["verified"] == []
    assert [f["name"] for f in out["error"]["flags"]] == ["--log-file"] and out["error"]["remedy"]
    t = read_trace(log)
    assert t.skipped_lines == 0 and len(t.runs[0].records) == 5


def test_first_write_failing_stops_before_any_work(tmp_path, capsys, monkeypatch):
    import pipeline.cli.run
    import pipeline.core.eventlog

    real = pipeline.core.eventlog.open_regular
    monkeypatch.setattr(pipeline.core.eventlog, "open_regular", lambda *a, **k: _FillsUp(real(*a, **k), ok=0))
    monkeypatch.setattr(pipeline.cli.run, "preflight", lambda *a: pytest.fail("work started after a failed write"))
    assert main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "l.jsonl")]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "log_write_failed"


def test_library_event_log_never_raises_for_a_failed_write(tmp_path, monkeypatch):
    """The library default: a failing write turns the file off and is recorded, emit goes on."""
    import pipeline.core.eventlog

    real = pipeline.core.eventlog.open_regular
    monkeypatch.setattr(pipeline.core.eventlog, "open_regular", lambda *a, **k: _FillsUp(real(*a, **k), ok=1))
    log = pipeline.core.eventlog.EventLog("r", 0, tmp_path / "l.jsonl")
    for _ in range(3):
        log.emit(ev.StepSkipped, state="resolve", what="x", reason="y")
    assert len(log.records) == 3 and log.write_error.info.code == "log_write_failed"
    assert len(read_trace(tmp_path / "l.jsonl").runs[0].records) == 1


def test_library_log_file_errors_are_typed(tmp_path):
    """EventLog (the library's log_file): a directory or a device is a UsageError, never an OSError."""
    from pipeline.core.errors import UsageError
    from pipeline.core.eventlog import EventLog

    for bad in (tmp_path, Path("/dev/full"), Path("/dev/null")):
        with pytest.raises(UsageError) as e:
            EventLog("r", 0, bad)
        assert e.value.info.code == "not_a_regular_file" and e.value.info.flags[0].name == "log_file"


def test_two_launches_sharing_run_id_and_file_stay_apart(tmp_path):
    """A refused launch and a later good one with the same run id, one file: two runs, each with its
    own launch_id; the failure of the first is never the second's."""
    from pipeline.core.eventlog import EventLog

    p = tmp_path / "shared.jsonl"
    a = EventLog("same", 0, p)
    a.emit(ev.RunFailed, state="args", outcome="failed",
           error=ErrorInfo(code="usage", state="args", message="refused", remedy="r"))
    a.close()
    b = EventLog("same", 0, p)
    b.emit(ev.RunStarted, state="device-init", request={})
    b.emit(ev.RunFinished, state="done", duration_ms=1.0)
    b.close()
    assert a.launch_id != b.launch_id
    t = read_trace(p)
    assert [(r.launch_id, r.status) for r in t.runs] == [(a.launch_id, "failed"), (b.launch_id, "ok")]


def _many_launches(path: Path, mb: int) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from inspect_large_log import build_log
    finally:
        sys.path.pop(0)
    return build_log(path, mb << 20)


class _Sink:
    """stdout that keeps only how much was written and how many runs it held (one ``last_state`` per run object: a
    run's ``launch_id`` also appears in its startup summary when it recorded one)."""

    def __init__(self) -> None:
        self.size = self.runs = 0

    def write(self, s: str) -> int:
        self.size += len(s)
        self.runs += s.count('"last_state":')
        return len(s)

    def flush(self) -> None:
        pass


def test_inspect_memory_is_bounded_by_a_run_not_the_file(tmp_path, capsys, monkeypatch):
    """Streaming: the Python heap at its peak while `inspect --json` reads an ~8 MB log of many
    launches is a small fraction of the file (an in-memory read holds several times the file)."""
    log = tmp_path / "many.jsonl"
    runs = _many_launches(log, 8)
    size = log.stat().st_size
    assert main(["inspect", str(ROOT / "tests/data/golden/ok_tbo.jsonl"), "--json"]) == 0  # imports done
    sink = _Sink()
    monkeypatch.setattr(sys, "stdout", sink)
    tracemalloc.start()
    try:
        code = main(["inspect", str(log), "--json"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 1 and sink.runs == runs and sink.size > size / 8
    assert peak < size / 4, (peak, size)  # ~1/9 measured: the index of 1,200 launches


def test_an_overlong_line_is_skipped_without_holding_it(tmp_path):
    """A line longer than MAX_LINE_BYTES (a log of zero bytes, say) is one skipped line, read past in
    chunks: the heap never holds it whole."""
    log = tmp_path / "zeros.jsonl"
    golden = (ROOT / "tests/data/golden/ok_tbo.jsonl").read_bytes()
    with open(log, "wb") as fh:
        fh.write(golden)
        for _ in range(8):
            fh.write(b"\0" * MAX_LINE_BYTES)
        fh.write(b"\n" + golden.splitlines()[0] + b"\n")
    tracemalloc.start()
    try:
        reader = TraceReader(log)
        runs = list(reader.runs())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [s.reason for s in reader.skipped] == ["line_too_long"] and len(runs) == 1
    assert peak < 3 * MAX_LINE_BYTES  # the line is 8 * MAX_LINE_BYTES long


def test_perfetto_into_a_fifo_is_refused(tmp_path, capsys):
    """--perfetto naming a FIFO would block until a reader came: exit 2 naming the flag, at once."""
    fifo = tmp_path / "p.fifo"
    os.mkfifo(fifo)
    code = main(["inspect", str(ROOT / "tests/data/golden/ok_tbo.jsonl"), "--json", "--perfetto", str(fifo)])
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and err["code"] == "not_a_regular_file" and err["flags"][0]["name"] == "--perfetto"


def test_a_bad_model_file_keeps_its_code_as_readme_now_says():
    """README's pipe paragraph said "a bad --model is still 2", but a --model that reads
    and is not JSON has always been ``model_config_malformed``, exit 3 (a refused configuration; a nested-bracket
    file is pinned at 3); only an unreadable one is 2. The code stays, README says which is which."""
    from conftest import ROOT, run_main, user_docs

    assert run_main("plan", "--model", str(ROOT / "examples/configs/README.md")).returncode == 3
    assert run_main("plan", "--model", str(ROOT / "no-such-config.json")).returncode == 2
    readme = " ".join(user_docs().split())
    assert "a bad `--model` is still 2" not in readme
    assert "a `--model` that cannot be read — `config_unreadable` — is still 2" in readme
    assert "`model_config_malformed`, e.g. not JSON — still 3" in readme
