"""A write error on stdout or stderr other than a closed pipe fails the command (coreutils style): ``attn-setup plan
--json > /dev/full`` lost the report and exited 1 as an ``internal_error`` ("a bug"), a refused plan whose error
block met a full stderr exited 1 instead of its own 3, and ``run > /dev/full`` logged ``command_finished`` 0 for a
process that exited 1. Now: exit 2 ``output_write_failed``, named on stderr when stderr works; a failed command keeps
its own code; a closed pipe changes nothing (tests/test_closed_pipe.py, tests/test_cli_hardening.py); ``run``'s
``--log-file`` is complete, every line a record, its ``command_finished`` carrying the process's exit code.
"""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = str(ROOT / "tests" / "data" / "golden")
OK_PLAN = ["plan", "--device-profile", "cpu"]
REFUSED_PLAN = ["plan", "--device-profile", "cpu", "--attention-backend", "flashinfer"]


class _Full(io.StringIO):
    """A stream on a full disk: every write and flush fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("argv,full,code", [
    (OK_PLAN, "stdout", 2),
    ([*OK_PLAN, "--json"], "stdout", 2),
    (["backends", "--json"], "stdout", 2),
    (REFUSED_PLAN, "stderr", 3),                    # the refusal's error block is lost; its code stays 3
    (REFUSED_PLAN, "both", 3),
    ([*OK_PLAN, "--model", "/nonexistent/config.json", "--json"], "stdout", 2),   # its own usage error, 2
    (["inspect", GOLDEN + "/failed_unknown_backend.jsonl"], "stdout", 1),         # a failed run found: 1 wins
    (["replay", GOLDEN + "/h200_flashinfer.jsonl"], "stdout", 2),
])
def test_a_write_error_fails_an_ok_command_and_keeps_a_failures_code(argv, full, code, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", _Full() if full != "stderr" else io.StringIO())
    monkeypatch.setattr(sys, "stderr", _Full() if full != "stdout" else err)
    before = sys.stdout, sys.stderr
    assert main(argv) == code
    assert (sys.stdout, sys.stderr) == before   # restored for the caller
    if full == "stdout":  # stderr works: the lost output is named there, last
        text = " ".join(err.getvalue().split())
        assert text.startswith("error [output_write_failed] in state output: could not write to stdout (No space left "
                               "on device): the command's output there is incomplete") or code != 2, text
        assert "error [output_write_failed]" in text and "remedy: send stdout somewhere" in text


def _to_dev_full(*argv: str, stderr_too: bool = False) -> subprocess.CompletedProcess:
    with open("/dev/full", "w") as full:
        return subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], stdout=full,
                              stderr=full if stderr_too else subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_plan_into_dev_full_is_exit_2_naming_stdout():
    """``plan > /dev/full`` and ``plan --json > /dev/full``: exit 2, the error block on stderr naming stdout, where it
    pointed and why; with stderr full too, exit 2 all the same (nothing can say why)."""
    for argv in (OK_PLAN, [*OK_PLAN, "--json"]):
        proc = _to_dev_full(*argv)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error [output_write_failed] in state output: could not write to stdout")
        assert "stdout = '/dev/full'" in proc.stderr and "Traceback" not in proc.stderr
    assert _to_dev_full(*OK_PLAN, stderr_too=True).returncode == 2
    assert _to_dev_full(*REFUSED_PLAN, stderr_too=True).returncode == 3   # the refusal wins


def test_run_whose_report_is_lost_exits_2_and_logs_it(tmp_path, monkeypatch):
    """``run > /dev/full``: the run itself succeeds, the report is lost: exit 2, and the log is complete — every line a
    record, ``command_finished`` last, with the process's exit code 2 (it said 0 while the process exited 1). A
    refused run keeps its 3, in the log too."""
    from pipeline.observe.trace import read_trace

    for argv, code in ((["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "0"], 2),
                       (["run", "--device", "cpu", "--enable-pdmux", "--enable-two-batch-overlap"], 3)):
        log = tmp_path / f"{code}.jsonl"
        err = io.StringIO()
        monkeypatch.setattr(sys, "stdout", _Full())
        monkeypatch.setattr(sys, "stderr", err)
        assert main([*argv, "--log-file", str(log)]) == code
        records = [json.loads(line) for line in log.read_bytes().splitlines()]
        assert records[-1]["event"] == "command_finished" and records[-1]["exit_code"] == code
        assert [r["event"] for r in records].count("command_finished") == 1
        assert read_trace(log).skipped_lines == 0
        assert "error [output_write_failed]" in err.getvalue()
