"""FlashInfer workspace remedies are true at any ``--max-reqs``: never a size above the flag's own limit (2**48),
and every alternative a refusal suggests, applied, plans (adversarial trial: ``--max-reqs 2147483647`` on the
H200 profile suggested ``--flashinfer-workspace-size`` of at least 709184997009440, which exits 2)."""

from __future__ import annotations

import json
import random
import re

import pytest

from pipeline.cli import main
from pipeline.core.validation import MAX_BYTES

BASE = ["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer", "--json"]
_rng = random.Random(20261201)
MAX_REQS = sorted({1, 2, 7, 100, 1220, 5000, 65536, 10 ** 6, 10 ** 8, 2 ** 31 - 1}
                  | {int(2 ** _rng.uniform(0, 31)) for _ in range(12)})
SIZES = [None, "1", str(64 << 20)]  # the default 384 MiB, a size nothing fits, a small one
CHANGE = re.compile(r"(--[\w-]+)(?: \(or \w+\))?(?: to at least)? (\d+)")


def _plan(capsys, args: list[str]) -> tuple[int, dict]:
    code = main([*BASE, *args])
    return code, json.loads(capsys.readouterr().out)


def _alternatives(remedy: str) -> list[list[tuple[str, int]]]:
    """Each ``, or ``-separated alternative of a CLI remedy as (flag, value) changes."""
    return [[(f, int(v)) for f, v in CHANGE.findall(clause)] for clause in re.split(r",? or ", remedy)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("max_reqs", MAX_REQS)
def test_every_workspace_remedy_plans_when_applied(capsys, max_reqs, size):
    """A workspace_too_small refusal suggests only sizes the flag takes, and each alternative, applied, plans."""
    args = ["--max-reqs", str(max_reqs)] + ([] if size is None else ["--flashinfer-workspace-size", size])
    code, report = _plan(capsys, args)
    err = report.get("error")
    if code == 0 or err is None or err["code"] != "workspace_too_small":
        return
    alternatives = _alternatives(err["remedy"])
    assert alternatives and all(alternatives), err["remedy"]  # every alternative names a concrete change
    for changes in alternatives:
        assert all(v <= MAX_BYTES for f, v in changes if f == "--flashinfer-workspace-size"), err["remedy"]
        fixed = [*args] + [x for f, v in changes for x in (f, str(v))]
        assert _plan(capsys, fixed)[0] == 0, (fixed, err["remedy"])


def test_need_above_the_flag_limit_suggests_no_size(capsys):
    """The trial's case: the need (7.1e14 bytes) exceeds 2**48, so the remedy is the captured-batch change alone."""
    code, report = _plan(capsys, ["--max-reqs", str(2 ** 31 - 1)])
    err = report["error"]
    assert code != 0 and err["code"] == "workspace_too_small"
    assert "--flashinfer-workspace-size" not in err["remedy"] and "--cuda-graph-max-bs" in err["remedy"]
    assert str(MAX_BYTES) in err["message"]
