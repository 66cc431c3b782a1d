"""The decode CUDA-graph memory estimate (pipeline.memory.graphs), the plan field and the runner's pool sizing.

The estimate's accuracy is a GPU claim (benchmarks/graph_memory.py against torch.cuda.memory_snapshot()); here
the properties that hold whatever the device: the allocator model keeps the caching allocator's documented rules,
the estimate moves as the rules say it must, the backend's own allocations come from its registry entry, and the
runner takes exactly the estimate out of a --mem-fraction budget, the same number plan shows.
"""

from __future__ import annotations

import json

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings

from conftest import CONFIGS, cuda_facts
from pipeline.backends import registry
from pipeline.backends.capability import BackendRules, decode_output_only
from pipeline.cli import main
from pipeline.cli.plan import plan_report
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.memory.pools import check_fits, size_pools
from pipeline.core.spec import attention_layer_ids, truncate_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.runtime.runner import Runner, RunnerConfig
from pipeline.memory.allocator import PoolModel, blas_workspace_bytes
from pipeline.memory.graphs import estimate_graph_memory
from states.build_mode import capture_batch_sizes

MiB = 1 << 20
ALL = {"torch": True, "triton": True, "flashinfer-python": True}
BUNDLED = sorted(p.stem for p in CONFIGS.glob("*.json"))


def _spec(name, layers=2):
    full = load_model_spec(CONFIGS / f"{name}.json")
    return truncate_spec(full, min(layers, len(attention_layer_ids(full))))


def _est(spec, sizes, backend="triton", dtype="bfloat16", kv="bfloat16", arch="sm90", **kw):
    return estimate_graph_memory(spec, dtype=dtype, kv_dtype=kv, decode_backend=backend, batch_sizes=sizes,
                                 arch=arch, env={}, **kw)


# -- the allocator model: PyTorch's CUDACachingAllocator constants and block policy ----------------------------
def test_allocator_segment_rules():
    assert [PoolModel.round_size(n) for n in (1, 512, 513, 1025)] == [512, 512, 1024, 1536]
    assert PoolModel.segment_size(512) == 2 * MiB and PoolModel.segment_size(MiB) == 2 * MiB          # small
    assert PoolModel.segment_size(MiB + 512) == 20 * MiB and PoolModel.segment_size(10 * MiB - 512) == 20 * MiB
    assert PoolModel.segment_size(10 * MiB) == 10 * MiB and PoolModel.segment_size(11 * MiB) == 12 * MiB
    p = PoolModel()
    blocks = [p.malloc(512) for _ in range(4096)]       # 4096 x 512 B fill one 2 MiB small segment exactly
    assert p.reserved == 2 * MiB
    p.malloc(1)
    assert p.reserved == 4 * MiB
    big = p.malloc(3 * MiB)                              # a mid-size request takes a 20 MiB segment …
    assert p.reserved == 24 * MiB
    p.malloc(5 * MiB)                                    # … whose rest serves the next one
    assert p.reserved == 24 * MiB
    p.free(big)
    p.malloc(3 * MiB)                                    # a freed block is reused
    assert p.reserved == 24 * MiB
    for b in blocks[:2]:
        p.free(b)
    p.malloc(1024)                                       # two freed neighbours merged into one 1 KiB block
    assert p.reserved == 24 * MiB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 24 * MiB)), min_size=1, max_size=60))
def test_allocator_invariants(ops):
    """Random malloc/free sequences: reserved only grows, in legal segment sizes, and holds every live byte; once
    everything is freed each segment is one free block again (neighbours always merge)."""
    p, live, seen = PoolModel(), [], 0
    for is_free, n in ops:
        if is_free and live:
            p.free(live.pop(n % len(live))[0])
        else:
            live.append((p.malloc(n), PoolModel.round_size(n)))
        assert p.reserved >= seen and p.reserved >= sum(s for _, s in live) and p.reserved % (2 * MiB) == 0
        seen = p.reserved
    for b, _ in live:
        p.free(b)
    segs = {seg for seg, _ in p._blocks}
    assert all(free for _, _, free in p._blocks.values()) and len(p._blocks) == len(segs)


# -- the estimate ---------------------------------------------------------------------------------------------
def test_blas_workspace_follows_pytorchs_rule():
    assert blas_workspace_bytes("sm90", {}) == 32 * MiB
    assert blas_workspace_bytes("sm80", {}) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert blas_workspace_bytes("sm80", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB
    assert blas_workspace_bytes("sm90", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    spec = _spec("llama-3.1-8b")
    a = estimate_graph_memory(spec, dtype="bfloat16", kv_dtype="bfloat16", decode_backend="triton",
                              batch_sizes=[1, 8], arch="sm80", env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert a == _est(spec, [1, 8])  # the workspace is the only arch-dependent term


@pytest.mark.parametrize("name", BUNDLED)
@pytest.mark.parametrize("backend,dtype,kv", [("triton", "bfloat16", "bfloat16"), ("flashinfer", "bfloat16", "fp8_e4m3"),
                                              ("fa3", "float16", "float16"), ("triton", "float32", "float32")])
def test_estimate_structure_on_every_bundled_model(name, backend, dtype, kv):
    """For sglang's series up to 8, 32 and 256: the pool is what the captures add up to, the total its parts, in
    whole 2 MiB units, the warm-up stream holds the cuBLAS workspace, every capture adds >= 0, and a larger
    cuda_graph_max_bs never estimates less."""
    spec, prev = _spec(name), 0
    for top in (8, 32, 256):
        sizes = capture_batch_sizes(AttentionArgs(), top)
        e = _est(spec, sizes, backend, dtype, kv)
        assert e.pool_bytes == sum(e.per_bs.values()) and e.total_bytes % (2 * MiB) == 0
        assert e.total_bytes == e.pool_bytes + e.state_bytes + e.warmup_bytes
        assert e.batch_sizes == sizes and e.num_layers == spec.num_hidden_layers and min(e.per_bs.values()) >= 0
        # every graph keeps its output (the float32 residual stream [bs, hidden]) allocated in the pool
        assert e.pool_bytes >= sum(b * spec.hidden_size * 4 for b in sizes)
        assert e.warmup_bytes >= e.blas_workspace_bytes == 32 * MiB
        assert e.total_bytes >= prev
        prev = e.total_bytes
    assert _est(spec, []).total_bytes == 0


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(2, 300), min_size=1, max_size=6), st.sampled_from(["llama-3.1-8b", "deepseek-v2-lite",
                                                                             "gemma-2-9b", "gpt-oss-20b"]))
def test_a_smaller_size_captured_last_only_adds(sizes, name):
    """Captured largest first into one pool: adding a size below the others replays the same captures first, so
    their bytes are unchanged and the total can only grow."""
    spec = _spec(name)
    base, more = _est(spec, sorted(sizes)), _est(spec, sorted(sizes) + [1])
    assert {b: more.per_bs[b] for b in sizes} == base.per_bs and more.pool_bytes >= base.pool_bytes


def test_aux_states_kept_by_the_graph_never_cost_less():
    spec, sizes = _spec("llama-3.1-8b"), capture_batch_sizes(AttentionArgs(), 256)
    plain = _est(spec, sizes).pool_bytes
    assert _est(spec, sizes, aux_layers=[0, 1]).pool_bytes >= plain


def test_the_backends_own_allocations_come_from_its_registry_entry():
    """A backend whose decode also allocates a 64 MiB scratch inside the capture: the estimate grows, by at most
    that block (it is freed and reused by what follows)."""
    base = registry.get("triton")
    extra = lambda kind, bs, q: [(64 * MiB, False), *decode_output_only(kind, bs, q)]  # noqa: E731
    registry.register("triton_scratch_test", base.capability, base.factory, BackendRules(graph_decode_allocs=extra))
    try:
        spec, sizes = _spec("qwen3-8b"), [1, 2, 4, 8]
        a, b = _est(spec, sizes, "triton"), _est(spec, sizes, "triton_scratch_test")
        assert a.pool_bytes < b.pool_bytes <= a.pool_bytes + 64 * MiB
    finally:
        registry._REGISTRY.pop("triton_scratch_test")


# -- plan and run: the same number, and exactly that number out of the budget ---------------------------------
def _runner(spec, args, mem_fraction, free=None):
    req = SetupRequest(args=args, model=spec, device="cuda:0",
                       pool=PoolFacts(max_reqs=32, max_context_len=256, num_token_slots=4096, page_size=16))
    plat = FakePlatform(cuda_facts(), free_bytes=free)
    r = Runner(RunnerConfig(request=req, num_layers=1, mem_fraction=mem_fraction), platform=plat, installed=ALL)
    r.init_distributed(), r.load_model(), r.init_memory_pool()
    return r, next(x for x in r.log.records if isinstance(x, ev.MemoryPoolSized))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v2-lite"])
def test_runner_takes_exactly_the_estimate_out_of_the_budget_and_plan_agrees(name):
    spec = load_model_spec(CONFIGS / f"{name}.json")
    args = AttentionArgs(page_size=16)
    total = cuda_facts().total_memory_bytes
    r, rec = _runner(spec, args, 0.001)
    want = estimate_graph_memory(truncate_spec(spec, 1), dtype="bfloat16", kv_dtype="bfloat16",
                                 decode_backend="flashinfer", batch_sizes=capture_batch_sizes(args, 32), arch="sm90",
                                 max_context_len=256, page_size=16, num_sms=132)
    assert rec.graph_bytes_estimate == want.total_bytes > 32 * MiB
    assert rec.budget_bytes == int(0.001 * total) - want.total_bytes
    assert rec.num_token_slots == (rec.budget_bytes - rec.req_to_token_bytes) // rec.bytes_per_token // 16 * 16
    r.close()
    off, rec0 = _runner(spec, msgspec.structs.replace(args, disable_cuda_graph=True), 0.001)
    assert rec0.graph_bytes_estimate == 0 and rec0.budget_bytes - rec.budget_bytes == want.total_bytes
    off.close()
    req = SetupRequest(args=args, model=spec, device="cuda:0",
                       pool=PoolFacts(max_reqs=32, max_context_len=256, num_token_slots=4096, page_size=16))
    report = plan_report(req, cuda_facts(), ALL, num_layers=1)
    assert report["cuda_graph_bytes_estimate"] == want.total_bytes
    assert report["cuda_graph_estimate"]["per_bs"] == {str(b): v for b, v in sorted(want.per_bs.items(), reverse=True)}


@pytest.mark.parametrize("disable", [False, True])
def test_capture_costs_are_paid_before_the_budget_is_read_and_only_when_graphs_are_captured(disable):
    """init-memory-pool primes the process's one-time capture costs (stream pool, graph machinery: ~160 MiB outside
    the allocator on the H200) before its first free-memory read, so the budget excludes them; never without graphs."""
    req = SetupRequest(args=AttentionArgs(page_size=16, disable_cuda_graph=disable), model=_spec("llama-3.1-8b"),
                       device="cuda:0", pool=PoolFacts(max_reqs=32, max_context_len=256, page_size=16))
    plat = FakePlatform(cuda_facts(), free_bytes=64 << 30)
    r = Runner(RunnerConfig(request=req, num_layers=1, mem_fraction=0.001), platform=plat, installed=ALL)
    r.init_distributed(), r.load_model()
    plat.calls.clear()
    r.init_memory_pool()
    calls = [name for name, _ in plat.calls if name in ("prime_graph_capture", "memory_available")]
    r.close()
    # the last read is the budget's (size_for's check against free memory); the estimate's setup decision reads
    # memory before it, which is why the prime sits between them
    assert calls[-1] == "memory_available" and calls.count("prime_graph_capture") == (0 if disable else 1), calls
    assert disable or calls.index("prime_graph_capture") == len(calls) - 2, calls


def test_the_prime_paid_in_preflight_is_the_one_the_capture_event_reports():
    """``run`` preflights (every step's decision, init-memory-pool's included) before initialize(): the bytes paid
    there reach ``cuda_graph_memory.prime_device_bytes``, not the 0 of the second, already-paid call."""
    from pipeline.runtime.table import decide_pools

    req = SetupRequest(args=AttentionArgs(page_size=16), model=_spec("llama-3.1-8b"), device="cuda:0",
                       pool=PoolFacts(max_reqs=32, max_context_len=256, page_size=16))
    plat = FakePlatform(cuda_facts(), free_bytes=64 << 30, prime_bytes=70 * MiB)
    r = Runner(RunnerConfig(request=req, num_layers=1, mem_fraction=0.001), platform=plat, installed=ALL)
    r.init_distributed(), r.load_model()
    decide_pools(r), decide_pools(r)
    r.close()
    assert plat.called("prime_graph_capture") == [(0,), (0,)]
    assert r.capture_prime_bytes == 70 * MiB


def test_plan_json_and_text_show_the_estimate(capsys):
    base = ["plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer-python", "--max-reqs", "32"]
    assert main([*base, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = estimate_graph_memory(_spec("llama-3.1-8b"), dtype="bfloat16", kv_dtype="bfloat16",
                                 decode_backend=out["resolved"]["decode"],
                                 batch_sizes=capture_batch_sizes(AttentionArgs(), 32), arch="sm90",
                                 max_context_len=1024, page_size=1, num_sms=out["device"]["sm_count"])
    assert out["cuda_graph_bytes_estimate"] == want.total_bytes and out["cuda_graph_estimate"]["num_layers"] == 2
    assert main([*base, "--json", "--disable-cuda-graph"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["cuda_graph_bytes_estimate"] == 0 and off["cuda_graph_estimate"] is None
    assert main(["plan", "--device-profile", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cuda_graph_bytes_estimate"] == 0
    assert main(base) == 0
    text = " ".join(capsys.readouterr().out.split())  # lines wrap at words to the console's width
    assert f"decode CUDA graphs: {want.total_bytes / MiB:.1f} MiB estimated for bs 1..32 (7 sizes) over 2 attention " \
        "layers (layers 0-1)" in text


def test_pools_and_graphs_must_fit_together_and_the_remedy_fits():
    kinds = _spec("llama-3.1-8b").layer_kinds()
    kw = dict(page_size=16, max_reqs=8, max_context_len=1024)
    reserve, avail = 40 * MiB, 1 << 30
    limit = int(avail * 0.9)
    fits_alone = (limit - 8 * 1024 * 4) // (2 * 8 * 128 * 2 * 2) // 16 * 16   # slots that fit without graphs
    s = size_pools(kinds, 2, "bfloat16", num_token_slots=fits_alone, graph_reserve_bytes=reserve, **kw)
    check_fits(msgspec.structs.replace(s, graph_reserve_bytes=0), avail, device="cuda:0")
    with pytest.raises(ConfigError) as ei:
        check_fits(s, avail, device="cuda:0")
    assert ei.value.info.code == "pool_exceeds_memory" and "decode CUDA graphs" in ei.value.info.message
    slots = int(ei.value.info.remedy.split()[2])  # "pass --num-token-slots N or fewer"
    check_fits(size_pools(kinds, 2, "bfloat16", num_token_slots=slots, graph_reserve_bytes=reserve, **kw), avail,
               device="cuda:0")
    s = size_pools(kinds, 2, "bfloat16", budget_bytes=limit, source="bytes", graph_reserve_bytes=reserve, **kw)
    assert s.budget_bytes == limit  # an explicit --mem-bytes is kept as given …
    with pytest.raises(ConfigError) as ei:
        check_fits(s, avail, device="cuda:0")
    mem = int(ei.value.info.remedy.split()[2])   # "pass --mem-bytes N or less": … and the remedy's value fits with the graphs
    check_fits(size_pools(kinds, 2, "bfloat16", budget_bytes=mem, source="bytes", graph_reserve_bytes=reserve, **kw),
               avail, device="cuda:0")


# -- against a recorded GPU measure, and the backends' constants ------------------------------------------------
PROBE = json.loads((CONFIGS.parent.parent / "tests" / "data" / "graph_probe_h200.json").read_text())


@pytest.mark.parametrize("run", PROBE["runs"], ids=[r["name"] for r in PROBE["runs"]])
def test_pool_estimate_equals_the_h200_probe_per_size(run):
    """The graph pool the H200 measured for 8 configurations (tests/data/graph_probe_h200.json, recorded before this
    estimate was compared with it; no constant taken from it): the same bytes, added by the same sizes."""
    from pipeline.core.model_spec import layers_covering_every_kind

    full = load_model_spec(CONFIGS / f"{run['model']}.json")
    spec = truncate_spec(full, max(layers_covering_every_kind(full, 2), 1))
    args = AttentionArgs(cuda_graph_bs=run["cuda_graph_bs"])
    e = _est(spec, capture_batch_sizes(args, run["max_reqs"]), "flashinfer", max_context_len=1024, page_size=1,
             num_sms=132)
    assert {str(b): v for b, v in e.per_bs.items()} == run["graph_pool_added"]


def test_flashinfer_state_is_its_buffers_and_one_wrapper_per_size_and_kind():
    from pipeline.backends.flashinfer.rules import FI_INT_WORKSPACE_BYTES

    gemma = _spec("gemma-2-9b")  # a sliding and a full kind: two wrappers per size
    kinds = gemma.layer_kinds()
    allocs = registry.get("flashinfer").graph_state_allocs(kinds, [1, 2, 4, 8], max_context_len=1024, page_size=16,
                                                         num_sms=132)
    assert [n for b, n in allocs if b == 0] == [9 * 4, 8 * 64 * 4, 8 * 4, 9 * 4, 8 * 4]
    for bs in (1, 2, 4, 8):
        assert [n for b, n in allocs if b == bs].count(FI_INT_WORKSPACE_BYTES) == len(kinds) == 2
    assert registry.get("torch_native").graph_state_allocs(kinds, [8], max_context_len=64, page_size=1,
                                                           num_sms=1) == []


def test_triton_rule_constants_match_its_launchers():
    pytest.importorskip("triton")
    from pipeline.backends import records
    from pipeline.backends.triton import launch, launch_mla

    assert records.TRITON_PROGRAMS_PER_SM == launch.DecodeConfig().programs_per_sm
    assert records._MLA_BLOCK_H == launch_mla.MLADecodeConfig().block_h
    kind = _spec("llama-3.1-8b").layer_kinds()[0]
    (_, req), (_, seq), (_, scratch) = records.triton_graph_state_allocs([kind], [1, 8], max_context_len=64,
                                                                        page_size=1, num_sms=132)
    cfg = launch.DecodeConfig()
    exact = max(launch.decode_scratch_numel(b, kind.num_heads, kind.head_dim_v,
                                            launch.decode_max_splits(b, kind.num_kv_heads, 132, cfg))
                for b in range(1, 9))
    assert (req, seq) == (64, 32) and exact * 4 <= scratch   # a bound of what init_cuda_graph_state allocates


def test_run_prints_the_capture_step_against_the_estimate():
    from pipeline.cli.run import _graph_line, _pool_line

    mem = ev.CudaGraphMemory(ts_ns=1, run_id="r", rank=0, state="capture-cuda-graphs", backend="flashinfer",
                             batch_sizes=[1, 2, 4, 8], pool_estimate=2 * MiB, state_estimate=42 * MiB,
                             warmup_estimate=34 * MiB, blas_workspace_bytes=32 * MiB, total_estimate=78 * MiB,
                             pool_bytes=2 * MiB, step_device_bytes=60 * MiB)
    assert wire.decode_line(wire.encode(mem)) == mem   # the wire form round-trips
    # kept = 78 - (34 - 32): the warm-up's temporaries are given back before each capture, its cuBLAS workspace not
    assert mem.kept_estimate == 76 * MiB
    assert _graph_line([mem]) == ("CUDA graphs: 4 sizes captured, graph pool 2.0 MiB (estimated 2.0 MiB), capture "
                                  "step took 60.0 MiB of the device (estimated 76.0 MiB kept, 78.0 MiB at its peak)")
    primed = msgspec.structs.replace(mem, prime_device_bytes=96 * MiB)
    assert wire.decode_line(wire.encode(primed)) == primed
    assert _graph_line([primed]).endswith(", after 96.0 MiB of one-time capture setup before the pools were sized")
    assert _graph_line([]) is None
    sized = ev.MemoryPoolSized(ts_ns=1, run_id="r", rank=0, state="init-memory-pool", source="mem_fraction", budget_bytes=1,
                               bytes_per_token=1, num_token_slots=1, max_reqs=1, max_context_len=1, page_size=1,
                               req_to_token_bytes=4, kv_bytes=1, graph_bytes_estimate=78 * MiB)
    assert _pool_line([sized]).endswith("; decode CUDA graphs 78.0 MiB estimated, kept out of the budget")
