"""Two ranks under torchrun on CPU (gloo): one run id, agreement, and divergences caught on both ranks.

Each case launches ``tests/dist_worker.py`` with ``torch.distributed.run --standalone --nproc-per-node 2``
under a hard subprocess timeout, so a hang fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.contracts import DeviceFacts, ResolvedAttentionBackendStr, Resolution
from pipeline.setup.distributed import RankGroup, agree_on_resolution, check_rank_device, rank_device
from pipeline.core.errors import ConfigError
import socket

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
HARD_TIMEOUT_S = 120
EXCHANGE_TIMEOUT_S = 3.0
SCENARIOS = ["agree", "page_size", "backend", "absent"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """One 2-rank torchrun launch running every scenario in order (one process-group start for all)."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "EXCHANGE_TIMEOUT_S": str(EXCHANGE_TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), ",".join(SCENARIOS), str(out)], capture_output=True, text=True, env=env,
                          timeout=HARD_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def results(out: Path, sc: str) -> list[dict]:
    return [json.loads((out / f"result.{sc}.rank{r}.json").read_text()) for r in (0, 1)]


def trace(out: Path, sc: str, run_id: str, rank: int) -> list[ev.Event]:
    return [wire.decode_line(x) for x in (out / sc / f"{run_id}.rank{rank}.jsonl").read_bytes().splitlines()]


def test_ranks_agree_share_rank0_run_id_and_log_their_rank(launched):
    """No launcher run id: rank 0's fresh id is broadcast; both reach done and log resolution_agreed."""
    rs = results(launched, "agree")
    assert all(r["ok"] for r in rs), rs
    ids = {r["run_id"] for r in rs} | {r["group_run_id"] for r in rs}
    assert len(ids) == 1 and rs[0]["pid"] != rs[1]["pid"]
    run_id = ids.pop()
    for rank in (0, 1):
        records = trace(launched, "agree", run_id, rank)
        assert {r.rank for r in records} == {rank} and {r.run_id for r in records} == {run_id}
        agreed = [r for r in records if isinstance(r, ev.ResolutionAgreed)]
        assert len(agreed) == 1 and agreed[0].world_size == 2
        assert [(row.rank, row.device, row.prefill, row.decode) for row in agreed[0].table] == [
            (0, "cpu", "torch_native", "torch_native"), (1, "cpu", "torch_native", "torch_native")]
        assert isinstance(records[-1], ev.RunFinished)


def test_page_size_divergence_fails_both_ranks_with_the_table(launched):
    """Rank 1 with page_size 16: both ranks raise rank_divergence (exit 3) quickly, nothing built."""
    for r in results(launched, "page_size"):
        assert r["ok"] is False and r["type"] == "RankDivergence" and r["exit_code"] == 3
        assert r["seconds"] < EXCHANGE_TIMEOUT_S
        err = r["error"]
        flags = {f["name"]: f["value"] for f in err["flags"]}
        assert flags["diverging"] == ["args.page_size"]
        assert flags["args.page_size"] == {"0": 1, "1": 16}
        assert flags["rank[0]"]["device"] == "cpu" and flags["rank[1]"]["prefill"] == "torch_native"
        assert "rank 0: 1; rank 1: 16" in err["message"] and err["state"] == "resolve" and err["remedy"]
        records = trace(launched, "page_size", r["group_run_id"], r["rank"])
        assert not any(isinstance(x, (ev.BackendBuilt, ev.BuildPlanned)) for x in records)
        assert isinstance(records[-1], ev.RunFailed) and records[-1].error.code == "rank_divergence"


def test_one_rank_refused_fails_the_other_too(launched):
    """Rank 1 asks for triton on CPU: it raises its own capability_mismatch, rank 0 a divergence naming it."""
    r0, r1 = results(launched, "backend")
    assert r1["type"] == "CapabilityMismatch" and r1["exit_code"] == 3
    assert r0["type"] == "RankDivergence" and r0["exit_code"] == 3 and r0["seconds"] < EXCHANGE_TIMEOUT_S
    flags = {f["name"]: f["value"] for f in r0["error"]["flags"]}
    assert "resolve_error" in flags["diverging"] and flags["rank[1]"]["error"] == "capability_mismatch"
    assert "rank 1 refused: [capability_mismatch]" in r0["error"]["message"]


def test_absent_rank_times_out_instead_of_hanging(launched):
    """Rank 1 never joins: rank 0 raises rank_stalled (a rank_exchange_failed kind) after the timeout, naming rank 1."""
    r0, r1 = results(launched, "absent")
    assert r1.get("skipped") and r0["type"] == "RankStalled" and r0["exit_code"] == 1
    assert EXCHANGE_TIMEOUT_S * 0.9 < r0["seconds"] < EXCHANGE_TIMEOUT_S + 10
    flags = {f["name"]: f["value"] for f in r0["error"]["flags"]}
    assert flags["stalled_rank"] == 1 and "for rank 1:" in r0["error"]["message"]


def _facts(idx: int, kind: str = "cuda") -> DeviceFacts:
    return DeviceFacts(type=kind, index=idx, compute_capability=(9, 0) if kind == "cuda" else None, source="test")


def test_single_rank_passes_trivially():
    res = Resolution(pair=ResolvedAttentionBackendStr(prefill="triton", decode="triton"),
                     rules={"prefill": "auto", "decode": "auto"})
    rows = agree_on_resolution(res, _facts(3), group=None, rank=0, world_size=1, host="h")
    assert [(r.rank, r.host, r.device, r.prefill) for r in rows] == [(0, "h", "cuda:3", "triton")]


@pytest.mark.parametrize("device,local,want", [("cuda", 3, "cuda:3"), ("cuda:5", 3, "cuda:5"), ("cpu", 2, "cpu"),
                                               ("npu", 1, "npu:1"), ("auto", 2, "cpu")])
def test_rank_device_takes_local_rank(device, local, want):
    assert rank_device(device, local, cuda_available=False) == want


def test_rank_device_auto_on_gpu():
    assert rank_device("auto", 1, cuda_available=True) == "cuda:1"


@pytest.mark.parametrize("device,ok", [("cuda:1", True), ("cuda", False), ("cuda:0", False)])
def test_device_zero_by_accident_is_refused(device, ok):
    """Rank 1 (LOCAL_RANK 1) must initialise cuda:1; a bare 'cuda' or 'cuda:0' is refused before device-init."""
    g = RankGroup(rank=1, world_size=2, local_rank=1, cpu_group=None, run_id="r", device="cuda:1")
    if ok:
        check_rank_device(device, "cuda", g, rank=1, world_size=2)
        return
    with pytest.raises(ConfigError) as ei:
        check_rank_device(device, "cuda", g, rank=1, world_size=2)
    assert ei.value.info.code == "rank_device_mismatch" and ei.value.info.allowed == ["cuda:1"]
    assert ("device", device) in [(f.name, f.value) for f in ei.value.info.flags]


def test_request_rank_must_match_group():
    g = RankGroup(rank=1, world_size=2, local_rank=1, cpu_group=None, run_id="r", device="cpu")
    with pytest.raises(ConfigError) as ei:
        check_rank_device("cpu", "cpu", g, rank=0, world_size=2)
    assert ei.value.info.code == "rank_mismatch" and ei.value.info.allowed == ["1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_timeout_writes_the_log_and_the_failure_layout(tmp_path, monkeypatch):
    from conftest import run_main

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    for k in ("TORCHELASTIC_RUN_ID", "ATTN_SETUP_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    log = tmp_path / "x" / "d2.jsonl"
    proc = run_main("run", "--device", "cpu", "--dist-timeout", "1", "--log-file", str(log))
    assert proc.returncode == 1, proc.stderr
    err_lines, out_lines = proc.stderr.splitlines(), proc.stdout.splitlines()
    assert err_lines[0].startswith("attn-setup run failed (exit 1) in state init-distributed: rank_exchange_failed:")
    assert any(line.startswith("error [rank_exchange_failed] in state init-distributed") for line in err_lines)
    out_words = " ".join(proc.stdout.split())  # a long log path goes on its own line
    assert f"log: {log}" in out_words and out_lines[-1] == "failed"
    records = [wire.decode_line(line) for line in log.read_bytes().splitlines()]
    assert isinstance(records[0], ev.CommandStarted)
    failed = [r for r in records if isinstance(r, ev.RunFailed)]
    assert [(r.state, r.error.code) for r in failed] == [("init-distributed", "rank_exchange_failed")]
    assert isinstance(records[-2], ev.StartupSummary) and isinstance(records[-1], ev.CommandFinished)
    assert records[-1].exit_code == 1 and all(r.rank == 0 for r in records)
    rendezvous = [p for p in records[-2].phases if p.name == "rendezvous"]
    assert [(p.parent, p.detail) for p in rendezvous] == [("startup", "failed: rank_exchange_failed")]
    assert rendezvous[0].seconds >= 0.9  # the wait is named, not hidden in "interpreter, imports, arguments"
    # inspect now has the run: failed in init-distributed with the code
    got = run_main("inspect", str(log), "--json")
    assert got.returncode == 1
    assert "rank_exchange_failed" in got.stdout and "init-distributed" in got.stdout
    json.loads(got.stdout)
