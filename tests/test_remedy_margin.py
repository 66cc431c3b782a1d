"""Memory remedies that name "the largest that fits" stay true when followed: each value is sized against the free
memory less :func:`pipeline.memory.pools.remedy_margin` and rounded down, so a re-run on a machine whose free
memory dropped by up to that margin passes the same check (a new-user trial followed ``--mem-fraction 0.84``, then
0.83, 0.82 … down to 0.78 before one fitted)."""

from __future__ import annotations

import dataclasses
import re

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pipeline.core.contracts import DeviceFacts, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import REMEDY_MARGIN_MIN_BYTES, remedy_available, remedy_margin
from pipeline.core.spec import truncate_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.runtime.table import fraction_remedy, size_for
from pipeline.runtime.runner import RunnerConfig

MiB, GiB = 1 << 20, 1 << 30


def _setup(llama, free: int, total: int, **cfg):
    """A CPU fake with ``free`` bytes free of ``total``, a 2-layer Llama and a RunnerConfig with ``cfg``."""
    req = SetupRequest(model=llama, device="cpu", pool=PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=64))
    platform = FakePlatform(DeviceFacts(type="cpu", name="host", total_memory_bytes=total), free_bytes=free)
    return platform, RunnerConfig(request=req, num_layers=2, **cfg), truncate_spec(llama, 2)


def _moved(platform, free: int):
    """The same device after free memory moved to ``free`` bytes."""
    return FakePlatform(platform.device_facts(0), free_bytes=free)


@given(available=st.integers(min_value=0, max_value=1 << 50))
def test_the_margin_is_a_few_percent_and_some_hundreds_of_mib(available):
    """The margin is at least 5 % of the free memory and at least 512 MiB (a quarter on a smaller device)."""
    m = remedy_margin(available)
    assert m >= available * 0.05 and m >= min(REMEDY_MARGIN_MIN_BYTES, available // 4)
    assert 0 <= remedy_available(available) <= available


@settings(max_examples=80, deadline=None)
@given(free=st.integers(min_value=256 * MiB, max_value=400 * GiB), over=st.integers(min_value=1, max_value=1 << 40),
       drop=st.floats(min_value=0, max_value=1))
def test_mem_bytes_above_the_device_names_a_value_that_fits(llama, free, over, drop):
    """``--mem-bytes`` above the device's total names a value that fits, also after free memory dropped by up to the
    margin."""
    total = free + free // 3
    platform, cfg, spec = _setup(llama, free, total, mem_bytes=total + over)
    with pytest.raises(ConfigError) as e:
        size_for(platform, 0, cfg, spec)
    info = e.value.info
    assert info.code == "invalid_value" and info.flags[0].name == "mem_bytes"
    n = int(re.match(r"pass --mem-bytes (\d+) or less", info.remedy).group(1))
    assert 1 <= n <= total
    for now in (free, free - int(drop * remedy_margin(free)), free - remedy_margin(free)):
        size_for(_moved(platform, now), 0, dataclasses.replace(cfg, mem_bytes=n), spec)


@settings(max_examples=40, deadline=None)
@given(free=st.integers(min_value=256 * MiB, max_value=400 * GiB), extra=st.floats(min_value=0, max_value=3),
       drop=st.floats(min_value=0, max_value=1))
def test_mem_fraction_remedy_fits_after_free_memory_moved(llama, free, extra, drop):
    """The ``--mem-fraction`` share a refusal names fits the free memory less up to the margin."""
    total = free + int(free * extra)
    platform, cfg, spec = _setup(llama, free, total, mem_fraction=1.0)
    remedy = fraction_remedy(platform, 0, cfg, spec)
    share = re.match(r"pass --mem-fraction ([0-9.]+) or less", remedy)
    if share is None:
        assert remedy.startswith("drop --mem-fraction")
        return
    followed = dataclasses.replace(cfg, mem_fraction=float(share.group(1)))
    for now in (free, free - int(drop * remedy_margin(free)), free - remedy_margin(free)):
        size_for(_moved(platform, now), 0, followed, spec)


def test_mem_fraction_one_on_the_cli_names_a_share_with_a_margin(llama):
    """The trial's case: 1.0 of a host with most of its memory free is refused naming a share below the limit's."""
    free = total = 24 * GiB
    platform, cfg, spec = _setup(llama, free, total, mem_fraction=1.0)
    with pytest.raises(ConfigError) as e:
        size_for(platform, 0, cfg, spec)
    share = float(re.search(r"--mem-fraction (0\.\d\d) or less", e.value.info.remedy).group(1))
    assert share <= round(0.9 * remedy_available(free) / total, 2) < 0.9 * free / total  # not the limit itself
    size_for(_moved(platform, free - remedy_margin(free)), 0, dataclasses.replace(cfg, mem_fraction=share), spec)


@settings(max_examples=60, deadline=None)
@given(free=st.integers(min_value=64 * MiB, max_value=400 * GiB), n=st.integers(min_value=1, max_value=4),
       drop=st.floats(min_value=0, max_value=1))
def test_workspace_remedy_fits_after_free_memory_moved(free, n, drop):
    """``workspace_exceeds_memory`` names a per-workspace size whose workspaces fit the free memory less the margin."""
    from types import SimpleNamespace as NS

    from pipeline.core.contracts import BuildPlan, WorkspacePlan
    from pipeline.setup.instances import check_workspace_memory

    def check(avail: int, each: int) -> None:
        platform = FakePlatform(DeviceFacts(type="cpu", name="host", total_memory_bytes=2 * free), free_bytes=avail)
        ctx = NS(platform=platform, request=NS(device="cpu"), torch_device="cpu")
        plan = BuildPlan(mode="normal", hybrid=False, instances=[],
                         workspaces=[WorkspacePlan(id=f"ws{i}", owner="prefill", bytes=each) for i in range(n)])
        d = NS(plan=plan, settings=[])
        check_workspace_memory(ctx, d)

    with pytest.raises(ConfigError) as e:
        check(free, free)
    size = int(re.match(r"set workspace_bytes to (\d+) or less", e.value.info.remedy).group(1))
    for now in (free, free - int(drop * remedy_margin(free)), free - remedy_margin(free)):
        check(now, size)


@pytest.mark.parametrize("graphs", [dict(cuda_graph_max_bs=2 ** 31 - 1), dict(cuda_graph_bs=[1, 2 ** 31 - 1]), {}])
def test_a_max_reqs_remedy_lowers_the_graph_sizes_above_it(llama, graphs):
    """``run --max-reqs 2147483647 --cuda-graph-max-bs 2147483647``: the remedy said only "lower --max-reqs (at most
    N rows …)", and that N with the graph top left as given was refused next (cuda_graph_max_bs above max_reqs).
    The remedy now lowers the graph sizes with it, and following it passes both checks (s8adv)."""
    from pipeline.core.contracts import AttentionArgs
    from states.build_mode import check_graph_bs

    big = 2 ** 31 - 1
    req = SetupRequest(model=llama, device="cpu", args=AttentionArgs(**graphs),
                       pool=PoolFacts(max_reqs=big, max_context_len=64, num_token_slots=64))
    platform = FakePlatform(DeviceFacts(type="cpu", name="host", total_memory_bytes=4 * GiB), free_bytes=2 * GiB)
    with pytest.raises(ConfigError) as e:
        size_for(platform, 0, RunnerConfig(request=req, num_layers=2), truncate_spec(llama, 2))
    remedy = e.value.info.remedy
    rows = int(re.match(r"lower --max-reqs \(at most (\d+) rows", remedy).group(1))
    assert ("--cuda-graph-max-bs / --cuda-graph-bs to at most that" in remedy) == bool(graphs)
    fixed = {k: (rows if k == "cuda_graph_max_bs" else [1, rows]) for k in graphs}
    req = SetupRequest(model=llama, device="cpu", args=AttentionArgs(**fixed),
                       pool=PoolFacts(max_reqs=rows, max_context_len=64, num_token_slots=64))
    size_for(platform, 0, RunnerConfig(request=req, num_layers=2), truncate_spec(llama, 2))
    check_graph_bs(req.args, rows)
