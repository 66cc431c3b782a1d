"""A corpus of bad inputs (tests/data/bad_inputs/cases.json), each with its right outcome.

``run`` cases go through ``attn-setup run --json`` and must exit with README's code (2 usage /
unreadable or irregular file, 3 configuration refused, 130 interrupted), print one ErrorInfo with a
message and a remedy, and name the JSON path (config files) or the flag; cases that must succeed
(exit 0) say so, and where a case writes a log, what ``inspect`` must then say about it. Log cases
go through all four readers (inspect text and ``--json``, ``--perfetto``, replay, graph) with each
one's expected exit code and error code. Run in-process through ``pipeline.cli.main`` for speed.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import CONFIGS
from pipeline.cli import main

DATA = Path(__file__).resolve().parent / "data" / "bad_inputs"
GOLDEN = DATA.parent / "golden"
CASES = json.loads((DATA / "cases.json").read_text())["cases"]
RUN_CASES = [c for c in CASES if c.get("command", "run") == "run"]
READ_CASES = [c for c in CASES if c.get("command") == "read"]


def test_corpus_is_large_enough():
    assert len(CASES) >= 80 and len({c["name"] for c in CASES}) == len(CASES)
    assert {c.get("command", "run") for c in CASES} == {"run", "read"}
    files = {p.stem for p in DATA.glob("*.json")} - {"cases"}
    used = {c["name"] for c in CASES if any("{data}/" in a for a in c.get("argv", []))}
    assert files <= used, files - used
    logs = {p.name for p in (DATA / "traces").glob("*.jsonl")}
    used_logs = {Path(c["log"]).name for c in READ_CASES if c["log"].startswith("{data}/traces/")}
    assert logs <= used_logs, logs - used_logs


def _fmt(s: str, tmp_path: Path) -> str:
    return s.format(data=DATA, configs=CONFIGS, tmp=tmp_path, golden=GOLDEN)


def _setup(case: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in case.get("env", {}).items():
        monkeypatch.setenv(k, v)
    if case.get("setup") == "fifo":
        os.mkfifo(tmp_path / "fifo")
    point = case.get("interrupt")
    if point:  # a real SIGINT, delivered to this process at that point (as Ctrl-C would)
        import pipeline.build
        import pipeline.cli_run
        import pipeline.model

        def interrupting(target: object, name: str) -> None:
            real = getattr(target, name)

            def wrapper(*a, **k):
                signal.raise_signal(signal.SIGINT)
                return real(*a, **k)

            monkeypatch.setattr(target, name, wrapper)

        target = {"load-model": (pipeline.model, "AttentionStack"),
                  "npu-lazy-mem": (pipeline.build._Run, "npu_lazy_mem"),
                  "verification": (pipeline.cli_run, "_verify")}[point]
        interrupting(*target)


@pytest.mark.parametrize("case", RUN_CASES, ids=[c["name"] for c in RUN_CASES])
def test_bad_input(case, tmp_path, capsys, monkeypatch):
    _setup(case, tmp_path, monkeypatch)
    argv = [_fmt(a, tmp_path) for a in case["argv"]]
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"), *argv])
    out = json.loads(capsys.readouterr().out)
    err = out["error"]
    assert code == case["exit"], err
    if case["exit"] == 0:
        assert out["ok"] is True and err is None
    else:
        assert out["ok"] is False and err["message"] and err["remedy"]
    if case.get("code"):
        assert err["code"] == case["code"]
    if "json_path" in case:
        assert err["json_path"] == case["json_path"]
    if case.get("flag"):
        assert case["flag"] in [f["name"] for f in err["flags"]], err["flags"]
    logs = [p for p in tmp_path.glob("*.jsonl") if p.stat().st_size]
    if case["exit"] in (2, 3):
        assert not any(b'"backend_built"' in p.read_bytes() for p in logs)
    want = case.get("log")
    if want is not None:  # the log it wrote, read back
        assert len(logs) == 1
        got = main(["inspect", str(logs[0]), "--json"])
        report = json.loads(capsys.readouterr().out)
        assert got == want["inspect"] and report["skipped_lines"] == 0, report
        (run,) = report["runs"]
        assert run["status"] == want["status"]
        last = json.loads(logs[0].read_bytes().splitlines()[-1])
        assert last["event"] == "command_finished" and last["exit_code"] == case["exit"]
        if want.get("failure"):
            assert run["failure"]["code"] == want["failure"]


def _expect(spec: object) -> tuple[int, str | None]:
    return (spec, None) if isinstance(spec, int) else (spec[0], spec[1])


@pytest.mark.parametrize("case", READ_CASES, ids=[c["name"] for c in READ_CASES])
def test_bad_log(case, tmp_path, capsys, monkeypatch):
    """Every reader on the log: its exit code, and for an error its code (and the flag, when named)."""
    _setup(case, tmp_path, monkeypatch)
    log = _fmt(case["log"], tmp_path)
    calls = {"inspect": ["inspect", log, "--json"], "inspect_text": ["inspect", log],
             "perfetto": ["inspect", log, "--json", "--perfetto", str(tmp_path / "p.json")],
             "replay": ["replay", log, "--json"], "graph": ["graph", log, "-o", str(tmp_path / "g.mmd")]}
    assert set(case["expect"]) == set(calls), "every case names the outcome of every reader"
    for name, argv in calls.items():
        want, code = _expect(case["expect"][name])
        got = main(argv)
        cap = capsys.readouterr()
        assert got == want, (name, cap.out[-2000:], cap.err[-2000:])
        assert "internal_error" not in cap.out + cap.err and "Traceback" not in cap.err
        if "--json" in argv:
            obj = json.loads(cap.out)
            if code is not None:
                assert obj["error"]["code"] == code, (name, obj["error"])
                if case.get("flag"):
                    assert case["flag"] in [f["name"] for f in obj["error"]["flags"]]
            elif name == "inspect" and want in (0, 1):
                assert obj.get("skipped_lines", 0) == case.get("skipped_lines", 0)
                if "statuses" in case:
                    assert [r["status"] for r in obj["runs"]] == case["statuses"]
        if name == "perfetto" and want in (0, 1):
            assert isinstance(json.loads((tmp_path / "p.json").read_bytes())["traceEvents"], list)
