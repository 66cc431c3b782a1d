"""A reader that leaves before the output ends (``attn-setup … 2>&1 | head -1``): stdout and stderr both meet a closed
pipe, and the exit code is still the command's own — 0 for a plan or run that succeeded, the refusal's code for one
that was refused (never 1 for the pipe, never 0 for a failure) — and ``run``'s log file is complete.

Real processes on a real pipe whose reading end is closed before the command starts, so every write meets EPIPE:
deterministic, unlike ``| head -1``, whose reader may or may not have left when the command writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _closed_pipe_run(*argv: str) -> int:
    """``attn-setup ARGV`` with stdout and stderr on one pipe nobody reads (``2>&1`` into a reader that left); its
    exit code."""
    r, w = os.pipe()
    os.close(r)  # the reader has left: every write by the command meets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], stdout=w, stderr=w, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(w)
    return proc.returncode


@pytest.mark.parametrize("argv,code", [
    (["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer"], 0),
    (["plan", "--device-profile", "cpu", "--attention-backend", "flashinfer"], 3),   # refused: 3, not the pipe's 1
    (["plan", "--device-profile", "cpu", "--model", "/nonexistent/config.json"], 2),
])
def test_plan_keeps_its_exit_code_when_stdout_and_stderr_meet_a_closed_pipe(argv, code):
    """``plan … 2>&1 | head -1`` exited 1 whenever the command wrote to stderr after the reader left (a refusal's
    error block): the refusal's own code was lost. Now the code is the command's, with or without a reader."""
    assert _closed_pipe_run(*argv) == code


def test_run_with_v_keeps_exit_0_and_a_complete_log_when_the_pipe_closes(tmp_path):
    """``run -v 2>&1 | head -1`` (every event a line on stderr) ended at the first event after the reader left: exit 1
    and a log without ``command_finished``. Now: exit 0 and the whole log, every line a valid record, ending with
    ``command_finished`` 0 — the log file is not the terminal's stream."""
    log = tmp_path / "run.jsonl"
    code = _closed_pipe_run("run", "--device", "cpu", "-v", "--num-layers", "1", "--decode-steps", "1",
                            "--log-file", str(log))
    records = [json.loads(line) for line in log.read_bytes().splitlines()]  # every line valid JSON
    events = [r["event"] for r in records]
    assert code == 0, events
    assert events[0] == "command_started" and "runner_ready" in events and "startup_summary" in events
    assert records[-1]["event"] == "command_finished" and records[-1]["exit_code"] == 0
    from pipeline.observe.trace import read_trace

    trace = read_trace(log)
    assert trace.skipped_lines == 0 and [run.status for run in trace.runs] == ["ok"]


class _ClosedPipe:
    """A stdout whose reader left after the first write (``| head -3``)."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        import io

        raise io.UnsupportedOperation("fileno")


def test_events_table_ends_quietly_when_the_reader_leaves(monkeypatch):
    """``python3 -m pipeline.core.events | head -3`` (README) ended in a BrokenPipeError traceback; it now
    ends quietly with 0, as the CLI's commands do."""
    import runpy
    import sys
    import warnings

    pipe = _ClosedPipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the module is already imported: runpy says so
        with pytest.raises(SystemExit) as ei:
            runpy.run_module("pipeline.core.events", run_name="__main__")
    assert ei.value.code == 0 and pipe.writes == 1
