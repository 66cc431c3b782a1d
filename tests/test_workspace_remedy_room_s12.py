"""s12ws (s11 gap 2): the FlashInfer workspace remedy counts the KV pools and the decode graphs, so every alternative
it names then passes the whole ``plan`` (H200 profile, in-process through the CLI's main). Before, its workspace was
bounded by each one's share of the device alone: "workspace 2705061920 and --cuda-graph-max-bs 8192" beside
req_to_token of 2**24 rows, "at least 1352398880" beside pools and graphs that left less, "at least 84277280"
beside 8 TiB of req_to_token — each then refused as ``pool_exceeds_memory``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT
from plan_remedies import alternatives, follow_every_alternative, plan

HUGE = 2 ** 24
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
