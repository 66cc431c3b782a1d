"""CPU tests of the flashinfer backend's MLA and fp8-KV glue over tests/fake_flashinfer.py.

The real backend code (planning, page tables, the MLA wrapper's q / latent views, fp8 scales, CUDA-graph
buffers) runs against the fake wrappers, whose math is written independently in float32; every output is
compared with the float64 dense reference over the *dequantized stored* K/V (``fi_reference.request_kv``).
The kernels themselves are checked on the H200 by tests/gpu/test_flashinfer_mla_fp8_gpu.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

from pipeline.backends.flashinfer import rules
from pipeline.backends.flashinfer.jit import mla_backend
from pipeline.core.contracts import ForwardMode
from pipeline.core.errors import CapabilityMismatch
from pipeline.backends.flashinfer.jit import variants_for
from pipeline.backends.capability import WorkspaceQuery
import fake_flashinfer
from fi_reference import Scenario, dense_reference, make_kind, make_layer, make_mla_kind, rel_err

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.fixture
def fib(monkeypatch):
    """The backend module with the fake FlashInfer installed and JIT checks stubbed out."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    from pipeline.backends.flashinfer import backend as mod

    monkeypatch.setattr(mod, "ensure_compiled", lambda v, **kw: {"variant": v.name, "status": "cached", "seconds": 0})
    return mod


def _scenario(kinds, page_size, *, dtype=torch.float32, name="flashinfer", max_context_len=256, **kw):
    return Scenario(kinds, device="cpu", dtype=dtype, page_size=page_size, max_reqs=8, max_context_len=max_context_len,
                    ws_bytes=64 << 20, name=name, sm_count=4, facts_type="cuda", **kw)


def _batch_errs(sc, be, mode, reqs, prefix, new):
    """One batch through every layer; per request ``max|out - ref| / max|ref|`` against float64."""
    sc.fill_prefix(reqs, prefix)
    prefix = [sc.alloc.req_lens.get(r, 0) for r in reqs]
    fb = sc.batch(mode, reqs, new)
    be.init_forward_metadata(fb)
    errs = []
    for kind in sc.kinds:
        for lid in kind.layer_ids:
            t = sum(new)
            q = sc.randn(t, kind.num_heads, kind.head_dim_qk, scale=2.0)
            k = sc.randn(t, kind.num_kv_heads, kind.head_dim_qk, scale=1.5)
            v = k[..., :kind.head_dim_v].clone() if kind.is_mla else sc.randn(t, kind.num_kv_heads, kind.head_dim_v)
            out = be.forward(q, k, v, make_layer(kind, lid), fb).view(t, kind.num_heads, kind.head_dim_v)
            assert out.dtype == q.dtype
            off = 0
            for r, p, n in zip(reqs, prefix, new):
                kr, vr = sc.request_kv(lid, r, p + n)
                ref = dense_reference(q[off:off + n], kr, vr, prefix=p, scale=kind.scaling)
                errs.append(rel_err(out[off:off + n], ref))
                off += n
    return errs


# ---------------------------------------------------------------- MLA


@pytest.mark.parametrize("heads,page_size", [(16, 1), (16, 4), (16, 16), (128, 16)])
def test_mla_decode_and_extend_match_float64(fib, heads, page_size):
    """MLA (576/512, one latent head): extend without a prefix, extend over a prefix and decode, through the
    paged MLA wrapper (never the ragged path), match float64 over the stored latents."""
    sc = _scenario([make_mla_kind(heads, layer_ids=(0, 1) if heads == 16 else (0,))], page_size)
    be = fib.create(sc.ctx)
    kw = be.kinds[0]
    assert kw.mla and kw.mla_backend == "fa3"  # sm90 facts
    assert max(_batch_errs(sc, be, ForwardMode.EXTEND, [0, 1, 2], [0, 0, 0], [5, 1, 19])) < 1e-5
    assert kw.mode == "mla" and kw.active is kw.wrapper and kw.wrapper.cfg["causal"]  # no prefix: still paged MLA
    assert max(_batch_errs(sc, be, ForwardMode.EXTEND, [0, 3], [0, 0], [7, 3])) < 1e-5  # req 0 has a prefix now
    assert max(_batch_errs(sc, be, ForwardMode.DECODE, [0, 1, 2, 3], [0] * 4, [1] * 4)) < 1e-5
    assert not kw.wrapper.cfg["causal"] and kw.wrapper.cfg["sm_scale"] == sc.kinds[0].scaling


def test_mla_latent_views_share_the_one_buffer(fib):
    """c_kv and k_rope handed to the wrapper are strided slices of the pool's one [S, 1, 576] latent buffer, and
    the pool's V is its first 512 dims (no second copy)."""
    sc = _scenario([make_mla_kind(16)], 4)
    be = fib.create(sc.ctx)
    ckv, kpe = be.mla_kv(0)
    kb = sc.kv.k_buffer[0]
    assert ckv.data_ptr() == kb.data_ptr() and kpe.data_ptr() == kb.data_ptr() + 512 * kb.element_size()
    assert ckv.shape == (kb.shape[0] // 4, 4, 512) and kpe.shape == (kb.shape[0] // 4, 4, 64)
    assert sc.kv.v_buffer[0].data_ptr() == kb.data_ptr() and sc.kv.nbytes() == kb.numel() * kb.element_size()


@pytest.mark.parametrize("arch,want", [((9, 0), "fa3"), ((8, 0), "fa2"), ((8, 9), "fa2")])
def test_mla_backend_by_arch(fib, arch, want):
    """FlashInfer's fa3 MLA kernels on sm90 (measured 2.1x faster at 128 heads), fa2 elsewhere."""
    sc = _scenario([make_mla_kind(16)], 4, arch=arch)
    be = fib.create(sc.ctx)
    assert be.kinds[0].mla_backend == want == be.kinds[0].wrapper.backend == mla_backend(sc.ctx.device.arch)
    assert [v.kind for v in be.variants()] == ["mla"] and be.variants()[0].backend == want


def test_mla_cuda_graph_buffers_and_replay(fib):
    """Per batch size a use_cuda_graph MLA wrapper over the fixed buffers (qo/kv indptr, page ids, kv lengths);
    a replay re-plan with new lengths reads the refreshed buffers and equals the eager result bit for bit."""
    sc = _scenario([make_mla_kind(16)], 4, extra={"cuda_graph_max_bs": 8})
    be = fib.create(sc.ctx)
    be.init_cuda_graph_state(8, 8)
    sc.fill_prefix([1, 2, 3], [5, 17, 2])
    be.init_forward_metadata_capture_cuda_graph(4, 4, torch.tensor([1, 2, 3, 0]), torch.tensor([3, 3, 3, 1]), None,
                                                ForwardMode.DECODE, None)
    kw, w, cls = be.graph.wrappers(4)[0]
    assert cls == "mla" and w.use_cuda_graph and w.bufs["kv_indices"] is be.graph.indices
    assert w.bufs["kv_len_arr"].data_ptr() == be.graph.kv_len.data_ptr()
    fb = sc.batch(ForwardMode.DECODE, [1, 2, 3], [1, 1, 1])
    seq = fb.seq_lens.tolist() + [1]
    be.init_forward_metadata_replay_cuda_graph(4, torch.tensor([1, 2, 3, 0]), torch.tensor(seq), 0, None,
                                               ForwardMode.DECODE, None, torch.tensor(seq))
    assert w.plans == 2 and kw.active is w and be.graph.kv_len[:4].tolist() == seq
    layer = make_layer(sc.kinds[0], 0)
    q = sc.randn(4, 16, 576)
    k = sc.randn(3, 1, 576)
    sc.kv.set_kv_buffer(0, fb.out_cache_loc, k, None)
    out = be.forward_decode(q, None, None, layer, fb, save_kv_cache=False).view(4, 16, 512)
    be.init_forward_metadata(fb)
    eager = be.forward_decode(q[:3], None, None, layer, fb, save_kv_cache=False).view(3, 16, 512)
    assert torch.equal(out[:3], eager)
    for i, (r, n) in enumerate(zip([1, 2, 3], fb.seq_lens.tolist())):
        kr, vr = sc.request_kv(0, r, n)
        assert rel_err(eager[i:i + 1], dense_reference(q[i:i + 1], kr, vr, prefix=n - 1, scale=layer.scaling)) < 1e-5


def test_mla_dims_other_than_576_512_refused(fib):
    """FlashInfer's MLA kernels are instantiated for 512 + 64: other absorbed dims are refused before building."""
    sc = _scenario([make_mla_kind(16, latent=256, rope=32)], 4)
    with pytest.raises(CapabilityMismatch) as ei:
        fib.create(sc.ctx)
    assert "576/512" in ei.value.info.message and "torch_native" in ei.value.info.remedy


def test_mla_workspace_hand_computed():
    """MLA float scratch: 2 x 64 rows per SM of bf16 partial outputs (Dv) and fp32 LSEs, whatever the batch."""
    s = rules.HeadShape(128, 1, 512, mla=True)
    assert rules.mla_bytes(s, 132) == 2 * 64 * 132 * (512 * 2 + 4) + 32 == 17_369_120
    for graph_bs in (0, 1, 256):
        need = rules.workspace_need([s], num_sms=132, max_batch_size=256, cuda_graph_max_bs=graph_bs)
        assert need.bytes == need.parts["mla"] == rules.mla_bytes(s, 132)
    mixed = rules.workspace_need([s, rules.HeadShape(32, 8, 128)], num_sms=132, max_batch_size=8)
    assert mixed.bytes == max(rules.mla_bytes(s, 132), rules.fa2_eager_bytes(rules.HeadShape(32, 8, 128), 132))
    assert rules.shapes_of([make_mla_kind(128)]) == [s]
    rules.check_backend_workspace(rules.DEFAULT_WORKSPACE_BYTES, WorkspaceQuery(
        kinds=[make_mla_kind(128)], num_sms=132, max_reqs=256, graph_max_bs=256), backend="flashinfer")


def test_mla_jit_variants():
    """An MLA kind needs exactly one JIT module: the MLA wrapper's (fa3 on sm90, fa2 elsewhere), dims 576x512."""
    v = variants_for([make_mla_kind(128), make_kind(32, 8, 128, layer_ids=(1,))], "fa2", "bfloat16", "bfloat16",
                     "sm90")
    assert [x.kind for x in v] == ["mla", "prefill", "decode"]
    assert v[0].name == "mla-fa3/bf16-bf16/d576x512/swa0/cap0/sm90"
    assert variants_for([make_mla_kind(16)], "fa2", "float16", "float16", "sm80")[0].name == \
        "mla-fa2/f16-f16/d576x512/swa0/cap0/sm80"


# ---------------------------------------------------------------- fp8 KV


SCALES = [(0.37, 1.7), (1.0, 1.0), (4.0, 0.125)]


@pytest.mark.parametrize("kv", sorted(FP8))
@pytest.mark.parametrize("ks,vs", SCALES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 8), (16, 2)])
def test_fp8_decode_and_extend_match_float64(fib, kv, ks, vs, heads, kv_heads):
    """fp8 KV (e4m3, e5m2) with per-layer scales, bf16 q: extends (always paged, so new tokens are read back as
    stored) and decode (CUDA cores for group 1, tensor cores for groups 4 and 8, per FP8_DECODE_PATH) match float64
    over the dequantized stored K/V; the layer's scales reach every run()."""
    kinds = [make_kind(heads, kv_heads, 16, layer_ids=(0,)), make_kind(heads, kv_heads, 16, layer_ids=(1,))]
    sc = _scenario(kinds, 4, dtype=torch.bfloat16, kv_dtype=FP8[kv], k_scales=[ks, 1.0], v_scales=[vs, 1.0])
    be = fib.create(sc.ctx)
    seen = []
    for kw in be.kinds:
        for w in (kw.paged, kw.decode_cc, kw.decode_tc):
            orig = w.run
            w.run = lambda q, cache, *a, _o=orig, **k: (
                seen.append({n: x for n, x in k.items() if n.endswith("_scale")}), _o(q, cache, *a, **k))[1]
    assert max(_batch_errs(sc, be, ForwardMode.EXTEND, [0, 1, 2], [0, 0, 0], [6, 1, 13])) < 1e-2
    assert not be.extend_ragged and be.kinds[0].mode == "paged"
    assert max(_batch_errs(sc, be, ForwardMode.EXTEND, [0, 3], [0, 0], [4, 9])) < 1e-2
    assert max(_batch_errs(sc, be, ForwardMode.DECODE, [0, 1, 2, 3], [0] * 4, [1] * 4)) < 1e-2
    tc = rules.use_tensor_core_decode(heads // kv_heads, 4, kv)
    assert be.kinds[0].active is (be.kinds[0].decode_tc if tc else be.kinds[0].decode_cc)
    want0 = {} if (ks, vs) == (1.0, 1.0) else {"k_scale": ks, "v_scale": vs}
    assert {tuple(sorted(k.items())) for k in seen} >= {tuple(sorted(want0.items()))}
    assert all(not k or k == want0 for k in seen)  # layer 1 (unit scales) gets none, layer 0 its own


def test_fp8_reference_sees_the_scales(fib):
    """The check can fail: a reference that ignored the stored values' scale misses by far more than the tolerance."""
    sc = _scenario([make_kind(8, 2, 16)], 4, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, k_scales=[0.25],
                   v_scales=[3.0])
    be = fib.create(sc.ctx)
    sc.fill_prefix([0], [9])
    fb = sc.batch(ForwardMode.DECODE, [0], [1])
    be.init_forward_metadata(fb)
    q, k, v = sc.randn(1, 8, 16, scale=2.0), sc.randn(1, 2, 16), sc.randn(1, 2, 16)
    out = be.forward(q, k, v, make_layer(sc.kinds[0], 0), fb).view(1, 8, 16)
    kr, vr = sc.request_kv(0, 0, 10)
    assert rel_err(out, dense_reference(q, kr, vr, prefix=9, scale=sc.kinds[0].scaling)) < 1e-2
    assert rel_err(out, dense_reference(q, kr / 0.25, vr / 3.0, prefix=9, scale=sc.kinds[0].scaling)) > 0.5


def test_fp8_graph_replay_matches_eager(fib):
    """fp8 decode under the CUDA-graph wrappers (scales passed per layer) equals the eager step."""
    sc = _scenario([make_kind(8, 2, 16)], 4, dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2, k_scales=[0.5],
                   v_scales=[2.0], extra={"cuda_graph_max_bs": 4})
    be = fib.create(sc.ctx)
    be.init_cuda_graph_state(4, 4)
    sc.fill_prefix([1, 2], [7, 12])
    fb = sc.batch(ForwardMode.DECODE, [1, 2], [1, 1])
    seq = torch.tensor(fb.seq_lens.tolist())
    be.init_forward_metadata_capture_cuda_graph(2, 2, torch.tensor([1, 2]), seq, None, ForwardMode.DECODE, None)
    be.init_forward_metadata_replay_cuda_graph(2, torch.tensor([1, 2]), seq, 0, None, ForwardMode.DECODE, None, seq)
    layer = make_layer(sc.kinds[0], 0)
    q = sc.randn(2, 8, 16)
    g = be.forward_decode(q, sc.randn(2, 2, 16), sc.randn(2, 2, 16), layer, fb).view(2, 8, 16)
    be.init_forward_metadata(fb)
    e = be.forward_decode(q, None, None, layer, fb, save_kv_cache=False).view(2, 8, 16)
    assert torch.equal(g, e)
    kr, vr = sc.request_kv(0, 1, fb.seq_lens_cpu[0])
    assert rel_err(e[:1], dense_reference(q[:1], kr, vr, prefix=fb.seq_lens_cpu[0] - 1, scale=layer.scaling)) < 1e-2


@pytest.mark.parametrize("what", ["window", "softcap", "sinks", "mla"])
def test_fp8_outside_plain_mha_refused_by_the_factory(fib, what):
    """fp8 KV with windows, softcaps, sinks or MLA is not served (not compiled / verified, or no scale input):
    refused before building, with a remedy naming kv_cache_dtype."""
    kind = {"window": make_kind(8, 2, 16, window=4), "softcap": make_kind(8, 2, 16, softcap=5.0),
            "sinks": make_kind(8, 2, 16, sinks=True), "mla": make_mla_kind(16)}[what]
    sc = _scenario([kind], 4, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(CapabilityMismatch) as ei:
        fib.create(sc.ctx)
    assert "kv_cache_dtype" in ei.value.info.remedy


def test_fp8_fa3_refused_by_the_factory(fib):
    """fa3 with an fp8 cache (did not compile in FlashInfer 0.6.13; not verified with 0.7.2) is refused, pointing at
    flashinfer."""
    sc = _scenario([make_kind(8, 2, 128)], 4, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, name="fa3")
    with pytest.raises(CapabilityMismatch) as ei:
        fib.create_fa3(sc.ctx)
    assert "flashinfer" in ei.value.info.remedy


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_jit_variants_carry_the_kv_dtype(kv):
    """The fp8 variants name the KV dtype (our name or torch's gives the same modules)."""
    kind = make_kind(32, 8, 128)
    short = "e4m3" if kv == "fp8_e4m3" else "e5m2"
    names = [v.name for v in variants_for([kind], "fa2", "bfloat16", kv, "sm90")]
    assert names == [f"prefill-fa2/bf16-{short}/d128/swa0/cap0/sm90",
                     f"decode-cuda_core/bf16-{short}/d128/swa0/cap0/sm90"]
    torch_name = str(FP8[kv]).replace("torch.", "")
    assert [v.name for v in variants_for([kind], "fa2", "bfloat16", torch_name, "sm90")] == names


# ---------------------------------------------------------------- the runner flow on a fake GPU


@pytest.mark.parametrize("config,flags", [("deepseek-v2-lite.json", {}), ("deepseek-v3.json", {}),
                                          ("llama-3.1-8b.json", {"kv_cache_dtype": "fp8_e4m3"}),
                                          ("qwen3-8b.json", {"kv_cache_dtype": "fp8_e5m2"})])
def test_runner_flow_resolves_flashinfer_by_auto_on_a_fake_sm90(fib, config, flags, monkeypatch):
    """`attn-setup run`'s flow (model stack, pool, pipeline, verification, model steps) on a fake sm90 device with
    the fake FlashInfer: DeepSeek (MLA) and fp8 KV resolve flashinfer by auto, build over the one-latent-buffer /
    fp8 pool, and every instance and model step passes against float64. (CUDA graphs cannot be captured on CPU:
    disabled here; tests/gpu/test_bundled_run_gpu.py captures them on the H200.) DeepSeek-V3 with 16 of its 128
    heads (the fake's loops are slow; same dims and scale)."""
    import msgspec

    from conftest import CONFIGS
    from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec
    from pipeline.platforms.fake import FakePlatform
    from pipeline.runtime.runner import Runner, RunnerConfig
    from pipeline.runtime.model_steps import verify_model_steps
    from pipeline.memory.pools import check_needs
    from pipeline.runtime.verify import verify_built

    model = load_model_spec(CONFIGS / config)
    if model.num_attention_heads > 32:
        model = msgspec.structs.replace(model, num_attention_heads=16, num_key_value_heads=16)
    gpu = DeviceFacts(type="cuda", index=0, name="fake sm90", vendor="nvidia", compute_capability=(9, 0), sm_count=4,
                      total_memory_bytes=80 << 30, cuda_version="12.8", source="test")
    pool = PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=check_needs(8, 4).verify_slots + 32 * 4, page_size=4)
    args = AttentionArgs(page_size=4, disable_cuda_graph=True, flashinfer_workspace_size=64 << 20, **flags)
    req = SetupRequest(args=args, model=model, pool=pool, device="cuda")
    installed = {"torch": True, "triton": True, "flashinfer-python": True}
    with Runner(RunnerConfig(request=req, num_layers=1), platform=FakePlatform(gpu), installed=installed) as r:
        r.initialize()
        res = r.backends.resolution
        assert (res.pair.prefill, res.pair.decode, res.rules["decode"]) == ("flashinfer", "flashinfer", "auto")
        kv = r.pools["kv_pool"]
        assert (kv.mla_layers == {0}) is model.is_mla and (str(kv.dtype).startswith("torch.float8") is bool(flags))
        steps = verify_model_steps(r, decode_steps=1)
        assert steps and all(s.passed and not s.graph for s in steps), steps
        verified = verify_built(r.backends, r.request, pools=r.pools, decode_steps=1)
        assert verified and all(v.passed for v in verified), verified
