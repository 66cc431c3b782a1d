"""The top of the decode CUDA-graph capture series (``states.build_mode.graph_top``): sglang's memory-derived default
``cuda_graph_max_bs`` capped by ``max_reqs``, an explicit value kept as given, and one rule for the four functions
that read it (``capture_batch_sizes``, ``count_batch_sizes``, ``graph_max_bs``, ``batch_sizes_text``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core.contracts import AttentionArgs, DeviceFacts
from pipeline.core.errors import ConfigError
from pipeline.platforms import profiles
from states.build_mode import (batch_sizes_text, capture_batch_sizes, count_batch_sizes, default_max_bs, graph_max_bs,
                           graph_top)
from plan_remedies import follow_every_alternative
from plan_remedies import plan
import time
import tracemalloc

MIB, GIB = 1 << 20, 1 << 30


def _cuda(mem: int) -> DeviceFacts:
    return DeviceFacts(type="cuda", name="test GPU", compute_capability=(9, 0), sm_count=132, total_memory_bytes=mem)


# sglang's table (ServerArgs._handle_gpu_memory_settings), restated by hand: memory in MiB -> (tp < 4, tp >= 4)
@pytest.mark.parametrize("mib,small,large", [
    (16 * 1024, 8, 8), (20 * 1024 - 1, 8, 8), (20 * 1024, 24, 80), (24 * 1024, 24, 80), (35 * 1024, 32, 160),
    (48 * 1024, 32, 160), (60 * 1024, 256, 512), (80 * 1024, 256, 512), (141 * 1024, 256, 512),
    (160 * 1024 - 1, 256, 512), (160 * 1024, 512, 512), (192 * 1024, 512, 512),
])
def test_default_follows_sglangs_memory_table(mib, small, large):
    for world, want in ((1, small), (2, small), (3, small), (4, large), (8, large)):
        bs, text = default_max_bs(_cuda(mib * MIB), world)
        assert bs == want, (mib, world)
        assert text.endswith(f": {want} (sglang's rule)") and f"{mib * MIB / GIB:.0f} GiB" in text


def test_default_for_the_profiles_and_without_memory():
    """The bundled profiles (their datasheet memory in GB of 10**9 bytes) land in sglang's rows; a CPU, no device
    and a device of unknown memory get sglang's fallback, 160."""
    want = {"h200": 256, "h100": 256, "a100": 256, "l40s": 32, "b200": 512, "mi300x": 512, "rtx-pro-6000": 256,
            "ascend-910b": 32, "cpu": 160}
    for name, bs in want.items():
        assert default_max_bs(profiles.get(name))[0] == bs, name
    assert default_max_bs(None) == (160, "default for no known device memory: 160 (sglang's fallback)")
    assert default_max_bs(_cuda(0))[0] == 160
    assert default_max_bs(profiles.get("cpu"))[1] == "default for a CPU: 160 (sglang's fallback)"
    assert default_max_bs(profiles.get("h200"))[1] == "default for 131 GiB: 256 (sglang's rule)"


def test_default_is_capped_by_max_reqs_and_an_explicit_top_is_kept():
    h200 = profiles.get("h200")
    assert graph_top(AttentionArgs(), 10 ** 6, device=h200) == (256, "default", "default for 131 GiB: 256 (sglang's rule)")
    top = graph_top(AttentionArgs(), 100, device=h200)
    assert top.bs == 100 and top.source == "max_reqs" and "max_reqs=100, below the default for 131 GiB" in top.text
    assert capture_batch_sizes(AttentionArgs(), 100, device=h200)[-1] == 96
    # an explicit value above the default is never replaced by it
    explicit = AttentionArgs(cuda_graph_max_bs=4096)
    assert graph_top(explicit, 8192, device=h200) == (4096, "cuda_graph_max_bs", "cuda_graph_max_bs=4096")
    assert graph_max_bs(explicit, 8192, True, device=h200) == 4096 and count_batch_sizes(explicit, 8192) == 4 + 511
    assert graph_top(AttentionArgs(cuda_graph_bs=[3, 700]), 800, device=h200).bs == 700
    with pytest.raises(ConfigError) as e:  # still refused above max_reqs, as before
        graph_top(AttentionArgs(cuda_graph_max_bs=4096), 1024, device=h200)
    assert e.value.info.code == "invalid_value" and e.value.info.flags[0].name == "cuda_graph_max_bs"


def _series(top: int) -> list[int]:
    """sglang's 1, 2, 4, 8, 16, 24, … up to ``top``, written out differently from states.build_mode."""
    out, b = [], 1
    while b <= top and b < 16:
        out.append(b)
        b *= 2
    return out + [16 + 8 * i for i in range(max(0, (top - 16) // 8 + 1)) if top >= 16]


MEMS = st.sampled_from([0, 8 * GIB, 24 * GIB, 40 * GIB, 80 * GIB, 141 * 10 ** 9, 192 * GIB])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_reqs=st.integers(1, 3000), top=st.one_of(st.none(), st.integers(1, 3500)),
       bs=st.one_of(st.none(), st.lists(st.integers(1, 3500), min_size=1, max_size=5, unique=True)), mem=MEMS,
       world=st.integers(1, 8), cpu=st.booleans())
def test_one_rule_over_the_space(max_reqs, top, bs, mem, world, cpu):
    """count == len(list), graph_max_bs == the list's last, the text is its join, the list is sglang's series up to
    the top (the list when given; an explicit max kept; else min(max_reqs, default)); a refusal is the same
    refusal from every function."""
    device = DeviceFacts(type="cpu", total_memory_bytes=mem) if cpu else _cuda(mem)
    args, kw = AttentionArgs(cuda_graph_bs=bs, cuda_graph_max_bs=top), dict(device=device, world_size=world)
    calls = [lambda: capture_batch_sizes(args, max_reqs, **kw), lambda: count_batch_sizes(args, max_reqs, **kw),
             lambda: graph_max_bs(args, max_reqs, True, **kw), lambda: batch_sizes_text(args, max_reqs, **kw),
             lambda: graph_top(args, max_reqs, **kw)]
    refused = bool(bs and max(bs) > max_reqs) or bool(top and bs and top != max(bs)) or bool(top and top > max_reqs)
    if refused:
        codes = set()
        for call in calls:
            with pytest.raises(ConfigError) as e:
                call()
            codes.add((e.value.info.code, e.value.info.flags[0].name))
        assert len(codes) == 1
        return
    sizes = capture_batch_sizes(args, max_reqs, **kw)
    default = default_max_bs(device, world)[0]
    want = sorted(set(bs)) if bs else _series(top or min(max_reqs, default))
    assert sizes == want
    assert count_batch_sizes(args, max_reqs, **kw) == len(sizes)
    assert graph_max_bs(args, max_reqs, True, **kw) == sizes[-1]
    assert graph_max_bs(args, max_reqs, False, **kw) == 0
    assert batch_sizes_text(args, max_reqs, **kw) == ",".join(map(str, sizes))
    assert max(sizes) <= max_reqs and (bs or top or max(sizes) <= default)


def test_huge_explicit_top_is_counted_not_listed():
    args = AttentionArgs(cuda_graph_max_bs=2 ** 31 - 1)
    n = count_batch_sizes(args, 2 ** 31 - 1)
    assert n == 4 + (2 ** 31 - 8 - 16) // 8 + 1
    assert batch_sizes_text(args, 2 ** 31 - 1) == f"1,2,4,8,16..{2 ** 31 - 8} step 8 ({n} sizes)"


def _plan(*argv: str) -> tuple[int, dict]:
    from conftest import run_main

    proc = run_main("plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer", *argv, "--json")
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_plan_says_where_the_top_came_from():
    """A million requests on an H200 capture sglang's 35 sizes up to 256 (the series used to run to max_reqs: a
    plan that took minutes and a workspace the device cannot hold); an explicit top is shown as given."""
    rc, out = _plan("--max-reqs", "1000000")
    g = out["cuda_graphs"]
    assert rc == 0 and g["max_bs"] == 256 and g["count"] == 35 and g["batch_sizes"] == _series(256)
    assert g["max_bs_source"] == "default" and g["max_bs_from"] == "default for 131 GiB: 256 (sglang's rule)"
    assert out["cuda_graph_estimate"]["batch_sizes"] == _series(256)
    rc, out = _plan("--max-reqs", "64")
    assert rc == 0 and out["cuda_graphs"]["max_bs"] == 64 and out["cuda_graphs"]["max_bs_source"] == "max_reqs"
    rc, out = _plan("--max-reqs", "1024", "--cuda-graph-max-bs", "1000")
    g = out["cuda_graphs"]
    assert rc == 0 and g["max_bs"] == 1000 and g["max_bs_from"] == "cuda_graph_max_bs=1000"
    rc, out = _plan("--device-profile", "cpu", "--max-reqs", "8")
    assert rc == 0 and out["cuda_graphs"]["capture"] is False and out["cuda_graphs"]["max_bs_from"] is None


def test_plan_text_names_the_default():
    from conftest import run_main

    proc = run_main("plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer", "--max-reqs",
                    "65536")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    assert "(35 sizes, largest 256); top: default for 131 GiB: 256 (sglang's rule)" in text


def _plan_on_h200(argv: list[str], installed: bool) -> tuple[int, dict]:
    """``plan --json`` on the h200 profile, with FlashInfer and Triton assumed installed or the default packages."""
    import json

    from conftest import run_main

    if installed:
        return plan(argv)
    proc = run_main("plan", "--json", "--device-profile", "h200", *argv)
    return proc.returncode, json.loads(proc.stdout)


def _measured(argv: list[str], installed: bool) -> tuple[int, dict, float, int]:
    """:func:`_plan`'s exit code and JSON, its seconds (untraced) and tracemalloc's peak bytes (a second call)."""
    t0 = time.perf_counter()
    rc, out = _plan_on_h200(argv, installed)
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    try:
        assert _plan_on_h200(argv, installed) == (rc, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return rc, out, seconds, peak


@pytest.mark.parametrize("top", ["100000000", "2147483647"])
@pytest.mark.parametrize("installed", [False, True])
def test_plan_refuses_a_huge_top_in_seconds_and_bounded_memory(monkeypatch, installed, top):
    """The finding: ``--max-reqs 2147483647 --cuda-graph-max-bs 2147483647`` built ~268M batch sizes (10+ GB) in the
    graphs' lower bound (at 1e8: 4.2 s and 1.3 GB); now refused in seconds with a peak under 200 MB — the pools'
    refusal with the default packages, FlashInfer's workspace with it installed —, and every alternative of the
    remedy then plans ok."""
    argv = ["--max-reqs", top, "--cuda-graph-max-bs", top]
    rc, out, seconds, peak = _measured(argv, installed)
    assert seconds < 5 and peak < 200 * 2**20, (seconds, peak)
    err = out["error"]
    assert rc == 3 and err["code"] == ("workspace_too_small" if installed else "pool_exceeds_memory"), err
    assert "--cuda-graph-max-bs 8192" in err["remedy"], err["remedy"]
    if installed:
        assert len(follow_every_alternative(argv, err["remedy"], monkeypatch)) == 1
        return
    assert err["state"] == "init-memory-pool" and "--disable-cuda-graph" in err["remedy"], err
    assert err["remedy"].split(", or ") == [
        "lower --max-reqs (at most 11865653 rows at this context length) and set --cuda-graph-max-bs 8192",
        "lower --max-reqs (at most 29301301 rows at this context length) and set --disable-cuda-graph"], err["remedy"]
    for fixed in (["--max-reqs", "11865653", "--cuda-graph-max-bs", "8192"],
                  ["--max-reqs", "29301301", "--disable-cuda-graph"]):
        rc, out = _plan_on_h200(fixed, False)
        assert rc == 0 and out["ok"], out


def test_the_series_is_never_listed_and_agrees_with_the_list():
    """:class:`BatchSeries`: length, indexing, bisection and sum in O(1), equal to the listed series."""
    import bisect

    from pipeline.memory.pools import remedy_tops
    from states.build_mode import BatchSeries, series_sum

    for top in (1, 3, 8, 15, 16, 17, 24, 1000):
        listed = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 8))
        s = BatchSeries(top)
        assert list(s) == listed and len(s) == len(listed) and series_sum(s) == sum(listed)
        assert [s[i] for i in range(-len(s), len(s))] == listed * 2 and s[:3] == listed[:3]
        assert remedy_tops(s) == listed[:-1]
    huge = BatchSeries(2**31 - 1)
    assert len(huge) == 268435458 and huge[-1] == 2147483640 and huge[4] == 16
    assert series_sum(huge) == 15 + 268435454 * (16 + 2147483640) // 2
    assert bisect.bisect_left(huge, 8193) == 1027 and remedy_tops(huge)[-1] == 8192
