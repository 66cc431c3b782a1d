"""New-user trial #8 (s9cli): ``-v`` after any subcommand gets the tailored refusal, an unknown flag on a subcommand
with LOG arguments is named with its value, ``run`` and ``inspect`` print one device line, and README's samples are
what the commands print."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from pipeline.cli import main

GOLDEN = ROOT / "tests" / "data" / "golden"
LOG = str(GOLDEN / "ok_default.jsonl")


@pytest.mark.parametrize("argv", [
    ["inspect", "-v", LOG], ["inspect", LOG, "-v"], ["replay", "-v", LOG], ["backends", "-v"],
    ["graph", "-v", LOG], ["backends", "--verbose"],
])
def test_verbose_after_the_subcommand_is_refused_with_its_reason(capsys, argv):
    """``inspect -v LOG``, ``replay -v LOG``, ``backends -v``, ``graph -v LOG --json``: exit 2 with the same refusal
    as ``attn-setup -v inspect`` (why the command has no events, ``attn-setup run -v``), not argparse's
    ``unrecognized arguments: -v``."""
    command = argv[0]
    assert main([*argv, "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert "unrecognized" not in err["message"], err
    assert f"'attn-setup {command}' has none" in err["message"] and err["flags"] == [{"name": "-v", "value": True}]
    assert "drop -v" in err["remedy"] and f"see 'attn-setup {command} --help'" in err["remedy"]
    assert main(argv) == 2 and f"'attn-setup {command}' has none" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("argv", [
    ["inspect", "--json", "--device", "cpu", LOG], ["inspect", LOG, "--device", "cpu", "--json"],
    ["replay", "--device", "cpu", LOG, "--json"], ["graph", LOG, "--device", "cpu", "--json"],
])
def test_an_unknown_flag_is_named_with_the_value_that_followed_it(capsys, argv):
    """argparse took ``cpu`` for a LOG; the error still names ``--device`` with ``cpu`` (as ``plan --device cpu``
    does) and says which subcommands have ``--device``."""
    assert main(argv) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"] == [{"name": "--device", "value": "cpu"}], err
    assert err["message"].endswith("unrecognized arguments: --device cpu"), err["message"]
    assert f"--device is a flag of attn-setup run and attn-setup warmup, not of attn-setup {argv[0]}" in err["remedy"]


def test_an_unknown_switch_before_a_flag_has_no_value(capsys):
    """The word after an unknown flag is its value only when it is not a flag itself."""
    assert main(["inspect", LOG, "--strict", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"] == [{"name": "--strict", "value": ""}] and err["message"].endswith("arguments: --strict")
    assert main(["plan", "--device", "cpu", "--json"]) == 2  # plan's form is unchanged
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["flags"] == [{"name": "--device", "value": "cpu"}] and "did you mean --device-profile" in err["remedy"]


def _device_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("device: ")]


def test_run_and_inspect_print_one_device_line(capsys, tmp_path):
    """``run`` and ``inspect`` of its log print the same ``device:`` line (it was ``device: cpu x86_64`` against
    ``device: cpu:0 x86_64 blas_init=False``); a GPU trace reads as README's ``device: cuda:0 NVIDIA H200 (sm90)``."""
    log = tmp_path / "l.jsonl"
    assert main(["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "0", "--no-progress",
                 "--log-file", str(log)]) == 0
    ran = _device_lines(capsys.readouterr().out)
    assert main(["inspect", str(log)]) == 0
    seen = _device_lines(capsys.readouterr().out)
    assert len(ran) == 1 and ran == seen and "blas_init" not in ran[0], (ran, seen)
    assert main(["inspect", str(GOLDEN / "h200_fa3.jsonl")]) == 0
    assert _device_lines(capsys.readouterr().out) == ["device: cuda:0 NVIDIA H200 (sm90)"]


def test_readme_shows_the_summary_as_run_and_as_inspect_print_it():
    """README's startup-summary samples: ``run``'s table (its title and box) and ``inspect``'s plain text."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Startup accounting", 1)[1].split("\n## ", 1)[0]
    assert "startup summary (seconds; children indented under their phase)\n┏" in section
    assert "\n  startup summary (seconds):\n    startup " in section
    assert "a first run in a fresh environment, where Python compiles" not in section
    assert "--no-compile" in section and "PYTHONDONTWRITEBYTECODE" in section


def test_a_cold_torch_import_is_named_only_without_cached_bytecode(tmp_path):
    """An empty ``PYTHONPYCACHEPREFIX`` (no bytecode cached for torch) is a cold import, named with its causes;
    the next import in the same environment reads the cache Python wrote."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"), PYTHONPATH=str(ROOT))
    code = "import json; from pipeline.observe.startup import timed_torch_import as t; print(json.dumps(t()))"
    first, second = (json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                               text=True, check=True, timeout=300).stdout) for _ in range(2))
    assert first["cold"] and "--no-compile" in first["detail"] and "compiled" in first["detail"], first
    assert not second["cold"] and second["detail"] == "cached bytecode", second
