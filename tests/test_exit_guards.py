"""Adversarial-tester findings (issue t6io), each fixed and pinned here, in-process: signals ignored at start stay
ignored and a logged interruption always ends with 130; outputs never overwrite inputs or each other; exit codes do
not depend on the terminal's encoding or on ``COLUMNS``; the run header escapes the config's text; the library
refuses what the CLI refuses."""

from __future__ import annotations

import io
import json
import os
import signal
import sys

import pytest

from conftest import CONFIGS, ROOT
from pipeline.cli import main
from plan_remedies import plan

OK_LOG = ROOT / "tests" / "data" / "bad_inputs" / "traces" / "cli_run_ok.jsonl"
RUN = ["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1"]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _signal_at_initialize(monkeypatch) -> None:
    """SIGINT delivered to this process as the runner starts initializing."""
    from pipeline.runtime.runner import Runner

    real = Runner.initialize

    def initialize(self, *a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(self, *a, **kw)

    monkeypatch.setattr(Runner, "initialize", initialize)


@pytest.fixture
def sigint():
    """Restore SIGINT's handler after the test."""
    prev = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, prev)


def test_sigint_ignored_at_start_stays_ignored(monkeypatch, tmp_path, capsys, sigint):
    """A background job inherits SIGINT ignored: the run ignores it too, logs nothing of it and succeeds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _signal_at_initialize(monkeypatch)
    log = tmp_path / "l.jsonl"
    assert main([*RUN, "--json", "--log-file", str(log)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    events = [r["event"] for r in _records(log)]
    assert "run_interrupted" not in events and _records(log)[-1]["exit_code"] == 0
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_logged_interruption_always_ends_130(monkeypatch, tmp_path, capsys, sigint):
    """A previous SIGINT handler that returns: run_interrupted is logged, so the run stops with 130, ok false."""
    signal.signal(signal.SIGINT, lambda *_: None)
    _signal_at_initialize(monkeypatch)
    log = tmp_path / "l.jsonl"
    assert main([*RUN, "--json", "--log-file", str(log)]) == 130
    assert json.loads(capsys.readouterr().out)["ok"] is False
    recs = _records(log)
    assert "run_interrupted" in [r["event"] for r in recs] and recs[-1]["exit_code"] == 130


def test_interrupted_record_overrides_a_zero_exit():
    """_close_run's last word: a signal's run_interrupted in the log turns any other exit into 130."""
    from pipeline.cli.run import _interrupted_ends
    from pipeline.core import events as ev
    from pipeline.core.contracts import ErrorInfo
    from pipeline.core.eventlog import EventLog

    log = EventLog("r", 0, None)
    info = ErrorInfo(code="interrupted", state="ready", message="received SIGINT", remedy="run it again")
    log.emit(ev.RunInterrupted, state="ready", outcome="failed", reason="signal", signal="SIGINT", error=info)
    assert _interrupted_ends(log, None, 0) == (info, 130)


@pytest.mark.parametrize("argv", [
    ["inspect", "{log}", "--perfetto", "{log}"], ["graph", "{log}", "-o", "{log}"],
    ["inspect", "{log}", "--perfetto", "{link}"], ["replay", "{log}", "{log}"],
])
def test_outputs_never_overwrite_inputs(tmp_path, capsys, argv):
    """An output naming an input (the same path, or a hard link to it) is exit 2 naming both; nothing written."""
    log, link = tmp_path / "x.jsonl", tmp_path / "link.jsonl"
    log.write_bytes(OK_LOG.read_bytes())
    os.link(log, link)
    code = main([a.format(log=log, link=link) for a in argv] + ["--json"])
    assert log.read_bytes() == OK_LOG.read_bytes()
    if argv[0] == "replay":  # two inputs, no output: allowed
        assert code in (0, 1)
        return
    err = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and err["code"] == "path_conflict" and {f["name"] for f in err["flags"]} >= {"LOG"}


def _ascii_streams(monkeypatch) -> tuple[io.BytesIO, io.BytesIO]:
    out, err = io.BytesIO(), io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="ascii", write_through=True))
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(err, encoding="ascii", write_through=True))
    return out, err


@pytest.mark.parametrize("extra, want", [([], 0), (["--attention-backend", "triton"], 3)])
def test_ascii_terminal_keeps_exit_codes(monkeypatch, tmp_path, extra, want):
    """On an ASCII stdout, run (ok or refused) and inspect keep their exit codes; the glyphs degrade."""
    out, err = _ascii_streams(monkeypatch)
    log = tmp_path / "l.jsonl"
    assert main([*RUN, "--log-file", str(log), *extra]) == want
    text = out.getvalue().decode("ascii") + err.getvalue().decode("ascii")
    assert "internal_error" not in text and ("startup summary" in text if want == 0 else "exit 3" in text)
    assert main(["inspect", str(OK_LOG)]) == 0


@pytest.mark.parametrize("cols", ["0", "-5", "wide"])
@pytest.mark.parametrize("argv, want", [(["backends"], 0), (["plan", "--device-profile", "cpu"], 0),
                                        ([*RUN[:3], "--attention-backend", "triton"], 3)])
def test_unusable_columns_counts_as_unset(monkeypatch, tmp_path, capsys, cols, argv, want):
    """COLUMNS=0, negative or not a number: human output at the terminal's width (else 80), never empty."""
    monkeypatch.setenv("COLUMNS", cols)
    extra = ["--log-file", str(tmp_path / "l.jsonl")] if argv[0] == "run" else []
    assert main([*argv, *extra]) == want
    cap = capsys.readouterr()
    wrapped = [line for line in cap.out.splitlines() if " " in line.strip()]  # a path alone on its line never breaks
    assert len(cap.out) > 200 and max(len(line) for line in wrapped) <= 80


def test_run_header_escapes_model_type(tmp_path, capsys):
    """A terminal escape in the config's model_type is shown escaped, never raw: such a model_type is no
    architecture transformers knows, so run refuses it (unknown_architecture) and names it escaped."""
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg["model_type"] = "llama\x1b[31m"
    model = tmp_path / "m.json"
    model.write_text(json.dumps(cfg))
    assert main([*RUN, "--model", str(model), "--log-file", str(tmp_path / "l.jsonl")]) == 3
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert "\x1b" not in text and "unknown_architecture" in text and "llama\\x1b[31m" in text


def test_library_refuses_draft_backend_without_draft_worker(llama):
    """SetupRequest with speculative_draft_attention_backend but no is_draft_worker: ConfigError naming both."""
    from pipeline import AttentionArgs, SetupRequest
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        SetupRequest(model=llama, args=AttentionArgs(speculative_draft_attention_backend="torch_native"))
    names = [f.name for f in e.value.info.flags]
    assert names == ["speculative_draft_attention_backend", "is_draft_worker"] and e.value.exit_code == 3
    for kw in ({"is_draft_worker": True}, {}):  # a draft worker; a speculative server's target worker (shared args)
        algo = {} if kw else {"speculative_algorithm": "EAGLE"}
        SetupRequest(model=llama, **kw, args=AttentionArgs(speculative_draft_attention_backend="torch_native", **algo))


def test_library_rank_remedy_names_the_range(llama):
    """rank=-1: the remedy says the range [0, world_size), not only 'below world_size'."""
    from pipeline import SetupRequest
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        SetupRequest(model=llama, rank=-1, world_size=2)
    assert "[0, world_size)" in e.value.info.remedy and "0..1" in e.value.info.remedy


def test_an_internal_error_of_plan_names_no_log(monkeypatch):
    """plan writes no log: its internal_error remedy says so (it said "the log holds the full event"), and a
    MemoryError says the process ran out of memory."""
    import pipeline.cli.plan as plan_cli

    def boom(ns):
        raise MemoryError()

    monkeypatch.setattr(plan_cli, "_decide", boom)
    rc, out = plan([])
    err = out["error"]
    assert rc == 1 and err["code"] == "internal_error" and err["message"] == "MemoryError: ", err
    assert err["remedy"].startswith("the process ran out of host memory") and "log" not in err["remedy"]

    def bug(ns):
        raise RuntimeError("x")

    monkeypatch.setattr(plan_cli, "_decide", bug)
    rc, out = plan([])
    assert rc == 1 and out["error"]["remedy"] == ("This is a bug or an environment failure (no log holds it); "
                                                 "report it with the command line")


@pytest.mark.parametrize("logged", [True, False])
def test_error_info_from_points_at_the_log_only_when_logged(logged):
    """run's failures (written to its log) keep "the log holds the full event"."""
    from pipeline.core.errors import error_info_from

    info = error_info_from(ValueError("v"), "resolve", logged=logged)
    assert info.code == "internal_error" and ("the log holds the full event" in info.remedy) is logged


@pytest.mark.parametrize("where, phase", [("pipeline.runtime.verify.verify_built", "verification"),
                                          ("pipeline.runtime.model_steps.verify_model_steps", "model steps")])
def test_ctrl_c_while_verifying_names_the_phase(monkeypatch, tmp_path, capsys, sigint, where, phase):
    """A Ctrl-C during the checks after 'ready' is named by its phase in the message (headline, --json) and in the
    log's run_interrupted record, not only 'in state ready'."""
    import importlib

    mod_name, fn = where.rsplit(".", 1)
    mod = importlib.import_module(mod_name)
    real = getattr(mod, fn)

    def interrupted(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)

    monkeypatch.setattr(mod, fn, interrupted)
    log = tmp_path / "l.jsonl"
    assert main([*RUN, "--json", "--log-file", str(log)]) == 130
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "interrupted" and f" during {phase}" in err["message"], err
    (stop,) = [r for r in _records(log) if r["event"] == "run_interrupted"]
    assert f"during {phase}" in stop["error"]["message"]
    assert main([*RUN, "--log-file", str(tmp_path / "m.jsonl")]) == 130
    assert f"during {phase}" in " ".join(capsys.readouterr().err.split()[:30])
