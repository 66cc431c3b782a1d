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
