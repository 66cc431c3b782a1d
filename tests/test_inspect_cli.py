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
    assert code == 1 and not run["ok"] and rec["code"] == "conflicting_options"
    assert run["failure"] == {**rec, "flags": [{"name": "--enable-pdmux", "value": True},  # run --json's words
                                               {"name": "--enable-two-batch-overlap", "value": True}],
                              "remedy": "drop one of --enable-pdmux / --enable-two-batch-overlap"}, run["failure"]
    assert run["states"][-2:] == [{**run["states"][-2], "state": "resolve", "outcome": "failed"},
                                  {**run["states"][-1], "state": "failed", "outcome": "failed"}]
    assert main(["inspect", str(path)]) == 1
    text = capsys.readouterr().out
    assert "failed in state 'resolve': [conflicting_options]" in text
    assert "flag to change: --enable-pdmux = on, --enable-two-batch-overlap = on" in text
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
    assert "same (19 decisions checked)" in capsys.readouterr().out
    import states.device_init as di

    monkeypatch.setattr(di, "decide_blas", lambda t: True)
    assert main(["replay", str(GOLDEN / "ok_default.jsonl"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["divergence"] == {"state": "device-init", "field": "blas_init", "recorded": False, "now": True}


def test_runner_failure_before_the_setup_machine(capsys, tmp_path, llama):
    """A runner that fails in init-memory-pool: the timeline shows the runner's states with their real
    outcomes (not one 'init-distributed failed' row), the setup machine is absent, Perfetto and graph agree."""
    from pipeline.core.contracts import DeviceFacts, PoolFacts, SetupRequest
    from pipeline.platforms.fake import FakePlatform
    from pipeline.runtime.runner import Runner, RunnerConfig

    log = tmp_path / "pool.jsonl"  # (attn-setup run refuses this budget in preflight; the Runner API meets it in the pool step)
    req = SetupRequest(model=llama, device="cpu", pool=PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=256))
    r = Runner(RunnerConfig(request=req, num_layers=1, mem_bytes=1000),
               platform=FakePlatform(DeviceFacts(type="cpu", name="cpu", source="test")))
    r.log.__init__(r.log.run_id, 0, log)
    with pytest.raises(Exception, match="cannot hold req_to_token"):
        r.initialize()
    r.log.close()
    capsys.readouterr()
    raw = _raw(log)
    moves = [r for r in raw if r["event"] == "runner_transition"]
    code, out = _inspect(capsys, log)
    (run,) = out["runs"]
    assert code == 1 and run["states"] == [] and run["last_state"] == "failed"
    assert [(s["state"], s["outcome"]) for s in run["runner_states"]] == [
        (m["from"], "failed" if m["to"] == "failed" else "ok") for m in moves] + [("failed", "failed")]
    assert [s["state"] for s in run["runner_states"]][:3] == ["init-distributed", "load-model", "init-memory-pool"]
    assert run["failure"]["state"] == "init-memory-pool"
    perf = tmp_path / "p.json"
    assert main(["inspect", str(log), "--perfetto", str(perf)]) == 1
    slices = [e for e in json.loads(perf.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"]) for e in slices] == [(s["state"], "runner_state") for s in run["runner_states"]]
    assert main(["graph", str(log), "-o", str(tmp_path / "g.mmd")]) == 0
    assert "never entered the setup machine" in capsys.readouterr().err


def test_runner_success_nests_the_setup_machine(capsys, tmp_path):
    log = tmp_path / "ok.jsonl"
    assert main(["run", "--device", "cpu", "--log-file", str(log)]) == 0
    capsys.readouterr()
    code, out = _inspect(capsys, log)
    (run,) = out["runs"]
    outer = [s["state"] for s in run["runner_states"]]
    assert code == 0 and outer[-1] == "ready" and "attention" in outer and run["last_state"] == "ready"
    att = run["runner_states"][outer.index("attention")]
    assert [s["state"] for s in run["states"]][-1] == "done"
    assert all(att["start_ns"] <= s["start_ns"] <= att["start_ns"] + att["duration_ms"] * 1e6 + 1e6 for s in run["states"])
    assert main(["inspect", str(log)]) == 0
    text = capsys.readouterr().out
    assert text.index("attention") < text.index("  device-init") < text.index("capture-cuda-graphs")


def test_ranks_of_one_launch_listed_in_rank_order(capsys):
    code, out = _inspect(capsys, GOLDEN / "tp2_rank1.jsonl", GOLDEN / "tp2_rank0.jsonl")
    ids = [(r["run_id"], r["rank"]) for r in out["runs"]]
    assert ids == sorted(ids, key=lambda x: (ids.index(next(i for i in ids if i[0] == x[0])), x[1]))
    assert [r["rank"] for r in out["runs"] if r["run_id"] == ids[0][0]] == [0, 1]


def test_runner_traces_cut_failed_split_or_doubled(capsys, tmp_path):
    """A runner trace cut before 'ready' is incomplete (exit 1); a failed model-step check is a failure;
    pieces in any file order merge by time; a line read twice counts once; skipped steps say so."""
    log = tmp_path / "ok.jsonl"
    assert main(["run", "--device", "cpu", "--log-file", str(log)]) == 0
    capsys.readouterr()
    lines = log.read_text().splitlines()
    ready = next(i for i, x in enumerate(lines) if json.loads(x).get("to") == "ready")  # the runner's last move
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:ready]) + "\n")
    code, out = _inspect(capsys, cut)
    assert code == 1 and out["runs"][0]["status"] == "incomplete"
    assert out["runs"][0]["runner_states"][-1]["outcome"] == "incomplete"
    bad = tmp_path / "bad.jsonl"
    i = next(i for i, x in enumerate(lines) if json.loads(x)["event"] == "model_step_verified")
    rec = json.loads(lines[i])
    rec["passed"] = False
    bad.write_text("\n".join(lines[:i] + [json.dumps(rec)] + lines[i + 1:]) + "\n")
    code, out = _inspect(capsys, bad)
    assert code == 1 and out["runs"][0]["failure"]["code"] == "verification_failed"
    assert rec["step"] in out["runs"][0]["failure"]["message"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:10]) + "\n")
    b.write_text("\n".join(lines[10:]) + "\n")
    code, whole = _inspect(capsys, log)
    code2, split = _inspect(capsys, b, a, log)  # out of order, and every line a second time
    assert code == code2 == 0 and split["runs"] == whole["runs"]
    outcome = {s["state"]: s["outcome"] for s in whole["runs"][0]["runner_states"]}
    assert outcome["capture-cuda-graphs"] == "skipped"  # CPU: as `attn-setup run --json` reports it
    perf = tmp_path / "p.json"
    assert main(["inspect", str(log), "--perfetto", str(perf)]) == 0
    capsys.readouterr()
    spans = [e for e in json.loads(perf.read_text())["traceEvents"] if e.get("cat") == "runner_state"]
    assert all(x["ts"] + x["dur"] <= y["ts"] + 1e-6 for x, y in zip(spans, spans[1:]))


GOOD = Path(__file__).parent / "data" / "bad_inputs" / "traces" / "cli_run_ok.jsonl"


def _reader(name, tmp_path, *logs):  # argv of a reader command over ``logs``
    out = tmp_path / "g.mmd"
    return {"inspect": ["inspect", "--json", *logs], "replay": ["replay", "--json", *logs],
            "graph": ["graph", "-o", str(out), *logs]}[name]


@pytest.mark.parametrize("command", ["inspect", "replay", "graph"])
@pytest.mark.parametrize("order", ["missing-last", "missing-first", "missing-alone"])
def test_a_missing_log_among_several_is_refused_naming_it(command, order, tmp_path, capsys):
    """`replay good nope` exited 0 without mentioning nope, `inspect good nope` exited 0: every named log must be
    readable, else exit 2 `trace_unreadable` naming it with the OS reason — as for a directory (item 6)."""
    nope = str(tmp_path / "nope.jsonl")
    logs = {"missing-last": [str(GOOD), nope], "missing-first": [nope, str(GOOD)], "missing-alone": [nope]}[order]
    assert main(_reader(command, tmp_path, *logs)) == 2
    text = capsys.readouterr()
    both = " ".join((text.out + text.err).split())  # the human error wraps at spaces to the console's width
    assert "trace_unreadable" in both and "No such file or directory" in both and nope in both


@pytest.mark.parametrize("command", ["inspect", "replay", "graph"])
def test_readable_logs_still_read(command, tmp_path, capsys):
    assert main(_reader(command, tmp_path, str(GOOD), str(GOOD))) == 0
