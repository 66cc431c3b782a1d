"""``plan`` counts what it can know without allocating, as ``run`` counts it, and ``run`` counts the workspaces before
anything is allocated (s10mem).

1. A FlashInfer workspace above 90 % of the device profile is refused by ``plan`` as ``run`` refuses it
   (``workspace_exceeds_memory``, against the total), with a remedy at or above the backend's need that then plans ok.
2. ``plan`` sizes req_to_token and the KV pool of ``--num-token-slots`` (run's sizing functions) and refuses pools
   the profile cannot hold (``pool_exceeds_memory``, run's remedy builder), each alternative then planning ok.
3. ``run``'s preflight counts the planned workspaces with the pools and the graphs against free memory (they were
   checked only after the pools were allocated, without the graphs): refused before anything is allocated.
"""

from __future__ import annotations

import re

import pytest

from conftest import cuda_facts
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec
from pipeline.core.spec import truncate_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.runtime.table import size_for
from plan_remedies import plan, set_flag
from pipeline.runtime.runner import Runner, RunnerConfig

ALL = {"torch": True, "triton": True, "flashinfer-python": True}
GiB = 1 << 30






def _flag(err: dict, name: str) -> int:
    return next(f["value"] for f in err["flags"] if f["name"] == name)


# --- 1. plan: a workspace the profile cannot hold --------------------------------------------------------------

def test_plan_refuses_a_workspace_above_the_device_and_the_remedy_plans_ok():
    argv = ["--flashinfer-workspace-size", str(2 ** 48)]
    rc, out = plan(argv)
    err = out["error"]
    assert rc == 3 and err["code"] == "workspace_exceeds_memory" and err["state"] == "build-mode", err
    assert "141000000000 bytes in all" in err["message"] and "checks against the total" in err["message"]
    need = _flag(err, "needed_bytes")
    m = re.fullmatch(r"set --flashinfer-workspace-size to (\d+) or less \(at least the (\d+) bytes .*\)", err["remedy"])
    assert m and int(m.group(2)) == need <= int(m.group(1)), err["remedy"]
    for value in (m.group(1), str(need)):  # the largest named and the need: both plan ok
        rc2, out2 = plan(set_flag(argv, "--flashinfer-workspace-size", value))
        assert rc2 == 0, out2.get("error")


def test_plan_still_accepts_a_large_workspace_that_fits():
    rc, out = plan(["--flashinfer-workspace-size", str(100 * 10 ** 9)])
    assert rc == 0, out.get("error")


# --- 2. plan: req_to_token and the KV pool ---------------------------------------------------------------------

def _follow(argv: list[str], remedy: str) -> int:
    ways = remedy.split(", or ")
    for way in ways:
        if m := re.match(r"lower --max-reqs \(at most (\d+) rows", way):
            fixed = set_flag(argv, "--max-reqs", m.group(1))
            if "to at most that" in way:
                fixed = set_flag(fixed, "--cuda-graph-max-bs", m.group(1))
            if top := re.search(r" and set --cuda-graph-max-bs (\d+)$", way):  # rows and graphs together (s12ws)
                fixed = set_flag(fixed, "--cuda-graph-max-bs", top.group(1))
            elif way.endswith(" and set --disable-cuda-graph"):
                fixed = fixed + ["--disable-cuda-graph"]
        elif m := re.match(r"lower --max-context-len \(at most (\d+) tokens", way):
            fixed = set_flag(argv, "--max-context-len", m.group(1))
        elif m := re.match(r"pass --num-token-slots (\d+) or fewer", way):
            fixed = set_flag(argv, "--num-token-slots", m.group(1))
        elif m := re.fullmatch(r"set --cuda-graph-max-bs (\d+)", way):
            fixed = set_flag(argv, "--cuda-graph-max-bs", m.group(1))
        else:
            assert way == "set --disable-cuda-graph", way
            fixed = argv + ["--disable-cuda-graph"]
        rc, out = plan(fixed)
        assert rc == 0, (argv, way, out.get("error"))
    return len(ways)


@pytest.mark.parametrize("argv", [["--max-reqs", "2147483647"],
                                  ["--max-reqs", "100000", "--max-context-len", "400000"],
                                  ["--num-token-slots", str(2 ** 31 - 1)],
                                  # s12ws: req_to_token and the graphs of a 2**31 - 1 context are each ~137 GB
                                  ["--max-reqs", "16", "--max-context-len", "2147483647"]])
def test_plan_refuses_pools_run_refuses_and_each_alternative_plans_ok(argv):
    rc, out = plan(argv)
    err = out["error"]
    assert rc == 3 and err["code"] == "pool_exceeds_memory" and err["state"] == "init-memory-pool", err
    assert "141000000000 bytes in all" in err["message"] and "checks against the total" in err["message"]
    # the pools' refusal counts the planned workspace, as run counts it (graphs too large are named as such: s9mem)
    assert "workspaces 402653184" in err["message"] or err["message"].startswith("the decode CUDA graphs")
    assert _follow(argv, err["remedy"]) >= 1


def test_the_common_plan_still_plans():
    rc, out = plan([])
    assert rc == 0 and out["ok"]


# --- 3. run: the workspaces with the pools and the graphs, before allocation ------------------------------------

def _cfg(**args) -> tuple[RunnerConfig, object]:
    spec = load_model_spec(DEFAULT_MODEL_CONFIG)
    req = SetupRequest(args=AttentionArgs(page_size=16, **args), model=spec, device="cuda:0",
                       pool=PoolFacts(max_reqs=32, max_context_len=256, num_token_slots=4096, page_size=16))
    return RunnerConfig(request=req, num_layers=1), truncate_spec(spec, 1)


def test_size_for_counts_the_workspaces_and_its_remedy_fits_beside_them():
    """Pools + graphs fit 90 % of the free memory, but not with the workspaces: refused; the ``--num-token-slots``
    alternative, followed with the graphs and the workspaces as they are, then fits."""
    import dataclasses

    cfg, spec = _cfg()
    cfg = dataclasses.replace(cfg, num_token_slots=1 << 20)  # 4 GiB of K/V (one layer, 4096 bytes a slot)
    plat = FakePlatform(cuda_facts(), free_bytes=16 * GiB)
    size_for(plat, 0, cfg, spec, graph_reserve=4 * GiB)  # without the workspaces: fits
    with pytest.raises(ConfigError) as e:
        size_for(plat, 0, cfg, spec, graph_reserve=4 * GiB, workspace=8 * GiB)
    info = e.value.info
    assert info.code == "pool_exceeds_memory" and f"workspaces {8 * GiB}" in info.message, info
    n = int(re.search(r"--num-token-slots (\d+) or fewer", info.remedy).group(1))
    size_for(plat, 0, dataclasses.replace(cfg, num_token_slots=n), spec, graph_reserve=4 * GiB, workspace=8 * GiB)


def _preflight_error(free: int, **args) -> tuple[ConfigError, FakePlatform]:
    cfg, _ = _cfg(**args)
    plat = FakePlatform(cuda_facts(), free_bytes=free)
    r = Runner(cfg, platform=plat, installed=ALL)
    try:
        with pytest.raises(ConfigError) as e:
            r.preflight().raise_refusal()
    finally:
        r.close()
    return e.value, plat


def test_run_preflight_refuses_graphs_and_workspace_too_large_together():
    """The graphs' estimate and the workspace each fit 90 % of the free memory, together with the pools they do not:
    refused in preflight (``pool_exceeds_memory``), naming the workspaces, before anything is allocated."""
    err, plat = _preflight_error(2 * GiB, flashinfer_workspace_size=1800 << 20)
    assert err.info.code == "pool_exceeds_memory" and "workspaces 1887436800" in err.info.message, err.info
    assert "decode CUDA graphs" in err.info.message
    assert not [c for c, _ in plat.calls if c in ("init_blas", "init_lazy_device_memory")]


def test_run_preflight_refuses_a_workspace_above_the_free_memory_with_a_true_remedy():
    err, _ = _preflight_error(2 * GiB, flashinfer_workspace_size=100 * GiB)
    assert err.info.code == "workspace_exceeds_memory" and "bytes free" in err.info.message, err.info
    size = int(re.match(r"set flashinfer_workspace_size to (\d+) or less", err.info.remedy).group(1))
    cfg, _ = _cfg(flashinfer_workspace_size=size)
    r = Runner(cfg, platform=FakePlatform(cuda_facts(), free_bytes=2 * GiB), installed=ALL)
    try:
        r.preflight().raise_refusal()
    finally:
        r.close()
