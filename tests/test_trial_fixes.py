"""Findings of new-user trial #1 that are not a corpus entry alone: remedies followed to success, file lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.cli import main


def _run(capsys, tmp_path, *argv):
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"), *argv])
    return code, json.loads(capsys.readouterr().out)


def test_page_size_remedy_is_enough_when_followed(capsys, tmp_path):
    """--page-size 4096 with the default slots: the remedy names every slot verification needs (24576 with the
    default 3 decode steps), and following it runs to ok — it asked for 8192, then 24576, before (item 5)."""
    code, out = _run(capsys, tmp_path, "--page-size", "4096", "--decode-steps", "1", "--num-layers", "1")
    assert code == 3 and out["error"]["code"] == "pool_budget_too_small"
    slots = re.search(r"--num-token-slots (\d+)", out["error"]["remedy"]).group(1)
    code, out = _run(capsys, tmp_path, "--page-size", "4096", "--decode-steps", "1", "--num-layers", "1",
                     "--num-token-slots", slots)
    assert code == 0 and out["ok"], out["error"]


GOOD = Path(__file__).parent / "data" / "bad_inputs" / "traces" / "cli_run_ok.jsonl"


def _reader(name, tmp_path, *logs):  # argv of a reader command over ``logs``
    out = tmp_path / "g.mmd"
    return {"inspect": ["inspect", "--json", *logs], "replay": ["replay", "--json", *logs],
            "graph": ["graph", "-o", str(out), *logs]}[name]


@pytest.mark.parametrize("command", ["inspect", "replay", "graph"])
@pytest.mark.parametrize("order", ["missing-last", "missing-first", "missing-alone"])
def test_a_missing_log_among_several_is_refused_naming_it(command, order, tmp_path, capsys):
    """`replay good nope` exited 0 without mentioning nope, `inspect good nope` exited 0: every named log must be
    readable, else exit 2 `trace_unreadable` naming it with the OS reason — as for a directory (item 6)."""
    nope = str(tmp_path / "nope.jsonl")
    logs = {"missing-last": [str(GOOD), nope], "missing-first": [nope, str(GOOD)], "missing-alone": [nope]}[order]
    assert main(_reader(command, tmp_path, *logs)) == 2
    text = capsys.readouterr()
    both = text.out + text.err
    assert "trace_unreadable" in both and "No such file or directory" in both and nope in both


@pytest.mark.parametrize("command", ["inspect", "replay", "graph"])
def test_readable_logs_still_read(command, tmp_path, capsys):
    assert main(_reader(command, tmp_path, str(GOOD), str(GOOD))) == 0
