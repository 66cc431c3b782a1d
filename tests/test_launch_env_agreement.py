"""``plan`` and ``run`` refuse the same torchrun variables with the same error (in-process; run is refused before it
starts anything, so no rendezvous is attempted)."""

from __future__ import annotations

import json

import pytest

from conftest import run_main

BAD = [{"WORLD_SIZE": "2", "RANK": "7", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
       {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29500"},
       {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "localhost"},
       {"WORLD_SIZE": "0"}, {"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "h", "MASTER_PORT": "1"}]


@pytest.mark.parametrize("env", BAD, ids=lambda e: " ".join(f"{k}={v}" for k, v in e.items()))
def test_plan_refuses_what_run_refuses(monkeypatch, env):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = run_main("run", "--device", "cpu", "--num-layers", "1", "--json")
    plan = run_main("plan", "--json")
    assert run.returncode == plan.returncode == 2, (run.stdout, plan.stdout)
    r, p = json.loads(run.stdout)["error"], json.loads(plan.stdout)["error"]
    assert (r["code"], r["message"], r["flags"]) == (p["code"], p["message"], p["flags"])
