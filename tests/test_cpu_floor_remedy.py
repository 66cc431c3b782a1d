"""On a CPU, a refused pool size or budget also names the small pool ``run``'s checks need (not only ~90 % of the
machine's shared memory), and that value then runs."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_main

RUN = ["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1", "--json"]


@pytest.mark.parametrize("flags", [["--mem-bytes", str(10 ** 14)], ["--mem-fraction", "1.0"],
                                   ["--num-token-slots", str(2 * 10 ** 9)]], ids=lambda f: f[0])
def test_a_cpu_memory_refusal_names_the_checks_floor_and_it_runs(tmp_path, flags):
    p = run_main(*RUN, *flags, "--log-file", str(tmp_path / "a.jsonl"))
    err = json.loads(p.stdout)["error"]
    assert p.returncode == 3 and err["code"] in ("invalid_value", "pool_exceeds_memory"), err
    m = re.search(r"need only --num-token-slots (\d+) or --mem-bytes (\d+)", err["remedy"])
    assert m, err["remedy"]
    slots, mem = m.groups()
    assert int(slots) < 1000 and int(mem) < 64 << 20  # small: not a share of the machine's memory
    for alone in (["--num-token-slots", slots], ["--mem-bytes", mem]):
        q = run_main(*RUN, *alone, "--log-file", str(tmp_path / f"{alone[0][2:]}.jsonl"))
        assert q.returncode == 0, q.stdout
