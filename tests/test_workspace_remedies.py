"""The FlashInfer workspace remedy is true: for a grid of (max_reqs, workspace size, cuda_graph_max_bs) that
``attn-setup plan`` refuses with ``workspace_too_small``, every alternative the remedy names — with the flag values
it names — then plans ok, each value inside its flag's domain (in-process, through the CLI's main).

``plan`` counts req_to_token (``max_reqs x max_context_len x 4`` bytes) against the profile's memory, as
``run`` does, so the largest row count here is one whose pool fits the H200 (2**23 rows: 32 GiB of req_to_token,
beside the graphs of a 8192 top), not 2**31 - 1 (8 TiB, refused as ``pool_exceeds_memory``); and a 2**48-byte workspace is refused as
``workspace_exceeds_memory`` (above 90 % of the device), whose remedy is followed the same way."""

from __future__ import annotations

import itertools

import pytest

from pipeline.core.validation import MAX_BYTES
from plan_remedies import alternatives, follow_every_alternative, grid_argv, plan, refused_then_followed
import time
from conftest import ROOT
import re
import subprocess
import sys

MAX = 2 ** 31 - 1
BIG = 2 ** 23  # the most rows here: req_to_token of 32 GiB fits the H200 profile beside 8192-top graphs
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
    """A remedy for this once suggested --cuda-graph-max-bs 852334595 with a 2**48 workspace; with sglang's
    default top (256 on an H200) the need is 21 MB (FlashInfer 0.7.2; 84 MB under 0.6.13's per-packed-row partial
    outputs). req_to_token of 2**31 - 1 rows (8 TiB) fits no device,
    so raising the workspace to that need alone (the remedy until then) was refused as pool_exceeds_memory: the one
    alternative lowers --max-reqs too, to rows whose pools fit, with a workspace of the need there."""
    argv = ["--max-reqs", str(MAX), "--flashinfer-workspace-size", str(16 << 20)]
    rc, out = plan(argv, monkeypatch, {})
    assert rc == 3 and out["error"]["code"] == "workspace_too_small"
    need = next(f["value"] for f in out["error"]["flags"] if f["name"] == "needed_bytes")
    assert 16 << 20 < need < 141 * 10 ** 9 * 0.9
    # the flag set the size and wins over the variable: the remedy names only the flag
    ((flags, env),) = alternatives(out["error"]["remedy"])
    assert env == {} and set(flags) == {"--max-reqs", "--flashinfer-workspace-size"}, out["error"]["remedy"]
    rows, ws = int(flags["--max-reqs"]), int(flags["--flashinfer-workspace-size"])
    assert 2 ** 24 < rows < 141 * 10 ** 9 * 0.9 / (4 * 1024) and 16 << 20 < ws <= need
    follow_every_alternative(argv, out["error"]["remedy"], monkeypatch, {})


def test_a_workspace_the_device_cannot_hold_is_never_suggested(monkeypatch):
    """An explicit top of 2**23 needs far more than the H200 holds: the remedy lowers the top (to at most
    8192), it never names that workspace; from the environment the remedy names the variable, both ways true.
    (A 2**48-byte workspace holds that need but is above the device itself: ``workspace_exceeds_memory``,,
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


HUGE = 2 ** 24


HUGE_GRID = list(itertools.product((300, HUGE), (1000, 64 << 20, None), (None, 200, "max_reqs")))


@pytest.mark.parametrize("max_reqs,ws,top", HUGE_GRID)
def test_every_alternative_plans_ok(max_reqs, ws, top, monkeypatch):
    refused_then_followed(grid_argv(max_reqs, ws, top), WS_CODES + ("pool_exceeds_memory",), monkeypatch)


def test_a_huge_top_is_refused_at_once(monkeypatch):
    """The workspace holds the need of a 2**24 top; the graphs' lower bound alone is far above the device."""
    argv = ["--max-reqs", str(HUGE), "--cuda-graph-max-bs", str(HUGE), "--flashinfer-workspace-size", "5540507547680"]
    t = time.monotonic()
    rc, out = plan(argv, monkeypatch)
    assert time.monotonic() - t < 30
    assert rc == 3 and out["error"]["code"] in ("workspace_exceeds_memory", "pool_exceeds_memory"), out["error"]




SHARE = int(141 * 10 ** 9 * 0.9)  # what plan lets the pools, graphs and workspaces use on the h200 profile


def _refused(argv, monkeypatch, env=None):
    rc, out = plan(argv, monkeypatch, env or {})
    assert rc == 3 and out["error"]["code"] == "workspace_too_small", out.get("error")
    return out["error"]


def _plans_ok(argv, monkeypatch, env=None):
    """Follow every alternative of the refusal of ``argv``; the plans they give, and the alternatives."""
    err = _refused(argv, monkeypatch, env)
    return follow_every_alternative(argv, err["remedy"], monkeypatch, env or {}), alternatives(err["remedy"])


def test_the_briefs_case_names_a_top_whose_graphs_fit_beside_the_pools(monkeypatch):
    """2**24 rows and top: the need of top 8192 with that top did not fit beside 64 GiB of req_to_token; the one
    alternative now names a lower top and the need there, and that plan is accepted with its graphs and
    workspace within what the pools leave."""
    argv = ["--max-reqs", str(HUGE), "--cuda-graph-max-bs", str(HUGE), "--flashinfer-workspace-size", "1000"]
    outs, ways = _plans_ok(argv, monkeypatch)
    ((flags, env),) = ways
    assert env == {} and set(flags) == {"--flashinfer-workspace-size", "--cuda-graph-max-bs"}
    top, ws = int(flags["--cuda-graph-max-bs"]), int(flags["--flashinfer-workspace-size"])
    assert 1024 < top < 8192 and ws < 2705061920  # the need of top 8192, the remedy before
    (out,) = outs
    assert out["cuda_graphs"]["max_bs"] <= top and out["plan"]["workspaces"][0]["bytes"] == ws
    assert HUGE * 1024 * 4 + out["cuda_graph_bytes_estimate"] + ws <= SHARE  # req_to_token, graphs, workspace


def test_from_the_environment_the_remedy_names_the_variable(monkeypatch):
    argv = ["--max-reqs", str(HUGE), "--cuda-graph-max-bs", str(HUGE)]
    env = {"SGLANG_FLASHINFER_WORKSPACE_SIZE": "1000"}
    outs, ways = _plans_ok(argv, monkeypatch, env)
    ((flags, var),) = ways
    assert set(flags) == {"--cuda-graph-max-bs"} and set(var) == {"SGLANG_FLASHINFER_WORKSPACE_SIZE"}
    assert outs[0]["cuda_graphs"]["max_bs"] < 8192


def test_raising_the_workspace_is_not_offered_where_the_graphs_then_do_not_fit(monkeypatch):
    """107 GB of req_to_token and a 4096 top (~24 GB of graphs): the need at that top (1.35 GB) was the remedy,
    and then the graphs did not fit; the remedy lowers the top with the need there."""
    argv = ["--max-reqs", str(HUGE), "--max-context-len", "1600", "--cuda-graph-max-bs", "4096",
            "--flashinfer-workspace-size", str(64 << 20)]
    err = _refused(argv, monkeypatch)
    need = next(f["value"] for f in err["flags"] if f["name"] == "needed_bytes")
    assert str(need) not in err["remedy"]
    rc, out = plan(argv[:-1] + [str(need)], monkeypatch, {})
    assert rc == 3 and out["error"]["code"] == "pool_exceeds_memory"  # what the old remedy led to
    outs, ways = _plans_ok(argv, monkeypatch)
    assert all(int(f["--cuda-graph-max-bs"]) < 4096 for f, _ in ways) and all(o["ok"] for o in outs)


@pytest.mark.parametrize("top", [None, 2 ** 25])
def test_pools_too_large_for_any_workspace_lower_max_reqs(top, monkeypatch):
    """req_to_token of 2**25 rows (128 GiB) leaves no room for any workspace: the alternative lowers --max-reqs
    (and a given top above it, to at most 8192), with the workspace the backends need there."""
    argv = ["--max-reqs", str(2 ** 25), "--flashinfer-workspace-size", "1000"]
    argv += [] if top is None else ["--cuda-graph-max-bs", str(top)]
    outs, ways = _plans_ok(argv, monkeypatch)
    ((flags, _),) = ways
    assert HUGE < int(flags["--max-reqs"]) < 2 ** 25 or top is not None
    assert (top is None) == ("--cuda-graph-max-bs" not in flags)
    if top is not None:
        assert int(flags["--cuda-graph-max-bs"]) == 8192 == outs[0]["cuda_graphs"]["max_bs"]


def test_pools_no_row_count_fits_say_what_to_lower(monkeypatch):
    """A KV pool of 2**31 - 1 token slots fits at no --max-reqs: the remedy names what to lower, no value that
    fails."""
    err = _refused(["--num-token-slots", str(2 ** 31 - 1), "--flashinfer-workspace-size", "1000"], monkeypatch)
    assert err["remedy"].startswith("lower --max-context-len or --num-token-slots")
    assert not any(c.isdigit() for c in err["remedy"])


def test_the_retold_refusal_imports_no_torch():
    """The retold refusal estimates graphs and pools torch-free, as the rest of plan."""
    code = ("import sys, io, contextlib; from pipeline.cli import main;"
            "buf = io.StringIO();"
            "ctx = contextlib.redirect_stdout(buf); ctx.__enter__();"
            "rc = main(['plan', '--device-profile', 'h200', '--installed', 'torch,triton,flashinfer', '--json',"
            f" '--max-reqs', '{HUGE}', '--cuda-graph-max-bs', '4096', '--max-context-len', '1600',"
            " '--flashinfer-workspace-size', '1000']); ctx.__exit__(None, None, None);"
            "bad = [m for m in ('torch', 'triton', 'flashinfer', 'numpy') if m in sys.modules];"
            "print(rc, bad, 'and --cuda-graph-max-bs' in buf.getvalue()); sys.exit(0 if rc == 3 and not bad else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "True", proc.stdout + proc.stderr


def test_a_cut_list_names_a_size_it_keeps_and_that_top(monkeypatch):
    """With --cuda-graph-max-bs set beside the list (it must equal the list's largest size), cutting the list
    names the size kept and sets that top (the remedy said "sizes up to 212" alone: then refused as conflicting);
    a list no cut of which keeps a size is not offered."""
    base = ["--max-reqs", "256", "--flashinfer-workspace-size", "18000000"]
    err = _refused(base + ["--cuda-graph-max-bs", "250", "--cuda-graph-bs", "8", "250"], monkeypatch)
    assert err["remedy"].endswith("or use only sizes up to 8 in --cuda-graph-bs and set --cuda-graph-max-bs 8")
    assert plan(base + ["--cuda-graph-max-bs", "8", "--cuda-graph-bs", "8"], monkeypatch)[0] == 0
    err = _refused(base + ["--cuda-graph-max-bs", "250", "--cuda-graph-bs", "250"], monkeypatch)
    assert "--cuda-graph-bs" not in err["remedy"]
    follow_every_alternative(base + ["--cuda-graph-max-bs", "250", "--cuda-graph-bs", "250"], err["remedy"],
                             monkeypatch)


def test_pools_and_graphs_both_too_large_lower_rows_and_graphs_together(monkeypatch):
    """Stretch: req_to_token of 16 rows at a 2**31 - 1 context (137 GB) and the graphs at that context (137 GB):
    neither fewer rows nor fewer graphs alone fit, and the remedy was "free memory on the device"; it now names
    rows with a lower top, and rows without graphs, each then planning ok."""
    argv = ["--max-reqs", "16", "--max-context-len", str(2 ** 31 - 1)]
    rc, out = plan(argv, monkeypatch, {})
    assert rc == 3 and out["error"]["code"] == "pool_exceeds_memory", out["error"]
    remedy = out["error"]["remedy"]
    assert "free memory" not in remedy
    top, eager = remedy.split(", or ")
    m = re.fullmatch(r"lower --max-reqs \(at most (\d+) rows at this context length\) and set --cuda-graph-max-bs "
                     r"(\d+)", top)
    assert m and 1 <= int(m.group(2)) <= int(m.group(1)) < 16, top
    rc, got = plan(argv[:1] + [m.group(1)] + argv[2:] + ["--cuda-graph-max-bs", m.group(2)], monkeypatch, {})
    assert rc == 0 and got["cuda_graphs"]["max_bs"] == int(m.group(2)), got.get("error")
    m = re.fullmatch(r"lower --max-reqs \(at most (\d+) rows at this context length\) and set --disable-cuda-graph",
                     eager)
    assert m, eager
    rc, got = plan(argv[:1] + [m.group(1)] + argv[2:] + ["--disable-cuda-graph"], monkeypatch, {})
    assert rc == 0 and not got["cuda_graphs"]["capture"], got.get("error")
