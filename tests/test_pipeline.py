"""The pipeline end to end through the library entry point: modes, hybrid, draft override, refusals."""

from __future__ import annotations

import msgspec
import pytest
import torch

from conftest import cuda_facts
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.backends import registry
from pipeline.backends.records import TORCH_NATIVE
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, SetupRequest
from pipeline.core.errors import BackendUnknown, CapabilityMismatch, ConflictingOptions
from pipeline.platforms.fake import FakePlatform
from spies import spy_hybrid, spy_tbo

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}


def _req(model, pool, **args):
    extra = {k: args.pop(k) for k in ("is_draft_worker", "device", "draft_model") if k in args}
    return SetupRequest(args=AttentionArgs(**args), model=model, pool=pool, device=extra.pop("device", "cpu"), **extra)


def _build(req, platform=None):
    return build_attention_backends(req, platform=platform, installed=INSTALLED)


def _states(records):
    return [r.from_state for r in records if isinstance(r, ev.StateTransition)] + [
        [r.to for r in records if isinstance(r, ev.StateTransition)][-1]]


def test_normal_mode_reaches_done_with_annotated_names(llama, small_pool):
    """CPU, no flags: one torch_native backend, six states in order, names on the backend object."""
    with _build(_req(llama, small_pool)) as out:
        assert _states(out.events) == ["device-init", "resolve", "build-mode", "npu-lazy-mem", "annotate", "done"]
        assert out.plan.mode.value == "normal" and not out.plan.hybrid
        assert out.attn_backend is out.instances["primary"]
        assert out.attn_backend.prefill_attention_backend_str == "torch_native"
        assert out.decode_attn_backend is None and out.decode_attn_backend_group == []
        assert out.resolution.rules == {"prefill": "auto", "decode": "auto"}


def test_tbo_builds_primary_and_two_children_of_one_factory(llama, small_pool):
    """TBO: three distinct instances of the same backend on the shared workspace, wrapper annotated."""
    with _build(_req(llama, small_pool, enable_two_batch_overlap=True, moe_a2a_backend="deepep")) as out:
        roles = [i.role for i in out.plan.instances]
        assert roles == ["tbo.primary", "tbo.child0", "tbo.child1"]
        objs = [out.instances[r] for r in roles]
        assert len({id(o) for o in objs}) == 3 and {type(o) for o in objs} == {type(objs[0])}
        top = out.attn_backend
        assert top.primary is objs[0] and top.children == objs[1:]
        assert top.decode_attention_backend_str == "torch_native"
        assert [w.id for w in out.plan.workspaces] == ["ws-shared"]


def test_tbo_children_serve_one_half_each_and_match_normal_mode(llama, small_pool):
    """Each TBO child serves exactly its half of the requests; the wrapper passes verification."""
    from pipeline.runtime.verify import verify_backend

    with _build(_req(llama, small_pool, enable_two_batch_overlap=True, moe_a2a_backend="deepep")) as out:
        top = out.attn_backend
        journal = spy_tbo(top)
        res = verify_backend(top, role="tbo", name="tbo", model=llama, req_to_token_pool=out.pools["req_to_token_pool"],
                             kv_pool=out.pools["kv_pool"], torch_device="cpu", dtype="bfloat16", decode_steps=1)
        assert res.passed, res
        fwd = [c for c in journal if c.method == "forward" and c.role != "primary"]
        for mode in ("extend", "decode"):
            rows0 = {c.rows for c in fwd if c.role == "tbo_child_0" and c.forward_mode == mode}
            rows1 = {c.rows for c in fwd if c.role == "tbo_child_1" and c.forward_mode == mode}
            assert rows0 and rows1
            for r0 in rows0:
                for r1 in rows1:
                    assert not set(r0) & set(r1)


@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_pdmux_one_private_and_one_shared_workspace_for_any_n(llama, small_pool, n):
    """PD-mux: prefill on a private workspace, N decode backends all on one shared buffer object."""
    plat = FakePlatform(cuda_facts())
    with _build(_req(llama, small_pool, enable_pdmux=True, sm_group_num=n, device="cuda"), plat) as out:
        ws = out.plan.workspaces
        assert [w.id for w in ws] == ["ws-private-pdmux.prefill", "ws-shared"]
        assert ws[1].shared_by == [f"pdmux.decode{i}" for i in range(n)]
        assert len(out.decode_attn_backend_group) == n
        assert out.decode_attn_backend is out.decode_attn_backend_group[0]
        pool = out.workspace_pool
        assert pool.get("ws-shared") is not pool.get("ws-private-pdmux.prefill")
        assert len({id(w) for w in pool.workspaces}) == 2


def test_hybrid_routes_extend_and_decode_to_different_backends(llama, small_pool, monkeypatch):
    """prefill ≠ decode: both halves are plan instances and the wrapper routes by forward mode."""
    monkeypatch.setitem(registry._REGISTRY, "torch_native_b", registry.BackendEntry(
        "torch_native_b", TORCH_NATIVE, "pipeline.backends.torch_native:create"))
    from pipeline.runtime.verify import verify_backend

    req = _req(llama, small_pool, prefill_attention_backend="torch_native", decode_attention_backend="torch_native_b")
    with _build(req) as out:
        assert out.plan.hybrid and [i.role for i in out.plan.instances] == ["primary.prefill", "primary.decode"]
        top = out.attn_backend
        journal = spy_hybrid(top)
        res = verify_backend(top, role="hybrid", name="hybrid", model=llama, req_to_token_pool=out.pools["req_to_token_pool"],
                             kv_pool=out.pools["kv_pool"], torch_device="cpu", dtype="bfloat16", decode_steps=1)
        assert res.passed
        routes = {(c.role, c.forward_mode) for c in journal}
        assert routes == {("prefill", "extend"), ("decode", "decode")}


def test_draft_override_serves_both_halves(llama, small_pool):
    """A draft worker with speculative_draft_attention_backend uses it for both halves (is_draft_override)."""
    req = _req(llama, small_pool, attention_backend="torch_native", prefill_attention_backend="nope",
               speculative_draft_attention_backend="torch_native", speculative_algorithm="EAGLE", is_draft_worker=True)
    with _build(req) as out:
        assert out.resolution.pair.is_draft_override
        assert out.resolution.rules == {"prefill": "draft_override", "decode": "draft_override"}


def test_reviewers_none_case_reads_only_resolved_strings(llama, small_pool):
    """attention_backend=None with both phase flags set resolves from the phase flags (no 'Invalid … None')."""
    req = _req(llama, small_pool, prefill_attention_backend="torch_native", decode_attention_backend="torch_native")
    with _build(req) as out:
        assert out.prefill_attention_backend_str == out.decode_attention_backend_str == "torch_native"
        assert out.resolution.rules == {"prefill": "phase_flag", "decode": "phase_flag"}


def test_only_decode_flag_leaves_prefill_to_auto(llama, small_pool):
    """Only decode_attention_backend set: prefill comes from auto-selection, recorded as such."""
    with _build(_req(llama, small_pool, decode_attention_backend="torch_native")) as out:
        assert out.resolution.rules == {"prefill": "auto", "decode": "phase_flag"}


def _assert_refused_before_allocation(exc_info, records_holder):
    recs = records_holder
    assert not any(isinstance(r, ev.BackendBuilt) for r in recs)
    failed = [r for r in recs if isinstance(r, ev.RunFailed)]
    assert len(failed) == 1 and failed[0].error == exc_info.value.info


def test_pdmux_with_tbo_is_refused_before_anything_is_allocated(llama, small_pool):
    """PD-mux + TBO: ConflictingOptions naming both flags, exit code 3, no backend built."""
    from pipeline.core.eventlog import EventLog

    log = EventLog("t", 0)
    with pytest.raises(ConflictingOptions) as ei:
        build_attention_backends(_req(llama, small_pool, enable_pdmux=True, enable_two_batch_overlap=True,
                                      device="cuda"), platform=FakePlatform(cuda_facts()), installed=INSTALLED, log=log)
    assert {f.name for f in ei.value.info.flags} == {"enable_pdmux", "enable_two_batch_overlap"}
    assert ei.value.exit_code == 3 and ei.value.info.state == "resolve"
    _assert_refused_before_allocation(ei, log.records)


def test_pdmux_on_cpu_is_refused(llama, small_pool):
    """PD-mux partitions GPU SMs: on a CPU device it is refused at resolve."""
    with pytest.raises(CapabilityMismatch) as ei:
        _build(_req(llama, small_pool, enable_pdmux=True))
    assert ei.value.info.state == "resolve" and "CPU" in ei.value.info.message


def test_tbo_on_draft_worker_is_a_recorded_downgrade(llama, small_pool):
    """TBO on a draft worker: normal mode plus a feature_downgraded warning and a skip entry."""
    req = _req(llama, small_pool, enable_two_batch_overlap=True, moe_a2a_backend="deepep", speculative_algorithm="EAGLE",
               is_draft_worker=True)
    with _build(req) as out:
        assert out.plan.mode.value == "normal"
        downs = [r for r in out.events if isinstance(r, ev.FeatureDowngraded)]
        assert any(d.what == "two_batch_overlap" for d in downs)
        assert any(s.what == "two_batch_overlap" for s in out.skips)


def test_unknown_backend_lists_the_registered_ones(llama, small_pool):
    """An unknown name is refused at resolve with the registered names as allowed values."""
    with pytest.raises(BackendUnknown) as ei:
        _build(_req(llama, small_pool, attention_backend="flashattn9"))
    assert "torch_native" in ei.value.info.allowed
    assert ei.value.info.flags[0].name == "attention_backend"


STATE_FUNCS = [("device-init", "states.device_init", "decide_blas"), ("resolve", "states.resolve", "decide"),
               ("build-mode", "pipeline.setup.instances", "build_instances"),
               ("npu-lazy-mem", "states.npu_lazy_mem", "decide"), ("annotate", "states.annotate", "set_names")]


@pytest.mark.parametrize("state,module,func", STATE_FUNCS)
def test_failure_in_each_state_is_logged_released_and_retryable(llama, small_pool, monkeypatch, state, module, func):
    """An exception in any state: failed, one ErrorInfo naming the state, nothing kept; a new run succeeds."""
    import importlib
    import weakref

    from pipeline.core.eventlog import EventLog

    mod = importlib.import_module(module)
    refs = []
    real = getattr(mod, func)

    def boom(*a, **k):
        if module == "pipeline.setup.instances":
            real(*a, **k)
            refs.extend(weakref.ref(b) for b in a[2].instances.values())
        raise RuntimeError(f"injected in {state}")

    monkeypatch.setattr(mod, func, boom)
    log = EventLog("t", 0)
    with pytest.raises(RuntimeError):
        build_attention_backends(_req(llama, small_pool), installed=INSTALLED, log=log)
    failed = [r for r in log.records if isinstance(r, ev.RunFailed)]
    assert len(failed) == 1 and failed[0].error.state == state and "injected" in failed[0].error.message
    assert [r.to for r in log.records if isinstance(r, ev.StateTransition)][-1] == "failed"
    if module == "pipeline.setup.instances":
        assert "backend:primary" in failed[0].released and refs
        import gc

        gc.collect()
        assert all(r() is None for r in refs)
    monkeypatch.undo()
    with _build(_req(llama, small_pool)) as out:
        assert out.attn_backend is not None


def test_close_releases_buffers(llama, small_pool):
    """close() drops pools and workspaces: weak references to the KV buffers die."""
    import gc
    import weakref

    out = _build(_req(llama, small_pool))
    ref = weakref.ref(out.pools["kv_pool"].k_buffer[0])
    released = out.close()
    assert "pool:kv_pool" in released and "backend:primary" in released
    gc.collect()
    assert ref() is None
    assert out.close() == []


def test_events_round_trip_through_json(llama, small_pool):
    """Every record a run emits decodes back to an equal typed record."""
    with _build(_req(llama, small_pool, enable_two_batch_overlap=True, moe_a2a_backend="deepep")) as out:
        for rec in out.events:
            assert wire.decode_line(wire.encode(rec)) == rec


def test_flashinfer_workspace_too_small_is_refused_in_build_mode_before_allocation(llama, small_pool):
    """A flashinfer_workspace_size below the planned need fails build-mode naming the field and bytes."""
    from pipeline.backends.flashinfer import rules as sizing
    from pipeline.core.errors import ConfigError
    from pipeline.core.eventlog import EventLog

    log = EventLog("t", 0)
    req = _req(llama, small_pool, attention_backend="flashinfer", flashinfer_workspace_size=1 << 20, device="cuda")
    with pytest.raises(ConfigError) as ei:
        build_attention_backends(req, platform=FakePlatform(cuda_facts()), log=log,
                                 installed={"torch": True, "triton": False, "flashinfer-python": True})
    info = ei.value.info
    assert info.code == "workspace_too_small" and info.state == "build-mode"
    flags = {f.name: f.value for f in info.flags}
    assert flags["flashinfer_workspace_size"] == 1 << 20
    k = llama.layer_kinds()[0]
    need = sizing.workspace_need([sizing.HeadShape(k.num_heads, k.num_kv_heads, k.head_dim_v)], num_sms=132,
                                 max_batch_size=small_pool.max_reqs, cuda_graph_max_bs=small_pool.max_reqs)
    assert flags["needed_bytes"] == need.bytes > 1 << 20
    assert not any(isinstance(r, ev.BackendBuilt) for r in log.records)



def test_engine_pools_are_used_and_checked_against_the_request(llama, small_pool):
    """pools= must match request.pool and the model: a mismatch is pools_mismatch (exit 3) before allocation."""
    from pipeline.core.errors import ConfigError, UsageError
    from pipeline.backends.memory import KVPool, ReqToTokenPool

    kinds, p, n = llama.layer_kinds(), small_pool, llama.num_hidden_layers
    bf = torch.bfloat16  # the model's KV dtype

    def pools(max_reqs=p.max_reqs, layers=n, slots=p.num_token_slots, dtype=bf, page=p.page_size):
        k = kinds[0]
        kv = (KVPool.for_layer_kinds(kinds, n, slots, page, dtype, "cpu") if layers == n else
              KVPool(slots, page, [(k.num_kv_heads, k.head_dim_qk, k.head_dim_v)] * layers, dtype, "cpu"))
        return {"req_to_token_pool": ReqToTokenPool(max_reqs, p.max_context_len, "cpu"), "kv_pool": kv}

    given = pools()
    with build_attention_backends(_req(llama, p), installed=INSTALLED, pools=given) as out:
        assert out.pools == {} and out.plan is not None
    assert len(given["kv_pool"].k_buffer) == n and given["req_to_token_pool"].req_to_token.numel() > 0  # still the engine's

    def narrow_v(pl):
        pl["kv_pool"].v_buffer[3] = pl["kv_pool"].v_buffer[3][:, :, :64]
        return pl

    def lying_r2t(pl):
        pl["req_to_token_pool"].req_to_token = pl["req_to_token_pool"].req_to_token[:2]
        return pl

    cases = [(pools(max_reqs=4), "req_to_token"), (pools(slots=256), "k_buffer[0]"), (pools(layers=2), "k_buffer"),
             (pools(dtype=torch.float16), "k_buffer[0]"), (pools(page=2), "page_size"), (narrow_v(pools()), "v_buffer[3]"),
             (lying_r2t(pools()), "req_to_token"), ({}, "req_to_token_pool"), ({"kv_pool": given["kv_pool"]}, "req_to_token_pool"),
             ({"req_to_token_pool": None, "kv_pool": given["kv_pool"]}, "req_to_token_pool")]
    for bad, field in cases:
        with pytest.raises(ConfigError) as ei:
            build_attention_backends(_req(llama, p), installed=INSTALLED, pools=bad)
        assert ei.value.info.code == "pools_mismatch" and field in str(ei.value.info.flags), (field, ei.value.info)
        assert ei.value.info.remedy and ei.value.info.allowed
    for wrong in (["a"], True, "pools"):
        with pytest.raises(UsageError, match="pools must be a dict"):
            build_attention_backends(_req(llama, p), installed=INSTALLED, pools=wrong)


@pytest.mark.parametrize("graph_bs", [None, (1, 3, 64)])
def test_graph_max_bs_is_the_series_top_without_listing_it(graph_bs):
    """graph_max_bs equals the last of capture_batch_sizes (sglang's 1, 2, 4, 8, 16, 24, … series or the given
    sizes) for every max_reqs / cuda_graph_max_bs up to 300, and stays O(1) for a cuda_graph_max_bs of 2**31 - 1 (it
    ran the whole series before: build-mode hung on such a pool instead of refusing it); without one the top is the
    default (160 without a known device memory), whatever max_reqs is."""
    from states.build_mode import capture_batch_sizes, graph_max_bs

    for max_reqs in range(64 if graph_bs else 1, 300):
        for cap in (None, 1, 3, 8, 15, 16, 17, 24, 100, 1000):
            if cap is not None and (cap > max_reqs or graph_bs):  # refused: unreachable, or not the list's largest
                continue
            a = AttentionArgs(cuda_graph_max_bs=cap, cuda_graph_bs=graph_bs)
            assert graph_max_bs(a, max_reqs, True) == capture_batch_sizes(a, max_reqs)[-1], (max_reqs, cap)
            assert graph_max_bs(a, max_reqs, False) == 0
    assert graph_max_bs(AttentionArgs(cuda_graph_bs=graph_bs), 2 ** 31 - 1, True) == (64 if graph_bs else 160)
    top = None if graph_bs else 2 ** 31 - 1
    assert graph_max_bs(AttentionArgs(cuda_graph_bs=graph_bs, cuda_graph_max_bs=top), 2 ** 31 - 1, True) == (
        64 if graph_bs else 2 ** 31 - 8)


def test_absurd_max_reqs_is_refused_for_memory_not_hung():
    """A library request whose pool cannot fit (max_reqs = 2**31 - 1) gets ``pool_exceeds_memory`` before anything
    is allocated; the graph-size checks before it no longer build a 268M-entry batch-size list."""
    from pipeline.core.contracts import PoolFacts
    from pipeline.core.errors import ConfigError
    from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec

    req = SetupRequest(model=load_model_spec(DEFAULT_MODEL_CONFIG), device="cpu",
                       pool=PoolFacts(max_reqs=2 ** 31 - 1, max_context_len=4096, num_token_slots=16384))
    with pytest.raises(ConfigError) as e:
        build_attention_backends(req)
    assert e.value.info.code == "pool_exceeds_memory"


def test_absurd_pool_on_a_gpu_is_refused_for_memory_before_the_workspace_check():
    """On a CUDA device with FlashInfer the workspace check used to run first and search every captured size from
    2**31 - 1 down (the H200 test hung): now the pools are refused first, in build-mode, with nothing allocated."""
    from pipeline.core.contracts import PoolFacts
    from pipeline.core.errors import ConfigError
    from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec

    req = SetupRequest(model=load_model_spec(DEFAULT_MODEL_CONFIG), device="cuda",
                       args=AttentionArgs(attention_backend="flashinfer"),
                       pool=PoolFacts(max_reqs=2 ** 31 - 1, max_context_len=4096, num_token_slots=16384))
    plat = FakePlatform(cuda_facts(), free_bytes=80 << 30)
    with pytest.raises(ConfigError) as e:
        build_attention_backends(req, platform=plat, installed={**INSTALLED, "flashinfer-python": True})
    assert e.value.info.code == "pool_exceeds_memory" and e.value.info.state == "build-mode"


def test_largest_fitting_graph_bs_is_a_binary_search_equal_to_the_scan():
    """The workspace remedy's 'largest captured size that fits' equals a linear scan for every size bound and
    workspace size over several head shapes (the need is nondecreasing in the batch), in O(log n) calls."""
    from pipeline.backends.flashinfer import rules as sz
    from pipeline.core.numbers import largest_fitting

    for h, kv, d, sinks in [(32, 8, 128, False), (32, 32, 128, False), (64, 8, 64, True), (16, 4, 256, False)]:
        shapes = [sz.HeadShape(h, kv, d, sinks, False)]
        needs = [sz.workspace_need(shapes, num_sms=132, max_batch_size=400, cuda_graph_max_bs=bs).bytes
                 for bs in range(1, 400)]
        assert needs == sorted(needs)
        for size in sorted(set(needs))[::5] + [needs[0] - 1, needs[-1]]:
            for top in (1, 7, 64, 399):
                calls = []
                got = largest_fitting(range(1, top + 1), lambda bs: calls.append(bs) or needs[bs - 1] <= size)
                assert got == next((bs for bs in range(top, 0, -1) if needs[bs - 1] <= size), None)
                assert len(calls) <= 2 + top.bit_length()
    calls = []
    assert largest_fitting(range(1, 2 ** 31), lambda bs: calls.append(bs) or bs <= 5) == 5 and len(calls) <= 33


@pytest.mark.parametrize("graph_bs", [None, (3, 1, 64)])
def test_batch_size_count_and_text_without_listing(graph_bs):
    """count_batch_sizes equals len(capture_batch_sizes) and batch_sizes_text its comma join for every max_reqs /
    cuda_graph_max_bs up to 300; at max_reqs 2**31 - 1 both answer at once (the progress line and the ranks'
    digest listed 268M sizes)."""
    from states.build_mode import batch_sizes_text, capture_batch_sizes, count_batch_sizes

    for max_reqs in range(64 if graph_bs else 1, 300):
        for cap in (None, 1, 3, 8, 15, 16, 17, 24, 100):
            if cap is not None and (cap > max_reqs or graph_bs and cap != max(graph_bs)):
                continue  # refused (a size the pool cannot hold, or one that disagrees with the list)
            a = AttentionArgs(cuda_graph_max_bs=cap, cuda_graph_bs=graph_bs)
            sizes = capture_batch_sizes(a, max_reqs)
            assert count_batch_sizes(a, max_reqs) == len(sizes), (max_reqs, cap)
            assert batch_sizes_text(a, max_reqs) == ",".join(map(str, sizes))
    a = AttentionArgs(cuda_graph_bs=graph_bs, cuda_graph_max_bs=None if graph_bs else 2 ** 31 - 1)
    n = count_batch_sizes(a, 2 ** 31 - 1)
    assert n == (3 if graph_bs else 4 + (2 ** 31 - 8 - 16) // 8 + 1)
    assert batch_sizes_text(a, 2 ** 31 - 1) == ("1,3,64" if graph_bs else f"1,2,4,8,16..{2 ** 31 - 8} step 8 ({n} sizes)")
