"""Streams closed before the process starts (``attn-setup plan >&-``, ``2>&-``): Python then has no ``sys.stdout``.
Before: ``plan >&-`` was exit 1 ``internal_error`` ('NoneType' object has no attribute 'write'), ``plan --json >&-`` a
traceback, ``plan --model /nonexistent 2>&-`` exit 1 instead of 2, and ``run >&- 2>&-`` exited 1 while its log said 0
Now a closed descriptor is a stream every write to fails (EBADF), answered as any other
write error (``pipeline.cli.output``): an ok command whose output was lost is exit 2 ``output_write_failed``, a
failed command keeps its own code, and the log's ``command_finished`` carries the process's exit code. Real
processes: only a process started with a descriptor closed sees this.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OK = ["plan", "--device-profile", "cpu"]
REFUSED = ["plan", "--device-profile", "cpu", "--attention-backend", "flashinfer"]  # exit 3
MISSING = ["plan", "--device-profile", "cpu", "--model", "/nonexistent/config.json"]  # exit 2


def _run(argv, *, close=(), stdout=None, stderr=subprocess.PIPE):
    """``attn-setup ARGV`` with the descriptors in ``close`` closed before it starts."""
    def pre():
        for fd in close:
            os.close(fd)
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], stdout=stdout, stderr=stderr,
                          preexec_fn=pre, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("argv,code", [(OK, 2), (OK + ["--json"], 2), (REFUSED, 3), (REFUSED + ["--json"], 3),
                                       (MISSING + ["--json"], 2)])
def test_closed_stdout_is_a_lost_output_not_a_traceback(argv, code):
    p = _run(argv, close=(1,))
    err = p.stderr.decode()
    assert p.returncode == code, err
    assert "Traceback" not in err and "internal_error" not in err
    if code == 2 and argv[:3] == OK:   # an ok plan whose report was lost says so on stderr, naming the stream
        assert "output_write_failed" in err and "closed (descriptor 1)" in err


@pytest.mark.parametrize("argv,closed_code,both_code", [(OK, 0, 2), (REFUSED, 3, 3), (MISSING, 2, 2)])
def test_closed_stderr_or_both_keep_a_failures_code(argv, closed_code, both_code):
    """An ok plan writes nothing to stderr (0 with it closed); with stdout closed too its report is lost (2). A
    refusal keeps its code either way (``plan --model /nonexistent 2>&-`` was 1)."""
    assert _run(argv, close=(2,), stdout=subprocess.DEVNULL, stderr=None).returncode == closed_code
    assert _run(argv, close=(1, 2), stdout=None, stderr=None).returncode == both_code


def test_run_with_no_streams_ends_as_its_log_says(tmp_path):
    """``run >&- 2>&-``: its report is lost (exit 2), and the log — whole records only: the descriptors are /dev/null,
    so the log file cannot take number 1 or 2 — ends with ``command_finished`` carrying that same 2."""
    log = tmp_path / "run.jsonl"
    p = _run(["run", "--device", "cpu", "-v", "--num-layers", "1", "--decode-steps", "1", "--log-file", str(log)],
             close=(1, 2), stderr=None)
    records = [json.loads(line) for line in log.read_bytes().splitlines()]
    assert p.returncode == 2
    assert records[-1]["event"] == "command_finished" and records[-1]["exit_code"] == 2
    assert sum(r["event"] == "command_finished" for r in records) == 1
