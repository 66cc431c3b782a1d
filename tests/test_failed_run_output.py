"""A failed ``attn-setup run`` on a terminal: the first line is the failure's headline — state, error
code, message, remedy — before the notices and tables; the full error still closes the output; the report names the
device the run was on. Both streams go to one buffer, as they do on a terminal."""

from __future__ import annotations

import io
import sys

import pytest

from pipeline.cli import main


def _run_one_stream(monkeypatch, tmp_path, *flags) -> tuple[int, list[str]]:
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    monkeypatch.setattr(sys, "stderr", buf)
    monkeypatch.setenv("COLUMNS", "400")  # one headline line, whatever the message's length
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1",
                 "--log-file", str(tmp_path / "run.jsonl"), *flags])
    return code, [line for line in buf.getvalue().splitlines() if line.strip()]


def test_the_first_line_is_the_failure(monkeypatch, tmp_path):
    """A refusal in resolve: line 1 names the exit code, the state, the error code, the message and the remedy;
    the notice (--world-size outside torchrun) and the tables come after it, the full error block last."""
    code, lines = _run_one_stream(monkeypatch, tmp_path, "--attention-backend", "triton", "--world-size", "2")
    assert code == 3
    first = lines[0]
    assert first.startswith("attn-setup run failed (exit 3) in state resolve: capability_mismatch: "), first
    assert "--attention-backend triton" in first and "remedy: set --attention-backend to one of: torch_native" in first
    notice = next(i for i, line in enumerate(lines) if line.startswith("notice: --world-size 2"))
    timeline = next(i for i, line in enumerate(lines) if line.startswith("timeline"))
    assert 0 < notice < timeline
    assert any(line.startswith("error [capability_mismatch] in state resolve") for line in lines[timeline:])


def test_the_report_names_the_device(monkeypatch, tmp_path):
    """Failed or not, the report prints the device it ran on (its facts from device-init)."""
    code, lines = _run_one_stream(monkeypatch, tmp_path, "--attention-backend", "triton")
    assert code == 3 and any(line.startswith("device: cpu ") for line in lines)
    code, lines = _run_one_stream(monkeypatch, tmp_path)
    assert code == 0 and any(line.startswith("device: cpu ") for line in lines)
    assert not any("run failed" in line for line in lines)  # a run that passed has no headline


def test_a_failure_before_device_init_names_the_requested_device(monkeypatch, tmp_path):
    """A run refused in its preflight (a pool too small, before device-init) prints the device it asked for."""
    code, lines = _run_one_stream(monkeypatch, tmp_path, "--mem-bytes", "1000")
    assert code == 3 and lines[0].startswith("attn-setup run failed (exit 3) in state ")
    assert "device: cpu requested (the run stopped before device-init read its facts)" in lines


@pytest.mark.parametrize("flags", [["--max-reqs", "0"], ["--mem-fraction", "nan"]])
def test_a_value_refused_as_the_flags_are_read_is_the_first_line(monkeypatch, tmp_path, flags):
    """An out-of-domain value is refused before the run starts: a failed run's headline from the first line, the
    log line saying none was written, the verdict and the error in full, as every failed run prints them."""
    code, lines = _run_one_stream(monkeypatch, tmp_path, *flags)
    assert code == 2 and lines[0].startswith(f"attn-setup run failed (exit 2) in state args: out_of_domain: {flags[0]} ")
    assert any(line.startswith("log: none: refused at its command line") for line in lines)
    assert "failed" in lines and any(line.startswith(f"error [out_of_domain] in state args: {flags[0]} ")
                                     for line in lines)
