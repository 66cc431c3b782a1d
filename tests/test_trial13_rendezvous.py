"""A rendezvous that times out ends as every failed start does (trial 13, finding 2).

``WORLD_SIZE=2 RANK=0 … attn-setup run --device cpu --dist-timeout 5 --log-file …`` with no rank 1 exited 1 with
only an ``error [rank_exchange_failed]`` block: no headline, no ``log:`` line, no verdict, and no log file (the
rendezvous ran before the log was opened), so ``inspect`` had nothing. It now opens the log after the failed
rendezvous and writes the failure record: the documented layout, exit 1, the same code.
"""

from __future__ import annotations

import json
import socket

from pipeline.core import events as ev
from pipeline.core import wire


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
    assert f"log: {log}" in out_lines and out_lines[-1] == "failed"
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
