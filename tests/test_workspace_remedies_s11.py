"""s11: every alternative of the FlashInfer workspace remedy passes the whole plan — the pools and graphs too —
with ``--max-reqs`` 2**24 (req_to_token of 64 GiB at the default context length), in-process through the CLI's main;
and a graph top no H200 can hold is refused at once from the estimate's lower bound, not after estimating ~2M sizes.
(s12ws closed gap 2: with 2**24 rows and a 2**24 top the remedy named the need of top 8192 and that top, which
``plan`` then refused as ``pool_exceeds_memory``; tests/test_workspace_remedy_room_s12.py holds its own cases.)"""

from __future__ import annotations

import itertools
import time

import pytest

from plan_remedies import grid_argv, plan, refused_then_followed
from test_workspace_remedies import WS_CODES

HUGE = 2 ** 24
GRID = list(itertools.product((300, HUGE), (1000, 64 << 20, None), (None, 200, "max_reqs")))


@pytest.mark.parametrize("max_reqs,ws,top", GRID)
def test_every_alternative_plans_ok(max_reqs, ws, top, monkeypatch):
    refused_then_followed(grid_argv(max_reqs, ws, top), WS_CODES + ("pool_exceeds_memory",), monkeypatch)


def test_a_huge_top_is_refused_at_once(monkeypatch):
    """The workspace holds the need of a 2**24 top; the graphs' lower bound alone is far above the device."""
    argv = ["--max-reqs", str(HUGE), "--cuda-graph-max-bs", str(HUGE), "--flashinfer-workspace-size", "5540507547680"]
    t = time.monotonic()
    rc, out = plan(argv, monkeypatch)
    assert time.monotonic() - t < 30
    assert rc == 3 and out["error"]["code"] in ("workspace_exceeds_memory", "pool_exceeds_memory"), out["error"]
