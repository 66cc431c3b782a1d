"""The FlashInfer workspace remedy is true: for a grid of (max_reqs, workspace size, cuda_graph_max_bs) that
``attn-setup plan`` refuses with ``workspace_too_small``, every alternative the remedy names — with the flag values
it names — then plans ok, each value inside its flag's domain (in-process, through the CLI's main).

s10mem: ``plan`` counts req_to_token (``max_reqs x max_context_len x 4`` bytes) against the profile's memory, as
``run`` does, so the largest row count here is one whose pool fits the H200 (2**23 rows: 32 GiB of req_to_token,
beside the graphs of a 8192 top), not 2**31 - 1 (8 TiB, refused as ``pool_exceeds_memory``); and a 2**48-byte workspace is refused as
``workspace_exceeds_memory`` (above 90 % of the device), whose remedy is followed the same way."""

from __future__ import annotations

import itertools

import pytest

from pipeline.core.validation import MAX_BYTES
from plan_remedies import alternatives, follow_every_alternative, grid_argv, plan, refused_then_followed

MAX = 2 ** 31 - 1
BIG = 2 ** 23  # the most rows here: req_to_token of 32 GiB fits the H200 profile beside 8192-top graphs (s10mem)
WS_CODES = ("workspace_too_small", "workspace_exceeds_memory")


GRID = [(mr, ws, top) for mr, ws, top in itertools.product(
    (300, 4096, BIG), (1000, 64 << 20, None, MAX_BYTES), (None, 200, "max_reqs")) if not (top == 200 and mr < 200)
    # a 2**48 workspace holds the need of a 2**23 top, so plan estimates the graphs of ~1M sizes first (minutes)
    and not (mr == BIG and ws == MAX_BYTES and top == "max_reqs")]


@pytest.mark.parametrize("max_reqs,ws,top", GRID)
def test_workspace_remedy_then_plans_ok(max_reqs, ws, top, monkeypatch):
    err, followed = refused_then_followed(grid_argv(max_reqs, ws, top), WS_CODES, monkeypatch)
    if err is None:
        return
    for _, env in alternatives(err["remedy"]):
        for value in env.values():
            assert 1 <= int(value) <= MAX_BYTES
    given = max_reqs if top == "max_reqs" else top or 0
    for out2 in followed:
        assert out2["cuda_graphs"]["max_bs"] <= max(8192, given)  # never above what was asked, or practical


def test_the_backed_out_case_names_a_workspace_the_device_holds(monkeypatch):
    """t6verify's remedy for this suggested --cuda-graph-max-bs 852334595 with a 2**48 workspace; with sglang's
    default top (256 on an H200) the need is 21 MB (FlashInfer 0.7.2; 84 MB under 0.6.13's per-packed-row partial
    outputs). s12ws: req_to_token of 2**31 - 1 rows (8 TiB) fits no device,
    so raising the workspace to that need alone (the remedy until then) was refused as pool_exceeds_memory: the one
    alternative lowers --max-reqs too, to rows whose pools fit, with a workspace of the need there."""
    argv = ["--max-reqs", str(MAX), "--flashinfer-workspace-size", str(16 << 20)]
    rc, out = plan(argv, monkeypatch, {})
    assert rc == 3 and out["error"]["code"] == "workspace_too_small"
    need = next(f["value"] for f in out["error"]["flags"] if f["name"] == "needed_bytes")
    assert 16 << 20 < need < 141 * 10 ** 9 * 0.9
    # the flag set the size and wins over the variable: the remedy names only the flag (s8adv)
    ((flags, env),) = alternatives(out["error"]["remedy"])
    assert env == {} and set(flags) == {"--max-reqs", "--flashinfer-workspace-size"}, out["error"]["remedy"]
    rows, ws = int(flags["--max-reqs"]), int(flags["--flashinfer-workspace-size"])
    assert 2 ** 24 < rows < 141 * 10 ** 9 * 0.9 / (4 * 1024) and 16 << 20 < ws <= need
    follow_every_alternative(argv, out["error"]["remedy"], monkeypatch, {})


def test_a_workspace_the_device_cannot_hold_is_never_suggested(monkeypatch):
    """An explicit top of 2**23 needs far more than the H200 holds: the remedy lowers the top (to at most
    8192), it never names that workspace; from the environment the remedy names the variable, both ways true.
    (A 2**48-byte workspace holds that need but is above the device itself: ``workspace_exceeds_memory``, s10mem,
    tests/test_plan_memory_s10.py; here it would first estimate the graphs of ~1M sizes.)"""
    for ws, env in ((1000, {}), (None, {"SGLANG_FLASHINFER_WORKSPACE_SIZE": "1000"})):
        argv = ["--max-reqs", str(BIG), "--cuda-graph-max-bs", str(BIG)]
        if ws is not None:
            argv += ["--flashinfer-workspace-size", str(ws)]
        rc, out = plan(argv, monkeypatch, env)
        assert rc == 3 and out["error"]["code"] == "workspace_too_small", out["error"]
        need = next(f["value"] for f in out["error"]["flags"] if f["name"] == "needed_bytes")
        assert need > MAX_BYTES or need > 141 * 10 ** 9
        assert str(need) not in out["error"]["remedy"] and "--cuda-graph-max-bs" in out["error"]["remedy"]
        follow_every_alternative(argv, out["error"]["remedy"], monkeypatch, env)
