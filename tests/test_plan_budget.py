"""``plan --mem-fraction`` / ``--mem-bytes`` size the KV pool as ``run`` does, against the device profile's memory,
and report it (``pool`` in --json, a ``KV pool:`` line)."""

from __future__ import annotations

import json

from conftest import run_main

H200 = ["--device-profile", "h200", "--installed", "torch,triton,flashinfer-python"]


def test_mem_fraction_is_taken_of_the_profiles_memory():
    out = json.loads(run_main("plan", *H200, "--mem-fraction", "0.8", "--json").stdout)
    p, est = out["pool"], out["cuda_graph_bytes_estimate"]
    total = out["device"]["total_memory_bytes"]
    assert p["source"] == "mem_fraction" and p["total_memory_bytes"] == total > 0
    budget = int(0.8 * total) - est  # sglang: the static share, the decode graphs' estimate out of it first
    assert p["budget_bytes"] == budget and p["graph_reserve_bytes"] == est > 0
    assert p["num_token_slots"] == (budget - p["req_to_token_bytes"]) // p["bytes_per_token"]
    text = " ".join(run_main("plan", *H200, "--mem-fraction", "0.8").stdout.split())
    assert f"KV pool: {p['num_token_slots']} token slots" in text and "from --mem-fraction 0.8 of the profile's" in text


def test_mem_bytes_sizes_the_pool_run_sizes(tmp_path):
    mem = str(64 << 20)
    p = json.loads(run_main("plan", "--mem-bytes", mem, "--json").stdout)["pool"]
    log = tmp_path / "l.jsonl"
    assert run_main("run", "--device", "cpu", "--mem-bytes", mem, "--decode-steps", "1", "--log-file",
                    str(log)).returncode == 0
    (sized,) = [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "memory_pool_sized"]
    assert (p["source"], p["num_token_slots"], p["kv_bytes"]) == ("bytes", sized["num_token_slots"], sized["kv_bytes"])


def test_a_budget_run_refuses_plan_refuses():
    err = json.loads(run_main("plan", *H200, "--mem-bytes", "1000", "--json").stdout)["error"]
    assert err["code"] == "pool_budget_too_small" and err["flags"][0]["name"] == "--mem-bytes"
    err = json.loads(run_main("plan", "--device-profile", "cpu", "--mem-fraction", "0.5", "--json").stdout)["error"]
    assert err["code"] == "invalid_value" and "--mem-bytes" in err["remedy"]


def test_two_pool_sizes_are_refused_not_one_dropped():
    """--num-token-slots with --mem-bytes / --mem-fraction: run took the slots and dropped the budget silently; both
    commands now refuse the pair naming both flags."""
    for budget in (["--mem-bytes", str(64 << 20)], ["--mem-fraction", "0.5"]):
        for cmd in (["run", "--device", "cpu"], ["plan"]):
            p = run_main(*cmd, "--num-token-slots", "256", *budget, "--json")
            err = json.loads(p.stdout)["error"]
            assert p.returncode == 2 and err["code"] == "out_of_domain", (cmd, budget, err)
            assert "--num-token-slots" in err["message"] and budget[0] in err["message"]
