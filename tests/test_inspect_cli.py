"""attn-setup inspect / replay on ok, failed, incomplete, truncated and merged logs."""

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.testing import truncate_trace

GOLDEN = Path(__file__).parent / "data" / "golden"


def _raw(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def _inspect(capsys, *args):
    code = main(["inspect", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_ok_log(capsys):
    path = GOLDEN / "ok_tbo.jsonl"
    code, out = _inspect(capsys, path)
    assert code == 0 and out["skipped_lines"] == 0
    (run,) = out["runs"]
    moves = [r for r in _raw(path) if r["event"] == "state_transition"]
    assert run["ok"] and run["failure"] is None and run["rank"] == 0
    assert [s["state"] for s in run["states"]] == [m["from"] for m in moves] + ["done"]
    assert [s["duration_ms"] for s in run["states"][:-1]] == [m["duration_ms"] for m in moves]
    assert [s["outcome"] for s in run["states"]] == ["ok", "ok", "ok", "skipped", "ok", "ok"]
    assert all(a["start_ns"] <= b["start_ns"] for a, b in zip(run["states"], run["states"][1:]))
    plan = [r for r in _raw(path) if r["event"] == "build_planned"][0]
    assert run["decisions"]["plan"]["mode"] == "tbo" and run["decisions"]["plan"]["instances"] == plan["instances"]


def test_failed_log_explains(capsys):
    path = GOLDEN / "failed_pdmux_tbo.jsonl"
    code, out = _inspect(capsys, path)
    (run,) = out["runs"]
    rec = [r for r in _raw(path) if r["event"] == "run_failed"][0]["error"]
    assert code == 1 and not run["ok"] and run["failure"] == rec and rec["code"] == "conflicting_options"
    assert run["states"][-2:] == [{**run["states"][-2], "state": "resolve", "outcome": "failed"},
                                  {**run["states"][-1], "state": "failed", "outcome": "failed"}]
    assert main(["inspect", str(path)]) == 1
    text = capsys.readouterr().out
    assert "failed in state 'resolve': [conflicting_options]" in text
    assert "flag to change: enable_pdmux=True, enable_two_batch_overlap=True" in text
    assert "remedy: drop one of --enable-pdmux / --enable-two-batch-overlap" in text


def test_incomplete_and_truncated_log(capsys, tmp_path):
    src = GOLDEN / "ok_default.jsonl"
    raw = _raw(src)
    keep = next(i for i, r in enumerate(raw) if r["event"] == "backend_built")  # killed while building
    p = truncate_trace(src, tmp_path / "cut.jsonl", keep_lines=keep)
    code, out = _inspect(capsys, p)
    (run,) = out["runs"]
    assert code == 1 and out["skipped_lines"] == 1 and out["skipped"][0]["line"] == keep + 1
    assert run["status"] == "incomplete" and run["last_state"] == "build-mode" and run["failure"] is None
    assert run["states"][-1]["state"] == "build-mode" and run["states"][-1]["outcome"] == "incomplete"
    assert main(["inspect", str(p)]) == 1
    assert "incomplete: no done/failed record; last seen in state 'build-mode'" in capsys.readouterr().out


def test_corrupt_lines_counted(capsys, tmp_path):
    lines = (GOLDEN / "ok_default.jsonl").read_bytes().splitlines(keepends=True)
    p = tmp_path / "corrupt.jsonl"
    p.write_bytes(lines[0] + b"\x00\xffgarbage\n" + b"".join(lines[1:5]) + b'{"event": "nope"}\n' + b"".join(lines[5:]))
    code, out = _inspect(capsys, p)
    assert code == 0 and out["skipped_lines"] == 2 and out["runs"][0]["ok"]
    assert [s["reason"] for s in out["skipped"]] == ["not_json", "unknown_event"]


def test_merged_ranks(capsys):
    code, out = _inspect(capsys, GOLDEN / "tp2_rank1.jsonl", GOLDEN / "tp2_rank0.jsonl")
    assert code == 0 and sorted((r["run_id"], r["rank"]) for r in out["runs"]) == [("golden-tp2", 0), ("golden-tp2", 1)]
    assert out["rank_differences"] == []
    code, out = _inspect(capsys, GOLDEN / "tp2_mismatch_rank0.jsonl", GOLDEN / "tp2_mismatch_rank1.jsonl")
    assert code == 0 and out["rank_differences"] == [
        {"run_id": "golden-tp2-mismatch", "key": "args.page_size", "values": {"0": 1, "1": 16}}]
    main(["inspect", str(GOLDEN / "tp2_mismatch_rank0.jsonl"), str(GOLDEN / "tp2_mismatch_rank1.jsonl")])
    assert "ranks differ in run golden-tp2-mismatch: args.page_size: rank 0: 1, rank 1: 16" in capsys.readouterr().out


def test_one_failed_among_merged_exits_1(capsys):
    code, out = _inspect(capsys, GOLDEN / "ok_default.jsonl", GOLDEN / "failed_pdmux.jsonl")
    assert code == 1 and [r["ok"] for r in out["runs"]].count(False) == 1


@pytest.mark.parametrize("content", [None, b"", b"junk\n{\n"])
def test_nothing_readable_exits_2(capsys, tmp_path, content):
    p = tmp_path / "x.jsonl"
    if content is not None:
        p.write_bytes(content)
    assert main(["inspect", str(p), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "trace_unreadable"
    assert main(["replay", str(p)]) == 2


def test_replay_cli_exit_codes(capsys, monkeypatch, tmp_path):
    assert main(["replay", str(GOLDEN / "ok_default.jsonl")]) == 0
    assert "same (16 decisions checked)" in capsys.readouterr().out
    import states.device_init as di

    monkeypatch.setattr(di, "decide_blas", lambda t: True)
    assert main(["replay", str(GOLDEN / "ok_default.jsonl"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["divergence"] == {"state": "device-init", "field": "blas_init", "recorded": False, "now": True}
