"""``inspect`` shows what ``run`` showed: the verification tables (each built instance, each model step against the
float64 reference) in text and their values in ``--json``; ``inspect --diff`` puts the cause first."""

from __future__ import annotations

import json

import pytest

from conftest import run_main

RUN = ["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1", "--json"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    log = tmp_path_factory.mktemp("v") / "ok.jsonl"
    p = run_main(*RUN, "--log-file", str(log))
    assert p.returncode == 0, p.stderr
    return log, json.loads(p.stdout)


def test_inspect_json_carries_runs_verification_values(ran):
    log, report = ran
    (got,) = json.loads(run_main("inspect", str(log), "--json").stdout)["runs"]
    keys = ("role", "backend", "max_rel_err", "tol", "passed")
    assert got["verified"] == [{k: v[k] for k in keys} for v in report["verified"]] != []
    assert got["model_steps"] == report["model_steps"] != []


def test_inspect_text_prints_runs_verification_tables(ran):
    log, report = ran
    text = run_main("inspect", str(log)).stdout
    lines = [" ".join(x.split()) for x in text.splitlines()]
    assert "verification vs float64 reference (max|out-ref|/max|ref|):" in lines
    for v in report["verified"]:
        assert f"{v['role']} {v['backend']} {v['max_rel_err']:.2e} 1e-02 yes" in lines
    assert any(x.startswith("attention stack steps vs float64 dense reference") for x in lines)
    for s in report["model_steps"]:
        assert f"{s['step']} {s['batch_size']} no {s['max_rel_err']:.2e} 1e-02 yes" in lines


def test_diff_puts_the_changed_input_and_bs_failure_first(ran, tmp_path, monkeypatch):
    """An ok run against one refused for one changed flag: the changed input is the diff's first line under the rank
    header, B's failure (code, message, remedy in flag words) right after it, the state table and the rest below."""
    log, _ = ran
    bad = tmp_path / "fail.jsonl"
    assert run_main(*RUN, "--attention-backend", "triton", "--log-file", str(bad)).returncode == 3
    monkeypatch.setenv("COLUMNS", "400")  # one line per entry
    lines = [" ".join(x.split()) for x in run_main("inspect", "--diff", str(log), str(bad)).stdout.splitlines()]
    start = next(i for i, x in enumerate(lines) if x.startswith("rank 0:"))
    assert lines[start + 1] == "changed input args.attention_backend: not set -> 'triton'", lines[:8]
    assert lines[start + 2].startswith("B failed in state 'resolve': [capability_mismatch] --attention-backend")
    assert any(x.startswith("remedy: set --attention-backend") for x in lines[start + 2:start + 4])
    assert lines.index(next(x for x in lines if x.startswith("state A ms"))) > start + 2
    d = json.loads(run_main("inspect", "--diff", str(log), str(bad), "--json").stdout)["diff"]
    (r,) = d["ranks"]
    assert r["failure_a"] is None and r["failure_b"]["code"] == "capability_mismatch"
    assert r["decisions"][0]["key"] == "args.attention_backend"

