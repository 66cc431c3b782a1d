"""Memory refusals that involve the decode CUDA graphs are made, and their remedies are true.

1. ``plan`` refuses graphs the device profile cannot hold (``pool_exceeds_memory``, as ``run`` would: it said ``ok``
   beside a ~9.7 TB estimate for a 141 GB H200), and every alternative of its remedy then plans ok.
2. The pool remedy (``pool_exceeds_memory`` of ``run``'s pool sizing) names a value inside its flag's domain for each
   alternative — never "at most 0 rows", never ``--max-context-len`` without a value — and each, followed, passes.
"""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import GraphTrial
from pipeline.core.numbers import REMEDY_MAX_BS, largest_fitting
from pipeline.core.spec import truncate_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.runtime.table import size_for
from plan_remedies import in_domain, plan, set_flag
from pipeline.runtime.runner import RunnerConfig
from conftest import cuda_facts
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG
from pipeline.core.model_spec import load_model_spec
from pipeline.runtime.runner import Runner

GiB = 1 << 30








def _follow_plan_remedy(argv: list[str], remedy: str) -> int:
    """Follow every alternative of a plan remedy; returns how many there were."""
    ways = remedy.split(", or ")
    for way in ways:
        m = re.fullmatch(r"set --cuda-graph-max-bs (\d+)", way)
        if m:
            n = int(m.group(1))
            assert in_domain("--cuda-graph-max-bs", n) and n <= REMEDY_MAX_BS
            fixed = set_flag(argv, "--cuda-graph-max-bs", str(n))
        else:
            assert way == "set --disable-cuda-graph", way
            fixed = set_flag(argv, "--disable-cuda-graph", None)
        rc, out = plan(fixed)
        assert rc == 0, (argv, way, out.get("error"))
    return len(ways)


def test_plan_refuses_the_adversarial_graphs_and_each_alternative_plans_ok():
    """The finding's command: ~9.7 TB of graphs for a 141 GB device is refused as run refuses it, saying that plan
    checks against the total; the largest top that fits and no graphs both then plan ok."""
    argv = ["--max-reqs", "100000", "--cuda-graph-max-bs", "100000", "--flashinfer-workspace-size", "33023735840"]
    rc, out = plan(argv)
    err = out["error"]
    assert rc == 3 and err["code"] == "pool_exceeds_memory" and err["state"] == "init-memory-pool", err
    assert "141000000000 bytes in all" in err["message"] and "checks against the total" in err["message"]
    assert _follow_plan_remedy(argv, err["remedy"]) == 2


def test_graphs_beside_a_large_workspace_are_refused_and_the_remedy_plans_ok():
    """Graphs that fit 90 % of the device alone but not beside the planned workspace (76 GiB + 110 GB > 141 GB)."""
    argv = ["--max-reqs", "8192", "--cuda-graph-max-bs", "8192", "--flashinfer-workspace-size", "110000000000"]
    rc, out = plan(argv)
    assert rc == 3 and out["error"]["code"] == "pool_exceeds_memory"
    assert "with the planned workspaces (110000000000 bytes)" in out["error"]["message"]
    assert _follow_plan_remedy(argv, out["error"]["remedy"]) == 2


def test_the_common_plan_is_unchanged():
    rc, out = plan([])
    assert rc == 0 and 0 < out["cuda_graph_bytes_estimate"] < 141 * 10 ** 9 * 0.9


def test_largest_fitting_is_the_scan():
    for n in range(0, 40):
        cands = list(range(1, n + 1))
        for bound in range(-1, n + 2):
            want = max([c for c in cands if c <= bound], default=None)
            assert largest_fitting(cands, lambda c: c <= bound) == want


# --- 2. the pool remedy -------------------------------------------------------------------------------------------

def _cfg(llama, *, max_reqs=8, ctx=1024, args=None, slots=1024, **kw) -> RunnerConfig:
    req = SetupRequest(model=llama, device="cpu", args=args or AttentionArgs(),
                       pool=PoolFacts(max_reqs=max_reqs, max_context_len=ctx, num_token_slots=slots))
    return RunnerConfig(request=req, num_layers=2, min_token_slots=64, min_context_len=40, **kw)


def _with_pool(cfg: RunnerConfig, **pool) -> RunnerConfig:
    import dataclasses

    req = cfg.request
    return dataclasses.replace(cfg, request=msgspec.structs.replace(req, pool=msgspec.structs.replace(req.pool,
                                                                                                       **pool)))


def _ways(remedy: str) -> list[str]:
    return remedy.split(", or ")


def _follow_pool(platform, cfg, spec, remedy, reserve=0, graphs=None):
    """Follow each alternative of a run pool remedy through :func:`size_for` (run's preflight sizing); every value
    inside its flag's domain."""
    followed = 0
    for way in _ways(remedy.replace(" (or free memory on the device)", "")):
        g = reserve
        if m := re.match(r"lower --max-reqs \(at most (\d+) rows", way):
            n = int(m.group(1))
            assert in_domain("--max-reqs", n)
            fixed = _with_pool(cfg, max_reqs=n)
        elif m := re.match(r"lower --max-context-len \(at most (\d+) tokens", way):
            n = int(m.group(1))
            assert in_domain("--max-context-len", n) and n >= cfg.min_context_len
            fixed = _with_pool(cfg, max_context_len=n)
        elif m := re.match(r"pass --num-token-slots (\d+) or fewer", way):
            import dataclasses

            n = int(m.group(1))
            assert in_domain("--num-token-slots", n) and n >= cfg.min_token_slots
            fixed = dataclasses.replace(cfg, num_token_slots=n)
        elif m := re.fullmatch(r"set cuda_graph_max_bs=(\d+)", way):
            n = int(m.group(1))
            assert in_domain("--cuda-graph-max-bs", n)
            fixed, g = cfg, graphs.bytes_at(n)
        else:
            assert way == "set disable_cuda_graph=True", way
            fixed, g = cfg, 0
        if "and set num_token_slots=" in way:
            import dataclasses

            fixed = dataclasses.replace(fixed, num_token_slots=int(way.rsplit("=", 1)[1]))
        size_for(platform, 0, fixed, spec, graph_reserve=g)
        followed += 1
    return followed


def test_a_context_too_long_for_one_row_offers_a_valued_context_not_zero_rows(llama):
    """``--max-context-len 2**31 - 1``: one row of req_to_token is 8 GiB, more than the 2 GiB free, so no
    ``--max-reqs`` can work and none is offered; ``--max-context-len`` is offered with a value that then fits."""
    platform = FakePlatform(DeviceFacts(type="cpu", name="host", total_memory_bytes=4 * GiB), free_bytes=2 * GiB)
    cfg, spec = _cfg(llama, ctx=2 ** 31 - 1), truncate_spec(llama, 2)
    with pytest.raises(ConfigError) as e:
        size_for(platform, 0, cfg, spec)
    remedy = e.value.info.remedy
    assert "--max-reqs" not in remedy and "at most 0" not in remedy and "--max-context-len (at most" in remedy
    assert _follow_pool(platform, cfg, spec, remedy) == 1


@pytest.mark.parametrize("source", ["slots", "mem_bytes", "mem_fraction"])
def test_each_rows_or_context_alternative_then_fits(llama, source):
    platform = FakePlatform(DeviceFacts(type="cpu", name="host", total_memory_bytes=4 * GiB), free_bytes=2 * GiB)
    extra = {"slots": {}, "mem_bytes": {"mem_bytes": GiB}, "mem_fraction": {"mem_fraction": 0.3}}[source]
    cfg, spec = _cfg(llama, max_reqs=2 ** 20, ctx=1024, **extra), truncate_spec(llama, 2)
    with pytest.raises(ConfigError) as e:
        size_for(platform, 0, cfg, spec)
    assert e.value.info.code in ("pool_exceeds_memory", "pool_budget_too_small")
    if e.value.info.code == "pool_exceeds_memory":
        assert _follow_pool(platform, cfg, spec, e.value.info.remedy) >= 1


def test_graphs_too_large_offer_a_lower_top_or_none_never_zero_rows(llama):
    """The graphs' reserve alone above the limit (a huge --cuda-graph-max-bs): the remedy used to say "lower
    --max-reqs (at most 0 rows …)"; it now names a top whose estimate fits, and dropping the graphs, both then fit."""
    platform = FakePlatform(DeviceFacts(type="cpu", name="host", total_memory_bytes=8 * GiB), free_bytes=4 * GiB)
    sizes = [1, 2, 4, 8] + list(range(16, 100001, 8))
    trial = GraphTrial(sizes, False, True, lambda n: 64 * n * n + (1 << 20))  # nondecreasing, as an estimate
    args = AttentionArgs(cuda_graph_max_bs=100000)
    cfg, spec = _cfg(llama, max_reqs=100000, ctx=64, args=args), truncate_spec(llama, 2)
    reserve = trial.bytes_at(100000)
    with pytest.raises(ConfigError) as e:
        size_for(platform, 0, cfg, spec, graph_reserve=reserve, graphs=trial)
    remedy = e.value.info.remedy
    assert "at most 0" not in remedy and "--max-reqs" not in remedy, remedy
    assert "set cuda_graph_max_bs=" in remedy and "set disable_cuda_graph=True" in remedy
    assert _follow_pool(platform, cfg, spec, remedy, reserve, trial) == 2


def test_run_on_the_cli_words_a_valued_context_remedy(monkeypatch):
    """Through ``run``'s main on CPU (refused in its preflight, before the model loads): no zero rows, the context
    alternative carries a value inside the flag's domain."""
    from conftest import run_main

    from pipeline.platforms import cpu

    monkeypatch.setattr(cpu.CpuPlatform, "memory_available", lambda self, index=0: 2 * GiB)
    proc = run_main("run", "--device", "cpu", "--max-context-len", str(2 ** 31 - 1), "--json")
    err = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert proc.returncode == 3 and err["code"] == "pool_exceeds_memory", err
    assert "at most 0" not in err["remedy"] and "--max-reqs" not in err["remedy"]
    n = int(re.search(r"--max-context-len \(at most (\d+) tokens", err["remedy"]).group(1))
    assert in_domain("--max-context-len", n)


ALL = {"torch": True, "triton": True, "flashinfer-python": True}




def _flag(err: dict, name: str) -> int:
    return next(f["value"] for f in err["flags"] if f["name"] == name)


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


def _follow(argv: list[str], remedy: str) -> int:
    ways = remedy.split(", or ")
    for way in ways:
        if m := re.match(r"lower --max-reqs \(at most (\d+) rows", way):
            fixed = set_flag(argv, "--max-reqs", m.group(1))
            if "to at most that" in way:
                fixed = set_flag(fixed, "--cuda-graph-max-bs", m.group(1))
            if top := re.search(r" and set --cuda-graph-max-bs (\d+)$", way):  # rows and graphs together
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
                                  # req_to_token and the graphs of a 2**31 - 1 context are each ~137 GB
                                  ["--max-reqs", "16", "--max-context-len", "2147483647"]])
def test_plan_refuses_pools_run_refuses_and_each_alternative_plans_ok(argv):
    rc, out = plan(argv)
    err = out["error"]
    assert rc == 3 and err["code"] == "pool_exceeds_memory" and err["state"] == "init-memory-pool", err
    assert "141000000000 bytes in all" in err["message"] and "checks against the total" in err["message"]
    # the pools' refusal counts the planned workspace, as run counts it (graphs too large are named as such:)
    assert "workspaces 402653184" in err["message"] or err["message"].startswith("the decode CUDA graphs")
    assert _follow(argv, err["remedy"]) >= 1


def test_the_common_plan_still_plans():
    rc, out = plan([])
    assert rc == 0 and out["ok"]


def _plan_cfg(**args) -> tuple[RunnerConfig, object]:
    spec = load_model_spec(DEFAULT_MODEL_CONFIG)
    req = SetupRequest(args=AttentionArgs(page_size=16, **args), model=spec, device="cuda:0",
                       pool=PoolFacts(max_reqs=32, max_context_len=256, num_token_slots=4096, page_size=16))
    return RunnerConfig(request=req, num_layers=1), truncate_spec(spec, 1)


def test_size_for_counts_the_workspaces_and_its_remedy_fits_beside_them():
    """Pools + graphs fit 90 % of the free memory, but not with the workspaces: refused; the ``--num-token-slots``
    alternative, followed with the graphs and the workspaces as they are, then fits."""
    import dataclasses

    cfg, spec = _plan_cfg()
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
    cfg, _ = _plan_cfg(**args)
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
    cfg, _ = _plan_cfg(flashinfer_workspace_size=size)
    r = Runner(cfg, platform=FakePlatform(cuda_facts(), free_bytes=2 * GiB), installed=ALL)
    try:
        r.preflight().raise_refusal()
    finally:
        r.close()
