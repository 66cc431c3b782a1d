"""A corpus of bad inputs (tests/data/bad_inputs/cases.json), each through ``attn-setup run --json``.

Every case must exit with README's code (2 usage/unreadable file, 3 configuration refused), print
one ErrorInfo with a message and a remedy, and name the JSON path (config files) or the flag.
Run in-process through ``pipeline.cli.main`` for speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CONFIGS
from pipeline.cli import main

DATA = Path(__file__).resolve().parent / "data" / "bad_inputs"
CASES = json.loads((DATA / "cases.json").read_text())["cases"]


def test_corpus_is_large_enough():
    assert len(CASES) >= 40 and len({c["name"] for c in CASES}) == len(CASES)
    files = {p.stem for p in DATA.glob("*.json")} - {"cases"}
    used = {c["name"] for c in CASES if any("{data}/" in a for a in c["argv"])}
    assert files <= used, files - used


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_input(case, tmp_path, capsys):
    argv = [a.format(data=DATA, configs=CONFIGS) for a in case["argv"]]
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"), *argv])
    out = json.loads(capsys.readouterr().out)
    err = out["error"]
    assert code == case["exit"], err
    assert out["ok"] is False and err["message"] and err["remedy"]
    if case.get("code"):
        assert err["code"] == case["code"]
    if "json_path" in case:
        assert err["json_path"] == case["json_path"]
    if case.get("flag"):
        assert case["flag"] in [f["name"] for f in err["flags"]], err["flags"]
    assert not any(p.stat().st_size and b'"backend_built"' in p.read_bytes() for p in tmp_path.glob("*.jsonl"))
