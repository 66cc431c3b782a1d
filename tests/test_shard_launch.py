"""CPU launches over gloo: tp 2, pp 2 (2 ranks), tp 4 and tp 2 x pp 2 (4 ranks) of a tiny model, torch_native.

Each rank builds its shard and verifies it against float64 of its own heads and layers; the world check gathers
the TP ranks' outputs of a stage and compares them with the whole model's attention. A rank reading the wrong kv
head (``:swap``) must fail the world check of its stage while its own verification, blind to it, passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "dist_shard_worker.py"
TWO = ["tp2pp1", "tp1pp2", "tp2pp1:swap", "mla_tp2pp1"]
FOUR = ["tp4pp1", "tp2pp2"]


def _launch(out: Path, n: int, scenarios: list[str]) -> Path:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXCHANGE_TIMEOUT_S": "60"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           str(WORKER), ",".join(scenarios), str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[int, Path]:
    return {2: _launch(tmp_path_factory.mktemp("shard2"), 2, TWO), 4: _launch(tmp_path_factory.mktemp("shard4"), 4, FOUR)}


def _results(out: Path, sc: str, n: int) -> list[dict]:
    return [json.loads((out / f"result.{sc}.rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("n,sc,want", [
    (2, "tp2pp1", [(0, 0, 4, 1, 0, [0, 4]), (1, 0, 4, 1, 1, [0, 4])]),
    (2, "tp1pp2", [(0, 0, 8, 2, 0, [0, 2]), (0, 1, 8, 2, 0, [2, 4])]),
    (4, "tp4pp1", [(r, 0, 2, 1, r // 2, [0, 4]) for r in range(4)]),  # 2 kv heads over 4 ranks: replicated
    (4, "tp2pp2", [(0, 0, 4, 1, 0, [0, 2]), (1, 0, 4, 1, 1, [0, 2]), (0, 1, 4, 1, 0, [2, 4]), (1, 1, 4, 1, 1, [2, 4])]),
    (2, "mla_tp2pp1", [(0, 0, 2, 2, 0, [0, 2]), (1, 0, 2, 2, 2, [0, 2])]),  # un-absorbed kv heads split with q
])
def test_each_rank_builds_verifies_and_the_world_matches_the_whole_model(launched, n, sc, want):
    """(tp_rank, pp_rank, heads, kv heads, first kv head, layer range) per rank as sglang lays them out; every rank's
    own check and its stage's world check pass."""
    rs = _results(launched[n], sc, n)
    got = [(r["layout"]["tp_rank"], r["layout"]["pp_rank"], r["layout"]["num_heads"], r["layout"]["num_kv_heads"],
            r["layout"]["kv_head_start"], r["layout"]["layer_range"]) for r in rs]
    assert got == want
    for r in rs:
        lo, hi = r["layout"]["layer_range"]
        assert [(k["num_heads"], k["num_kv_heads"]) for k in r["kinds"]] == [
            (r["layout"]["num_heads"], 1 if sc.startswith("mla_") else r["layout"]["num_kv_heads"])]  # MLA: 1 latent
        assert sum(len(k["layer_ids"]) for k in r["kinds"]) == hi - lo
        assert r["own"] and all(v["passed"] for v in r["own"]), r["own"]
        w = r["world"]
        assert w["role"] == "world.tp" and w["passed"] and w["max_rel_err"] <= w["tol"], w


def test_a_rank_on_the_wrong_kv_head_fails_the_world_check(launched):
    rs = _results(launched[2], "tp2pp1:swap", 2)
    assert rs[1]["layout"]["kv_head_start"] == 0  # the last rank reads kv head 0 instead of 1
    assert all(v["passed"] for r in rs for v in r["own"])  # each shard alone is self-consistent
    for r in rs:
        assert not r["world"]["passed"] and r["world"]["max_rel_err"] > 10 * r["world"]["tol"], r["world"]
