"""Memory remedies that name "the largest that fits" stay true when followed: each value is sized against the free
memory less :func:`pipeline.memory.pools.remedy_margin` and rounded down, so a re-run on a machine whose free
memory dropped by up to that margin passes the same check (a followed ``--mem-fraction 0.84``, then
0.83, 0.82 … down to 0.78 before one fitted)."""

from __future__ import annotations

from conftest import run_json

import dataclasses
import json
import re

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pipeline.cli import main
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
    The remedy now lowers the graph sizes with it, and following it passes both checks."""
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


def _run(capsys, tmp_path, *argv):
    code = main(["run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "{run_id}.jsonl"), *argv])
    return code, json.loads(capsys.readouterr().out)


def test_mem_fraction_remedy_names_a_share_that_fits_here(capsys, tmp_path):
    """`--mem-fraction 1.5` suggested "such as 0.8", which a CPU host refuses (item 9): a share too large for this
    host (1.0, inside the flag's domain; 1.5 is outside it, exit 2) is refused with a remedy naming the largest share
    in hundredths whose pools fit and hold the verification batches — checked by sizing (nothing is allocated):
    that share passes, the next hundredth up does not (unless it is the 0.9 cap)."""
    import argparse

    from pipeline.cli import build_parser
    from pipeline.cli.run import check_pool_for_checks, request_from
    from pipeline.core.errors import ConfigError
    from pipeline.platforms import platform_for

    code, out = _run(capsys, tmp_path, "--mem-fraction", "1.0")
    assert code == 3 and out["error"]["flags"][0]["name"] == "--mem-fraction"
    frac = float(re.search(r"--mem-fraction (0\.\d+)", out["error"]["remedy"]).group(1))
    ns = build_parser().parse_args(["run", "--device", "cpu", "--mem-fraction", str(frac)])
    assert isinstance(ns, argparse.Namespace)
    req, platform = request_from(ns, on_gpu=False), platform_for("cpu")
    check_pool_for_checks(ns, req, platform, 0)
    if frac < 0.9:
        from pipeline.memory.pools import remedy_margin
        from pipeline.platforms.cpu import host_available_bytes

        total = platform.device_facts(0).total_memory_bytes  # the remedy keeps a margin; host memory also moves
        ns.mem_fraction = round(frac + remedy_margin(host_available_bytes()) / total + 0.03, 2)
        with pytest.raises(ConfigError):
            check_pool_for_checks(ns, req, platform, 0)


# -- 3. a --mem-fraction pool must hold run's verification batches ----------------------------------------------
def test_a_mem_fraction_below_the_verification_batches_is_refused_and_its_remedy_runs_ok(tmp_path):
    """The finding: ``--mem-fraction 1e-300`` was refused with "cover 49152 bytes" (2 slots), and following it
    (2.1e-6, 53080 bytes) loaded the model and failed verification with ``kv_pool_exhausted``. Now the refusal
    counts the 72 slots the verification batches need, as ``--mem-bytes``'s does, names a fraction, and that runs ok;
    the finding's 2.1e-6 is refused before the model loads."""
    import re

    for frac in ("1e-300", "2.1e-6"):
        rc, out = run_json("run", "--mem-fraction", frac, "--log-file", str(tmp_path / f"{frac}.jsonl"))
        err = out["error"]
        assert rc == 3 and err["code"] == "pool_budget_too_small" and err["state"] == "args", err
        assert "72 token slots (the verification batches with --decode-steps 3)" in err["message"]
        assert "(622592 bytes in all)" in err["message"] and err["allowed"] == [">= 622592 bytes"]
    m = re.fullmatch(r"raise --mem-fraction to (\S+) or more \(it then covers 622592 bytes\), or lower --max-reqs "
                     r"or --max-context-len", err["remedy"])
    assert m, err["remedy"]
    rc, out = run_json("run", "--mem-fraction", m.group(1), "--log-file", str(tmp_path / "ok.jsonl"))
    assert rc == 0 and out["ok"] and out["error"] is None, out["error"]


def test_fraction_covering_is_the_smallest_three_digit_fraction():
    from pipeline.memory.pools import budget_from_fraction, fraction_covering

    for need, total, allocated in [(622592, 25_280_000_000, 0), (1, 10, 0), (10, 10, 0), (5, 100, 50),
                                   (123456789, 141_000_000_000, 17_000_000_000)]:
        f = fraction_covering(need, total, allocated)
        assert budget_from_fraction(f, total, allocated) >= need
        m, e = f"{f:.2e}".split("e")
        lower = float(f"{round(float(m) * 100) - 1}e{int(e) - 2}")
        assert lower <= 0 or int(lower * total) - allocated < need, (need, total, f)
    assert fraction_covering(11, 10) is None and fraction_covering(5, 0) is None and fraction_covering(10, 10) == 1.0
