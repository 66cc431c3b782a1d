"""Findings of new-user trial #1 that are not a corpus entry alone: remedies followed to success, file lists."""

from __future__ import annotations

import json
import re

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
