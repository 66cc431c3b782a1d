"""benchmarks/gpu_check.sh: the one GPU check script. Its parts, its usage line, its case arms and
benchmarks/README.md name the same parts; every script it calls exists; an unknown part exits 2."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _parts() -> tuple[list[str], list[str]]:
    text = SCRIPT.read_text()
    usage = re.search(r"usage: gpu_check.sh ([\w|-]+) OUTDIR", text).group(1).split("|")
    arms = re.findall(r"^  ([\w-]+)\)$", text, re.M)
    return usage, arms


def test_usage_arms_and_readme_agree():
    usage, arms = _parts()
    assert usage == arms and len(arms) >= 8
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for part in arms:
        assert f"`{part}`" in readme, part


def test_called_files_exist_and_old_scripts_are_gone():
    text = SCRIPT.read_text()
    for path in set(re.findall(r"(?:benchmarks|tests)/[\w/]+\.py", text)):
        assert (ROOT / path).exists(), path
    assert sorted(p.name for p in (ROOT / "benchmarks").glob("gpu_*.sh")) == ["gpu_check.sh"]


def test_unknown_part_exits_2(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT), "nope", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 2 and "unknown part 'nope'" in p.stderr
