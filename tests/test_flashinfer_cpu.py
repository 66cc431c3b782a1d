"""CPU tests of the flashinfer/fa3 backends: refusal, workspace arithmetic, variants, JIT events, glue.

The glue tests run the real backend code against tests/fake_flashinfer.py (FlashInfer's wrapper
API with documented semantics) and compare with the independent float64 reference.
"""

from __future__ import annotations

import sys
import time

import pytest
import structlog
import torch

from pipeline.backends.registry import get  # noqa: I001  (registry first: it imports capabilities)
from pipeline.backends import records as capabilities
from pipeline.backends.flashinfer import rules

from pipeline.core.contracts import ForwardMode
from pipeline.core.errors import BackendUnavailable, CapabilityMismatch, ConfigError
from pipeline.backends.flashinfer.jit import Variant, ensure_compiled, heartbeat
from pipeline.backends.capability import WorkspaceQuery
import fake_flashinfer
from fi_reference import Scenario, dense_reference, make_kind, make_layer, rel_err

# ---------------------------------------------------------------- refusal and records


def test_factory_without_flashinfer_names_package_and_extra(monkeypatch):
    """Without FlashInfer the factory raises BackendUnavailable naming the package and the cuda extra."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    from pipeline.backends.flashinfer import backend as fib

    for name, factory in (("flashinfer", fib.create), ("fa3", fib.create_fa3)):
        sc = Scenario([make_kind(4, 2, 64)], device="cpu", name=name)
        with pytest.raises(BackendUnavailable) as ei:
            factory(sc.ctx)
        assert "flashinfer-python" in ei.value.info.message
        assert "pip install 'flashinfer-python==0.7.2'" in ei.value.info.remedy
        assert ei.value.info.flags[0].value == name


def test_capability_records_registered():
    """Both backends are registered with cuda-only records, fa3 on sm90 only, 384 MiB workspace."""
    fi, fa3 = get("flashinfer").capability, get("fa3").capability
    assert fi.devices == ["cuda"] and fa3.archs == ["sm90"]
    assert fi.workspace_bytes == fa3.workspace_bytes == 384 * (1 << 20) == rules.DEFAULT_WORKSPACE_BYTES
    assert "flashinfer-python" in fi.packages and "SGLANG_FLASHINFER_WORKSPACE_SIZE" in fi.source
    assert get("fa3").factory == "pipeline.backends.flashinfer.backend:create_fa3"
    assert capabilities.FA3.q_dtypes == ["bfloat16", "float16"]


def test_fa3_refused_off_sm90(monkeypatch):
    """fa3 on an sm80 device is a CapabilityMismatch naming the compute capability."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    from pipeline.backends.flashinfer import backend as fib

    sc = Scenario([make_kind(4, 2, 64)], device="cpu", name="fa3", arch=(8, 0))
    sc.ctx.device = type(sc.ctx.device)(type="cuda", compute_capability=(8, 0), sm_count=108)
    with pytest.raises(CapabilityMismatch) as ei:
        fib.create_fa3(sc.ctx)
    assert ei.value.info.flags[0].value == "sm80" and ei.value.info.allowed == ["sm90"]


# ---------------------------------------------------------------- workspace arithmetic


def test_workspace_hand_computed_table():
    """Bytes match a hand-computed table (H=32, Hkv=8, Dv=128, 132 SMs; FlashInfer 0.7.2's scheduler.cuh: FA2
    partial outputs per query row, ``ceil(tiles * cta_tile_q / group)`` rows)."""
    s = rules.HeadShape(32, 8, 128)
    # CUDA-core decode: rows = 16*132//8 = 264; 32*264*(128+1)*4 + 32
    assert rules.cuda_core_decode_bytes(s, 132) == 32 * 264 * 129 * 4 + 32
    # FA2 eager: tiles = 2*132//8 = 33, tile 128 packed rows, group 4 -> 33*128/4 = 1056 rows
    assert rules.fa2_eager_bytes(s, 132) == 32 * 1056 * 129 * 4 + 32
    # graph decode bs=256, group 4 -> tile 16, q tiles = 256*4/16 + 255 = 319 > 33 -> 319*16/4 = 1276 rows
    assert rules.fa2_graph_decode_bytes(s, 132, 256) == 32 * 1276 * 129 * 4 + 32
    # bs=4: q tiles 1+3=4 < 33 split tiles -> 33*16/4 = 132 rows
    assert rules.fa2_graph_decode_bytes(s, 132, 4) == 32 * 132 * 129 * 4 + 32
    # group 3 (24/8): 33 tiles of 16 packed rows -> ceil(528/3) = 176 rows
    assert rules.fa2_graph_decode_bytes(rules.HeadShape(24, 8, 128), 132, 4) == 24 * 176 * 129 * 4 + 32


def test_workspace_need_takes_largest_path_and_graph_bs():
    """The need is the max over paths; graph term only when tensor-core decode is used at that bs."""
    s = rules.HeadShape(32, 8, 128)
    n = rules.workspace_need([s], num_sms=132, max_batch_size=256, cuda_graph_max_bs=256)
    assert n.bytes == n.parts["fa2_graph_decode"] == rules.fa2_graph_decode_bytes(s, 132, 256)
    g1 = rules.workspace_need([rules.HeadShape(8, 8, 128)], num_sms=132, max_batch_size=256, cuda_graph_max_bs=256)
    assert g1.parts["fa2_graph_decode"] == 0  # group 1 decodes on CUDA cores
    assert rules.workspace_need([s], num_sms=132, max_batch_size=256, prefill_backend="fa3").bytes == 0
    assert rules.workspace_need([s], num_sms=132, max_batch_size=256).bytes == rules.fa2_eager_bytes(s, 132)


def test_mqa_fits_sglang_default():
    """An MQA model (H=32, Hkv=1, D=128): FlashInfer 0.7.2 sizes FA2's partial outputs per query row, so the worst
    prefill split needs 264*128/32 = 1056 rows (0.6.13 reserved 32 times more, beyond 384 MiB); the largest path is
    CUDA-core decode, 16*132 = 2112 rows — far below sglang's default."""
    n = rules.workspace_need([rules.HeadShape(32, 1, 128)], num_sms=132, max_batch_size=64)
    assert n.parts["fa2_eager"] == 32 * 1056 * 129 * 4 + 32
    assert n.bytes == n.parts["cuda_core_decode"] == 32 * 2112 * 129 * 4 + 32 < rules.DEFAULT_WORKSPACE_BYTES


def test_check_workspace_size_error_names_field_and_bytes():
    """Too small a workspace raises ConfigError naming flashinfer_workspace_size and the needed bytes."""
    need = rules.workspace_need([rules.HeadShape(32, 8, 128)], num_sms=132, max_batch_size=256, cuda_graph_max_bs=256)
    rules.check_workspace_size(need.bytes, need)
    with pytest.raises(ConfigError) as ei:
        rules.check_workspace_size(need.bytes // 2, need)
    info = ei.value.info
    assert info.code == "workspace_too_small" and info.state == "build-mode"
    assert info.flags[0].name == "flashinfer_workspace_size" and info.flags[0].value == need.bytes // 2
    assert info.flags[1].value == need.bytes and str(need.bytes) in info.remedy


def test_cuda_core_decode_only_for_groups_flashinfer_compiles():
    """Over every GQA group 1..64 and batch 1..300: CUDA-core decode only for FlashInfer's dispatched group sizes
    (1, 2, 3, 4, 8); e.g. Qwen2.5-7B's group 7 (28 q / 4 kv heads) always decodes on tensor cores."""
    for group in range(1, 65):
        for bs in (1, 2, 7, 8, 9, 64, 300):
            assert rules.use_tensor_core_decode(group, bs) or group in (1, 2, 3, 4, 8), (group, bs)
    assert all(rules.use_tensor_core_decode(7, bs) for bs in range(1, 300))


@pytest.mark.parametrize("heads,kv_heads", [(28, 4), (10, 2), (12, 2), (48, 8)])
def test_glue_decode_groups_without_a_cuda_core_kernel(fib, heads, kv_heads):
    """Groups 7, 5, 6, 6 decode (small and large batches) through the fake, which refuses CUDA-core decode for
    groups FlashInfer's kernel is not compiled for, and match float64."""
    sc = _scenario([make_kind(heads, kv_heads, 16)], 4)
    be = fib.create(sc.ctx)
    for n in (1, 8):
        reqs = list(range(n))
        assert _check_batch(sc, be, ForwardMode.DECODE, reqs, [0] * n, [1] * n) < 1e-5
        assert be.kinds[0].active is be.kinds[0].decode_tc


def test_tensor_core_rule_and_cta_tile():
    """Tensor-core decode for group >= 8, or >= 4 at batch >= 8 (fp8: the FP8_DECODE_PATH table); FA2 tile rows."""
    assert not rules.use_tensor_core_decode(1, 256) and not rules.use_tensor_core_decode(4, 1)
    assert rules.use_tensor_core_decode(8, 1)
    assert rules.use_tensor_core_decode(4, 8)
    for kv in ("fp8_e4m3", "fp8_e5m2", "float8_e4m3fn", "float8_e5m2"):  # our names and torch's
        for g in (1, 2, 3, 4, 7, 8):
            for b in (1, 8, 256):
                want = g not in rules.CUDA_CORE_DECODE_GROUPS or rules.FP8_DECODE_PATH.get(g, "tensor_core") == "tensor_core"
                assert rules.use_tensor_core_decode(g, b, kv) == want, (kv, g, b)


def test_workspace_bound_holds_for_either_fp8_decode_path(monkeypatch):
    """Flipping FP8_DECODE_PATH (as the lead may after a GPU run) never leaves the graph term unsized: the bound
    covers tensor-core graph plans wherever either the 16-bit or the fp8 rule takes them."""
    s = rules.HeadShape(32, 8, 128)
    for bs in (1, 4, 7):  # group 4 below 8 requests: bf16 decodes on CUDA cores
        monkeypatch.setitem(rules.FP8_DECODE_PATH, 4, "cuda_core")
        cc = rules.workspace_need([s], num_sms=132, max_batch_size=bs, cuda_graph_max_bs=bs)
        monkeypatch.setitem(rules.FP8_DECODE_PATH, 4, "tensor_core")
        tc = rules.workspace_need([s], num_sms=132, max_batch_size=bs, cuda_graph_max_bs=bs)
        assert cc.parts["fa2_graph_decode"] == 0
        assert tc.parts["fa2_graph_decode"] == rules.fa2_graph_decode_bytes(s, 132, bs)
        assert tc.bytes >= cc.bytes
    assert [rules.cta_tile_q(n, 128) for n in (1, 16, 17, 64, 65)] == [16, 16, 64, 64, 128]
    assert rules.cta_tile_q(65, 256) == 64


# ---------------------------------------------------------------- variants and JIT events


def test_variant_names():
    """Variant names spell kind, backend, dtypes, head dims, window, softcap and arch."""
    v = Variant(kind="prefill", backend="fa3", q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_qk=128,
                head_dim_vo=128, sliding_window=True, arch="sm90")
    assert v.name == "prefill-fa3/bf16-bf16/d128/swa1/cap0/sm90"
    w = Variant(kind="decode", backend="cuda_core", q_dtype="float16", kv_dtype="float16", head_dim_qk=192,
                head_dim_vo=128, logit_softcap=True)
    assert w.name == "decode-cuda_core/f16-f16/d192x128/swa0/cap1/any"
    assert w.fields()["variant"] == w.name and w.fields()["head_dim_vo"] == 128


def test_ensure_compiled_logs_compiling_heartbeats_and_time():
    """A compiling variant logs jit_variant(compiling), heartbeats while it compiles, then the time."""
    v = Variant(kind="decode", backend="cuda_core", q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_qk=64, head_dim_vo=64)
    with structlog.testing.capture_logs() as logs:
        r = ensure_compiled(v, heartbeat_s=0.05, loader=lambda _: time.sleep(0.28), cached=lambda _: False)
    ev = [e["event"] for e in logs]
    assert ev[0] == "jit_variant" and logs[0]["status"] == "compiling" and logs[0]["head_dim_qk"] == 64
    beats = [e for e in logs if e["event"] == "jit_heartbeat"]
    assert 3 <= len(beats) <= 6 and "still compiling decode-cuda_core" in beats[0]["message"]
    assert ev[-1] == "jit_variant_ready" and 0.25 <= logs[-1]["seconds"] < 1.0 and r["status"] == "compiling"


def test_ensure_compiled_cached_has_no_heartbeat_and_failure_is_logged():
    """A cached variant logs 'cached' without heartbeats; a failing compile logs jit_variant_failed."""
    v = Variant(kind="prefill", backend="fa2", q_dtype="bfloat16", kv_dtype="bfloat16", head_dim_qk=64, head_dim_vo=64)
    with structlog.testing.capture_logs() as logs:
        ensure_compiled(v, heartbeat_s=0.01, loader=lambda _: time.sleep(0.05), cached=lambda _: True)
    assert logs[0]["status"] == "cached" and not [e for e in logs if e["event"] == "jit_heartbeat"]

    def boom(_):
        raise RuntimeError("Ninja build failed")

    with structlog.testing.capture_logs() as logs, pytest.raises(RuntimeError):
        ensure_compiled(v, loader=boom, cached=lambda _: False)
    assert logs[-1]["event"] == "jit_variant_failed" and "Ninja" in logs[-1]["error"]


def test_heartbeat_thread_stops():
    """The heartbeat thread is joined when the body ends (no beats afterwards)."""
    with structlog.testing.capture_logs() as logs:
        with heartbeat("x", 0.02):
            time.sleep(0.07)
        n = len(logs)
        time.sleep(0.06)
    assert n >= 2 and len(logs) == n


# ---------------------------------------------------------------- glue against the fake API


@pytest.fixture
def fib(monkeypatch):
    """The backend module with the fake FlashInfer installed and JIT checks stubbed out."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(fake_flashinfer, "JIT_MODULES", {})  # a fresh JIT cache per test
    from pipeline.backends.flashinfer import backend as mod

    monkeypatch.setattr(mod, "ensure_compiled", lambda v, **kw: {"variant": v.name, "status": "cached", "seconds": 0})
    return mod


def _scenario(kinds, page_size, name="flashinfer", ws_bytes=1 << 20, **kw):
    return Scenario(kinds, device="cpu", dtype=torch.float32, page_size=page_size, max_reqs=8, max_context_len=256,
                    ws_bytes=ws_bytes, name=name, sm_count=4, facts_type="cuda", **kw)


def _check_batch(sc, be, mode, reqs, prefix, new, sinks=None):
    """Run one batch through every layer and compare each request with the float64 reference."""
    sc.fill_prefix(reqs, prefix)
    prefix = [sc.alloc.req_lens.get(r, 0) for r in reqs]  # earlier batches' tokens count too
    fb = sc.batch(mode, reqs, new)
    be.init_forward_metadata(fb)
    errs = []
    for kind in sc.kinds:
        for lid in kind.layer_ids:
            T = sum(new)
            q = sc.randn(T, kind.num_heads, kind.head_dim_qk, scale=3.0)
            k = sc.randn(T, kind.num_kv_heads, kind.head_dim_qk)
            v = sc.randn(T, kind.num_kv_heads, kind.head_dim_v)
            layer = make_layer(kind, lid, sinks if kind.has_sinks else None)
            out = be.forward(q, k, v, layer, fb).view(T, kind.num_heads, kind.head_dim_v)
            off = 0
            for r, p, n in zip(reqs, prefix, new):
                kr, vr = sc.request_kv(lid, r, p + n)
                ref = dense_reference(q[off:off + n], kr, vr, prefix=p, scale=kind.scaling, window=kind.sliding_window,
                                      softcap=kind.logit_softcap, sinks=layer.sinks)
                errs.append(rel_err(out[off:off + n], ref))
                off += n
    return max(errs)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_glue_decode_extend_all_kinds(fib, page_size):
    """Decode, extend with prefix (paged) and without (ragged) match float64 for every layer kind."""
    kinds = [make_kind(4, 2, 16, layer_ids=(0,)), make_kind(4, 2, 16, window=5, layer_ids=(1,)),
             make_kind(4, 1, 16, softcap=2.0, layer_ids=(2,)), make_kind(4, 4, 16, sinks=True, layer_ids=(3,))]
    sc = _scenario(kinds, page_size)
    be = fib.create(sc.ctx)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert _check_batch(sc, be, ForwardMode.EXTEND, [1, 2, 3], [0, 0, 0], [7, 1, 20], sinks) < 1e-5
    assert be.extend_ragged and be.kinds[0].mode == "ragged" and be.kinds[3].mode == "paged"
    assert _check_batch(sc, be, ForwardMode.EXTEND, [1, 2, 4], [0, 0, 0], [3, 9, 5], sinks) < 1e-5
    assert not be.extend_ragged and be.kinds[0].mode == "paged"
    assert _check_batch(sc, be, ForwardMode.DECODE, [1, 2, 3, 4], [0] * 4, [1] * 4, sinks) < 1e-5


@pytest.mark.parametrize("window", [None, 6])
def test_sink_kinds_of_different_head_dims_get_their_own_modules(fib, window):
    """Sink layers of head dims 64 and 128 (and a float16 KV next to bf16 ones) in one process each run their own
    kernel. FlashInfer's sink wrapper (0.6.13, still 0.7.2) names its JIT module without head dims or KV dtype, so the
    second kind loaded the first one's kernel (max rel err 1.4-2.0 on the H200); the fake's JIT cache is keyed by
    module name as the real one is, and refuses a module built for other parameters."""
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for d in (64, 128):  # two backends in one process share the JIT cache
        sc = _scenario([make_kind(4, 2, d, window=window, sinks=True, layer_ids=(0,)),
                        make_kind(4, 2, 2 * d, window=window, sinks=True, layer_ids=(1,))], 4, ws_bytes=4 << 20)
        be = fib.create(sc.ctx)
        assert _check_batch(sc, be, ForwardMode.EXTEND, [1, 2], [0, 0], [5, 9], sinks) < 1e-5
        assert _check_batch(sc, be, ForwardMode.DECODE, [1, 2], [0, 0], [1, 1], sinks) < 1e-5
    names = sorted(fake_flashinfer.JIT_MODULES)
    assert len(names) == 3 and all("_d64x64_" in n or "_d128x128_" in n or "_d256x256_" in n for n in names), names


def test_glue_decode_picks_tensor_cores_by_rule(fib):
    """Group-4 decode uses the tensor-core wrapper at batch >= 8 and CUDA cores below; fa3 always tc."""
    sc = _scenario([make_kind(8, 2, 16)], 4)
    be = fib.create(sc.ctx)
    for n, want in ((2, "decode_cc"), (8, "decode_tc")):
        reqs = list(range(n))
        assert _check_batch(sc, be, ForwardMode.DECODE, reqs, [0] * n, [1] * n) < 1e-5
        assert be.kinds[0].active is getattr(be.kinds[0], want)
    sc3 = _scenario([make_kind(8, 2, 16)], 4, name="fa3")
    be3 = fib.create_fa3(sc3.ctx)
    assert be3.kinds[0].decode_cc is None and be3.prefill_backend == "fa3"
    assert _check_batch(sc3, be3, ForwardMode.DECODE, [0, 1], [3, 9], [1, 1]) < 1e-5


def test_glue_page_table(fib):
    """kv_indptr/last_page_len are CPU int32; page ids are req_to_token[r, ::ps] // ps."""
    sc = _scenario([make_kind(4, 2, 16)], 4)
    be = fib.create(sc.ctx)
    sc.fill_prefix([2, 5], [9, 4])
    indptr, indices, last = be.page_table(torch.tensor([2, 5]), [9, 4])
    assert indptr.tolist() == [0, 3, 4] and last.tolist() == [1, 4] and indptr.dtype == torch.int32
    r2t = sc.req_pool.req_to_token
    want = (torch.cat([r2t[2, 0:9:4], r2t[5, 0:4:4]]) // 4).tolist()
    assert indices.tolist() == want and indices.dtype == torch.int32


def test_glue_cuda_graph_buffers_and_replay(fib):
    """Graph wrappers reuse fixed buffers; a replay plan with new lengths gives the eager result."""
    sc = _scenario([make_kind(8, 2, 16)], 4, extra={"cuda_graph_max_bs": 8})
    be = fib.create(sc.ctx)
    be.init_cuda_graph_state(8, 8)
    sc.fill_prefix([0, 1, 2], [5, 17, 2])
    fb = sc.batch(ForwardMode.DECODE, [0, 1, 2], [1, 1, 1])
    be.init_forward_metadata_capture_cuda_graph(4, 4, torch.tensor([0, 1, 2, 0]), torch.tensor([6, 18, 3, 1]),
                                                None, ForwardMode.DECODE, None)
    w = be.graph.wrappers(4)[0][1]
    assert w.use_cuda_graph and w.bufs["paged_kv_indices_buffer"] is be.graph.indices
    be.init_forward_metadata_replay_cuda_graph(4, torch.tensor([0, 1, 2, 0]), fb.seq_lens.tolist() + [1], 0, None,
                                               ForwardMode.DECODE, None, torch.tensor(fb.seq_lens.tolist() + [1]))
    assert w.plans == 2 and be.kinds[0].active is w
    kind = sc.kinds[0]
    q = sc.randn(4, 8, 16)
    out = be.forward_decode(q, None, None, make_layer(kind, 0), fb, save_kv_cache=False).view(4, 8, 16)
    be.init_forward_metadata(fb)
    eager = be.forward_decode(q[:3], None, None, make_layer(kind, 0), fb, save_kv_cache=False).view(3, 8, 16)
    assert torch.equal(out[:3], eager)
    with pytest.raises(ConfigError):
        be.graph.wrappers(9)


def test_entry_refuses_small_workspace_before_building():
    """A workspace below the computed need is refused by the registry entry (build-mode asks it before
    allocating), naming flashinfer_workspace_size; the computed need itself passes."""
    from pipeline.backends import registry

    kinds = [make_kind(32, 8, 128)]
    need = rules.workspace_need(rules.shapes_of(kinds), num_sms=132, max_batch_size=4, cuda_graph_max_bs=4).bytes
    entry = registry.get("flashinfer")
    with pytest.raises(ConfigError) as ei:
        entry.check_workspace(1 << 20, WorkspaceQuery(kinds=kinds, num_sms=132, max_reqs=4, graph_max_bs=4))
    assert ei.value.info.flags[0].name == "flashinfer_workspace_size" and ei.value.info.code == "workspace_too_small"
    entry.check_workspace(need, WorkspaceQuery(kinds=kinds, num_sms=132, max_reqs=4, graph_max_bs=4))
    assert need > 1 << 20


def test_sinks_with_softcap_refused(fib):
    """Sinks plus softcap is refused: FlashInfer's sink kernel has no softcap."""
    sc = _scenario([make_kind(4, 2, 16, sinks=True, softcap=3.0)], 4)
    with pytest.raises(CapabilityMismatch):
        fib.create(sc.ctx)


def test_chunked_kind_refused_by_the_factory(fib):
    """A chunked local-attention kind (Llama-4) is refused before building, naming triton / torch_native."""
    import msgspec

    kind = msgspec.structs.replace(make_kind(4, 2, 16), kind="chunked", attention_chunk_size=8)
    sc = _scenario([kind], 4)
    with pytest.raises(CapabilityMismatch) as ei:
        fib.create(sc.ctx)
    assert ei.value.info.flags[0].name == "attention_chunk_size" and "triton" in ei.value.info.remedy


def test_glue_pdl_decided_at_build_like_flashinfer(fib):
    """enable_pdl mirrors flashinfer.utils.device_support_pdl (major >= 9) and reaches every decode run."""
    seen = []
    for arch, want in (((9, 0), True), ((8, 0), False), ((10, 0), True)):
        sc = _scenario([make_kind(4, 2, 16)], 4, arch=arch)
        be = fib.create(sc.ctx)
        assert be.enable_pdl is want
        w = be.kinds[0].decode_cc
        orig = w.run
        w.run = lambda q, kv, *a, enable_pdl=None, _o=orig: (seen.append(enable_pdl), _o(q, kv, *a))[1]
        assert _check_batch(sc, be, ForwardMode.DECODE, [0, 1], [5, 9], [1, 1]) < 1e-5
        assert seen[-1] is want


def test_glue_host_lengths_as_tensors_like_sglang(fib):
    """sglang passes seq_lens_cpu as a CPU tensor: planning reads it (no truth-value error, no device read)."""
    import dataclasses

    sc = _scenario([make_kind(4, 2, 16)], 4)
    be = fib.create(sc.ctx)
    sc.fill_prefix([0, 1], [5, 9])
    fb = sc.batch(ForwardMode.DECODE, [0, 1], [1, 1])
    fb2 = dataclasses.replace(fb, seq_lens_cpu=torch.tensor(fb.seq_lens_cpu))
    be.init_forward_metadata(fb2)
    w = be.kinds[0].active
    assert fb.seq_lens_cpu == [6, 10] and w.indptr.tolist() == [0, 2, 5] and w.last.tolist() == [2, 2]  # page 4
