"""How outputs end: a log that fills up while the last records are written, a
metrics file or a perfetto timeline on a full disk or behind a symbolic link, a Ctrl-C while the run closes down or
in the exit handlers, a log whose last line was cut short, and a verdict on a 1-column terminal.

Faults are injected in process (a file object that refuses one record, ``os.replace`` failing for one path, a
SIGINT sent from inside the closing code) instead of mounting a full file system.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_json
from pipeline.cli import main
from pipeline.core import events as ev
from pipeline.observe.trace import read_trace
from pipeline.core.errors import UsageError
from pipeline.core.files import refuse_symlink

FAST = ["--num-layers", "1", "--decode-steps", "1"]


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines()]


@pytest.fixture
def sigint():
    """The test's SIGINT handler back after the test, whatever the run did to it."""
    prev = signal.getsignal(signal.SIGINT)
    yield prev
    signal.signal(signal.SIGINT, prev)


class _RefusesFrom:
    """A log file object whose writes fail with ENOSPC from the first record holding ``marker`` on (a disk that
    fills up just there)."""

    def __init__(self, fh, marker: bytes) -> None:
        self.fh, self.marker, self.full = fh, marker, False

    def write(self, data: bytes) -> int:
        self.full = self.full or self.marker in data
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def _fill_log_at(monkeypatch, marker: bytes) -> None:
    import pipeline.core.eventlog

    real = pipeline.core.eventlog.open_regular
    monkeypatch.setattr(pipeline.core.eventlog, "open_regular", lambda *a, **k: _RefusesFrom(real(*a, **k), marker))


def _fail_replace(monkeypatch, suffix: str) -> None:
    """``os.replace`` onto a path ending in ``suffix`` fails with ENOSPC (the rename of a temporary file on a full
    disk); every other rename is real."""
    real = os.replace

    def replace(src, dst, *a, **k):
        if str(dst).endswith(suffix):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)


# 1. the log fills up while startup_summary is written


def test_log_full_at_the_summary_is_exit_2_not_ok(tmp_path, capsys, monkeypatch):
    """The run's work succeeded, then the log stops taking writes at ``startup_summary``: exit 2 log_write_failed
    naming --log-file (it was exit 0 ``ok``), the summary still in the report (kept in memory), and every line that
    reached the file is a whole record."""
    _fill_log_at(monkeypatch, b'"event":"startup_summary"')
    log = tmp_path / "l.jsonl"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), *FAST])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["ok"] is False and out["error"]["code"] == "log_write_failed"
    assert out["error"]["flags"] == [{"name": "--log-file", "value": str(log)}]
    assert out["summary"]["wall_s"] > 0 and len(out["verified"]) > 0
    t = read_trace(log)
    events = [ev.event_name(type(r)) for r in t.runs[0].records]
    assert t.skipped_lines == 0 and events[-1] == "resources_released" and "startup_summary" not in events


def test_log_full_at_the_summary_human_verdict_is_failed(tmp_path, capsys, monkeypatch):
    _fill_log_at(monkeypatch, b'"event":"startup_summary"')
    code = main(["run", "--device", "cpu", "--log-file", str(tmp_path / "l.jsonl"), *FAST])
    out, err = capsys.readouterr()
    assert code == 2 and out.splitlines()[-1] == "failed" and "log_write_failed" in err


# 2. --metrics-file: a failed write, a symbolic link


def test_metrics_file_lost_on_an_ok_run_is_exit_2_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The metrics file cannot be written at the end (its rename fails: a full disk): an ok run exits 2
    output_write_failed naming --metrics-file, the log's command_finished says 2, and no temporary file is left."""
    _fail_replace(monkeypatch, "m.prom")
    log, prom = tmp_path / "l.jsonl", tmp_path / "m.prom"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), "--metrics-file", str(prom), *FAST])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["ok"] is False and out["error"]["code"] == "output_write_failed"
    assert out["error"]["flags"] == [{"name": "--metrics-file", "value": str(prom)}]
    assert sorted(os.listdir(tmp_path)) == ["l.jsonl"]
    recs = _records(log)
    assert recs[-2]["event"] == "startup_summary" and recs[-1]["exit_code"] == 2


def test_metrics_file_lost_on_a_failed_run_keeps_its_code(tmp_path, capsys, monkeypatch):
    """A refused run (exit 3) keeps its code; the lost metrics file is one stderr line and leaves nothing."""
    _fail_replace(monkeypatch, "m.prom")
    prom = tmp_path / "m.prom"
    code = main(["run", "--device", "cpu", "--attention-backend", "flashmla", "--log-file", str(tmp_path / "l.jsonl"),
                 "--metrics-file", str(prom)])
    err = capsys.readouterr().err
    assert code == 3 and "cannot write --metrics-file" in err and "No space left on device" in err
    assert sorted(os.listdir(tmp_path)) == ["l.jsonl"]


def test_replace_atomically_failing_mid_write_keeps_the_old_file(tmp_path, monkeypatch):
    """A write that fails half-way (ENOSPC from the data's write) leaves the file there unchanged and no
    temporary file beside it."""
    from pipeline.core import files

    target = tmp_path / "out"
    target.write_bytes(b"old")
    real = os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[:3])
            self.fh.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real(fd, *a, **k)))
    with pytest.raises(OSError) as e:
        files.replace_atomically(target, b"new content")
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC and target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out"]


def test_metrics_file_symlink_is_refused_and_left_a_link(tmp_path, capsys):
    """``--metrics-file LINK`` (``ln -s /proc/self/fd/1 mystdout``): refused before the run starts, exit 2
    ``output_is_symlink`` naming the flag and the target; the link stays a link (it was replaced by a file)."""
    link = tmp_path / "mystdout"
    link.symlink_to("/proc/self/fd/1")
    code = main(["run", "--device", "cpu", "--json", "--metrics-file", str(link), "--log-file",
                 str(tmp_path / "l.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"]["code"] == "output_is_symlink"
    assert out["error"]["flags"] == [{"name": "--metrics-file", "value": str(link)}]
    assert "(to '/proc/self/fd/1')" in out["error"]["message"]  # what the link says, not stdout's file
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1" and not (tmp_path / "l.jsonl").exists()


def test_write_metrics_refuses_a_symlink_made_after_the_check(tmp_path):
    """The library writer refuses a symbolic link too (one made between the flag check and the write)."""
    from pipeline.observe.metrics import write_metrics

    (tmp_path / "target").write_text("keep")
    (tmp_path / "m.prom").symlink_to(tmp_path / "target")
    with pytest.raises(OSError, match="symbolic link"):
        write_metrics(str(tmp_path / "m.prom"), None)
    assert (tmp_path / "m.prom").is_symlink() and (tmp_path / "target").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["m.prom", "target"]


# 3./4. Ctrl-C while the run closes down, and after it logged its exit code


def test_sigint_while_the_summary_is_written_still_ends_the_log(tmp_path, capsys, monkeypatch, sigint):
    """SIGINT right after ``resources_released``, while the summary is computed: the summary and the metrics file
    are still written whole, then ``run_interrupted``, exit 130 and ``command_finished`` 130 (the log lacked both
    records before); the caller's SIGINT handler is back afterwards."""
    import pipeline.cli.startup

    real = pipeline.cli.startup.finish_startup

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(pipeline.cli.startup, "finish_startup", interrupted)
    log, prom = tmp_path / "l.jsonl", tmp_path / "m.prom"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), "--metrics-file", str(prom), *FAST])
    out = json.loads(capsys.readouterr().out)
    events = [r["event"] for r in _records(log)]
    assert code == 130 and out["ok"] is False and out["error"]["code"] == "interrupted"
    assert events[-4:] == ["resources_released", "startup_summary", "run_interrupted", "command_finished"]
    assert _records(log)[-1]["exit_code"] == 130 and prom.read_text().endswith("# EOF\n")
    assert read_trace(log).runs[0].status == "failed"
    assert signal.getsignal(signal.SIGINT) is sigint


def test_ignored_sigint_while_the_summary_is_written_stays_ignored(tmp_path, capsys, monkeypatch, sigint):
    """A background job (SIGINT ignored since the start): a SIGINT while the summary is written changes nothing."""
    import pipeline.cli.startup

    real = pipeline.cli.startup.finish_startup

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    monkeypatch.setattr(pipeline.cli.startup, "finish_startup", interrupted)
    log = tmp_path / "l.jsonl"
    assert main(["run", "--device", "cpu", "--json", "--log-file", str(log), *FAST]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    events = [r["event"] for r in _records(log)]
    assert "run_interrupted" not in events and events[-2:] == ["startup_summary", "command_finished"]
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_sigint_after_command_finished_changes_nothing(tmp_path, capsys, monkeypatch, sigint):
    """Once ``command_finished`` is logged with 0, a Ctrl-C does not turn the exit into 130 (the log would then
    disagree with the process): the run exits 0 as logged."""
    import pipeline.cli.run

    real = pipeline.cli.run.finish_log

    def then_sigint(*a, **k):
        real(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(pipeline.cli.run, "finish_log", then_sigint)
    log = tmp_path / "l.jsonl"
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(log), *FAST])
    assert code == 0 and json.loads(capsys.readouterr().out)["ok"] is True
    assert _records(log)[-1]["event"] == "command_finished" and _records(log)[-1]["exit_code"] == 0
    assert signal.getsignal(signal.SIGINT) is sigint


def test_sigint_in_the_exit_handlers_is_ignored(tmp_path):
    """entry(): a Ctrl-C while the atexit handlers run (after the command is over) prints no traceback and keeps
    the command's exit code."""
    code = ("import atexit, os, signal, sys, time\n"
            "sys.argv = ['attn-setup', 'graph', '--json']\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
            "from pipeline.cli import entry\n"
            "entry()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr


# 5. appending to a log whose last line was cut short


def test_append_after_a_cut_line_starts_a_new_line(tmp_path):
    """A log whose last line has no newline (``head -c``, a full disk): the next launch's first record is a line of
    its own — the cut line is skipped as one corrupt line and every new record reads back."""
    from pipeline.core.eventlog import EventLog

    path = tmp_path / "partial.jsonl"
    path.write_bytes(b'{"schema_version":1,"event":"command_st')
    log = EventLog("r1", 0, path)
    log.emit(ev.StepSkipped, state="resolve", what="x", reason="y")
    log.emit(ev.StepSkipped, state="resolve", what="z", reason="w")
    log.close()
    lines = path.read_bytes().split(b"\n")
    assert lines[0] == b'{"schema_version":1,"event":"command_st' and lines[-1] == b"" and len(lines) == 4
    t = read_trace(path)
    assert t.skipped_lines == 1 and [r.what for r in t.runs[0].records] == ["x", "z"]
    EventLog("r2", 0, path).close()  # a whole last line: nothing added
    assert path.read_bytes().count(b"\n") == 3


def test_run_appended_to_a_cut_log_reads_back_whole(tmp_path, capsys):
    log = tmp_path / "partial.jsonl"
    log.write_bytes(b'{"event":"run_started","run_id":"x')
    assert main(["run", "--device", "cpu", "--log-file", str(log), *FAST]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(log)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped_lines"] == 1 and len(out["runs"]) == 1 and out["runs"][0]["status"] == "ok"
    t = read_trace(log)
    assert isinstance(t.runs[0].records[0], ev.CommandStarted) and t.runs[0].records[0].command == "run"


# 6. --perfetto on a full disk, behind a symbolic link


def _a_log(tmp_path: Path) -> Path:
    from pipeline.core.eventlog import EventLog

    path = tmp_path / "a.jsonl"
    with EventLog("r1", 0, path) as log:
        log.emit(ev.RunStarted, state="init", request={})
        log.emit(ev.RunFinished, state="done", duration_ms=1.0)
    return path


def test_perfetto_on_a_full_disk_keeps_the_previous_file(tmp_path, capsys, monkeypatch):
    """--perfetto whose write fails (its rename: a full disk): exit 2 naming the flag, the previous timeline left
    whole (it was truncated), no temporary file."""
    log = _a_log(tmp_path)
    capsys.readouterr()  # structlog's default printer, before any CLI configured it
    out = tmp_path / "t.json"
    out.write_text('{"traceEvents": []}')
    _fail_replace(monkeypatch, "t.json")
    code = main(["inspect", "--json", str(log), "--perfetto", str(out)])
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and err["flags"] == [{"name": "--perfetto", "value": str(out)}]
    assert "No space left on device" in err["message"]
    assert out.read_text() == '{"traceEvents": []}' and sorted(os.listdir(tmp_path)) == ["a.jsonl", "t.json"]


def test_perfetto_symlink_is_refused(tmp_path, capsys):
    log = _a_log(tmp_path)
    capsys.readouterr()
    (tmp_path / "target.json").write_text("keep")
    (tmp_path / "t.json").symlink_to(tmp_path / "target.json")
    code = main(["inspect", "--json", str(log), "--perfetto", str(tmp_path / "t.json")])
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and err["code"] == "output_is_symlink" and err["flags"][0]["name"] == "--perfetto"
    assert (tmp_path / "t.json").is_symlink() and (tmp_path / "target.json").read_text() == "keep"


# 7. the verdict on a narrow terminal


@pytest.mark.parametrize("cols", ["1", "5"])
def test_verdict_word_never_wraps(cols, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", cols)
    assert main(["plan"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok"
    assert main(["run", "--device", "cpu", "--attention-backend", "flashmla", "--log-file",
                 str(tmp_path / "l.jsonl")]) == 3
    assert capsys.readouterr().out.splitlines()[-1] == "failed"


# -- 2. a {run_id} --log-file is checked for path_conflict with the run id it gets -------------------------------
def test_a_run_id_log_file_over_the_model_config_is_a_path_conflict(tmp_path, monkeypatch):
    """The finding: ``ATTN_SETUP_RUN_ID=myrun … --model conf/myrun.json --log-file 'conf/{run_id}.json'`` was rc 0
    with 37 JSON lines appended to the config; now exit 2 ``path_conflict`` naming both flags, the config as it was."""
    from conftest import ROOT

    conf = tmp_path / "conf"
    conf.mkdir()
    model = conf / "myrun.json"
    model.write_bytes((ROOT / "examples/configs/llama-3.1-8b.json").read_bytes())
    before = model.read_bytes()
    monkeypatch.setenv("ATTN_SETUP_RUN_ID", "myrun")
    rc, out = run_json("run", "--model", str(model), "--log-file", str(conf / "{run_id}.json"))
    err = out["error"]
    assert rc == 2 and err["code"] == "path_conflict" and err["state"] == "args", err
    assert [f["name"] for f in err["flags"]] == ["--log-file", "--model"] and err["flags"][0]["value"] == str(model)
    assert err["remedy"] == "pass a different path to --log-file"
    assert model.read_bytes() == before and sorted(p.name for p in conf.iterdir()) == ["myrun.json"]


def test_a_run_id_log_file_over_the_metrics_file_is_a_path_conflict(tmp_path, monkeypatch):
    """``ATTN_SETUP_RUN_ID=m2 … --log-file 'conf/{run_id}.jsonl' --metrics-file conf/m2.jsonl``: the log was replaced
    by OpenMetrics text; now refused before anything is written."""
    monkeypatch.setenv("ATTN_SETUP_RUN_ID", "m2")
    rc, out = run_json("run", "--log-file", str(tmp_path / "{run_id}.jsonl"), "--metrics-file", str(tmp_path / "m2.jsonl"))
    err = out["error"]
    assert rc == 2 and err["code"] == "path_conflict", err
    assert [f["name"] for f in err["flags"]] == ["--log-file", "--metrics-file"]
    assert err["remedy"] == "pass a different path to --metrics-file" and list(tmp_path.iterdir()) == []


def test_a_run_id_known_only_when_the_run_starts_is_checked_before_the_log_opens(tmp_path, monkeypatch):
    """A run id not in the environment (a fresh one, a rank group's) is filled in as the run starts; the conflict
    check runs again then, before the log opens: nothing written, exit 2 ``path_conflict``."""
    import pipeline.core.eventlog as eventlog

    monkeypatch.delenv("ATTN_SETUP_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(eventlog, "new_run_id", lambda: "fresh")
    metrics = tmp_path / "fresh.rank0.jsonl"
    rc, out = run_json("run", "--log-file", str(tmp_path / "{run_id}.rank{rank}.jsonl"), "--metrics-file", str(metrics))
    err = out["error"]
    assert rc == 2 and err["code"] == "path_conflict", err
    assert err["flags"] == [{"name": "--log-file", "value": str(metrics)}, {"name": "--metrics-file",
                                                                           "value": str(metrics)}]
    assert list(tmp_path.iterdir()) == []


def test_a_relative_link_remedy_names_the_path_from_here_and_following_it_writes_the_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "target.prom").write_text("")
    os.symlink("target.prom", tmp_path / "d" / "rel.prom")
    with pytest.raises(UsageError) as e:
        refuse_symlink("d/rel.prom", flag="--metrics-file", what="--metrics-file")
    remedy = e.value.info.remedy
    assert "'d/target.prom'" in remedy, remedy
    refuse_symlink("d/target.prom", flag="--metrics-file", what="--metrics-file")   # the path it names is no link


def test_a_link_to_a_directory_is_not_offered_as_the_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "realdir").mkdir()
    os.symlink("realdir", tmp_path / "dlink")
    with pytest.raises(UsageError) as e:
        refuse_symlink("dlink", flag="--perfetto", what="--perfetto")
    assert "points to a directory" in e.value.info.remedy and "pass the link's target" not in e.value.info.remedy
