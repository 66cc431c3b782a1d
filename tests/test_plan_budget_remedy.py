"""plan's remedy for a --mem-fraction / --mem-bytes budget too large names that flag, and following it plans."""

import re

import pytest

from pipeline.cli import main

BASE = ["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer"]


@pytest.mark.parametrize("flag,value", [("--mem-fraction", "0.95"), ("--mem-bytes", "140000000000")])
def test_budget_remedy_names_the_same_flag_and_then_plans(flag, value, capsys):
    assert main(BASE + [flag, value]) == 3
    err = " ".join(capsys.readouterr().err.split())
    assert "pool_exceeds_memory" in err and "--num-token-slots" not in err, err
    m = re.search(r"remedy: pass (--mem-[a-z]+) ([0-9.]+) or less", err)
    assert m and m.group(1) == flag, err
    assert float(m.group(2)) < float(value)
    assert main(BASE + [flag, m.group(2)]) == 0, capsys.readouterr()
