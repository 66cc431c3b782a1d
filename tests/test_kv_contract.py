"""The KV-cache contract of pipeline/memory.py: fp8 storage with per-layer scales, one latent buffer per
MLA layer, and the backends and verification reading it.

- the write rule ``stored = fp8(clamp(x / scale))`` against an fp8 rounding written here in float64 from the formats'
  definitions (hypothesis, both formats, any scale), and the read rule ``real = stored * scale``;
- a pool round trip through ``set_kv_buffer`` at random slots (hypothesis), MLA layers included;
- the pool's refusals (scales, MLA dims), its bytes, the given-pool check of build-mode;
- torch_native and ``verify_backend`` over fp8 caches with non-unit scales against float64 over the dequantized
  stored K/V — and the same checks failing when the scales are ignored.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.backends import torch_native as tn
from pipeline.backends.base import AttentionLayer
from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import ConfigError
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, dequantize_kv, make_forward_batch, quantize_kv
from pipeline.memory.pools import kv_bytes_per_token
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.runtime.verify import tolerance, verify_backend

# (mantissa bits, smallest normal exponent, largest finite value) of each format (OCP FP8: E4M3 without inf, E5M2)
FORMATS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}
FP8 = list(FORMATS)


def fp8_round(x: float, dtype: torch.dtype) -> float:
    """The fp8 value nearest to ``x`` (ties to even), saturating at ±max: written from the format's definition."""
    mbits, emin, fmax = FORMATS[dtype]
    if math.isnan(x):
        return math.nan
    a = min(abs(x), fmax)
    if a == 0.0:
        return math.copysign(0.0, x)
    e = max(math.frexp(a)[1] - 1, emin)            # binade of a (subnormals share the smallest normal's step)
    step = 2.0 ** (e - mbits)
    return math.copysign(round(a / step) * step, x)  # a / step is exact; round() ties to even


f32 = st.floats(width=32, allow_nan=False, allow_infinity=True)
scales = st.sampled_from([1.0, 0.5, 0.37, 3.0, 1e-3, 1e3]) | st.floats(1e-3, 1e3)


@settings(max_examples=400, deadline=None)
@given(xs=st.lists(f32, min_size=1, max_size=16), scale=scales, dtype=st.sampled_from(FP8))
def test_write_rule_rounds_and_saturates_like_the_format(xs, scale, dtype):
    """quantize_kv == the float64 fp8 rounding of float32(x) / scale (clamped to ±max); dequantize multiplies back."""
    x = torch.tensor(xs, dtype=torch.float32)
    y = (x / scale).tolist()                        # the division in float32, as the pool does it
    stored = quantize_kv(x, dtype, scale)
    assert stored.dtype == dtype
    want = [fp8_round(v, dtype) for v in y]
    got = stored.to(torch.float64).tolist()
    assert got == want, (xs, scale, got, want)
    assert dequantize_kv(stored, scale, torch.float64).tolist() == [w * scale for w in want]


@settings(max_examples=200, deadline=None)
@given(xs=st.lists(st.floats(-400.0, 400.0, width=32), min_size=1, max_size=16), dtype=st.sampled_from(FP8))
def test_relative_error_of_a_normal_value_is_half_a_step(xs, dtype):
    """Within the normal range the stored value is within 2^-(m+1) relative of x (1/16 e4m3, 1/8 e5m2)."""
    mbits, emin, _ = FORMATS[dtype]
    for x, s in zip(xs, quantize_kv(torch.tensor(xs), dtype).double().tolist()):
        if abs(x) >= 2.0 ** emin:
            assert abs(s - x) <= abs(x) * 2.0 ** -(mbits + 1)


def test_non_fp8_pools_store_the_cast_value():
    """bf16/fp16/fp32 pools store x cast to their dtype (scale 1), no clamp."""
    x = torch.tensor([1e5, -3.3, 1e-8])
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(quantize_kv(x, dt), x.to(dt))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FP8 + [torch.bfloat16]), page=st.sampled_from([1, 3, 16]))
def test_pool_round_trip(data, dtype, page):
    """set_kv_buffer at random distinct slots, then the buffers hold quantize_kv of what was written; an MLA layer
    stores K only and its V is the first Dv dims of the same bytes."""
    fp8 = dtype in FORMATS
    ks = [data.draw(st.sampled_from([1.0, 0.25, 2.5])) if fp8 else 1.0 for _ in range(2)]
    vs = [data.draw(st.sampled_from([1.0, 0.6, 8.0])) if fp8 else 1.0, ks[1]]  # MLA layer 1: one latent scale
    pool = KVPool(64 * page, page, [(2, 8, 8), (1, 12, 8)], dtype, "cpu", mla_layers=[1], k_scales=ks, v_scales=vs)
    n = data.draw(st.integers(1, 20))
    slots = torch.tensor(data.draw(st.lists(st.integers(0, 64 * page - 1), min_size=n, max_size=n, unique=True)))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k0, v0 = torch.randn(n, 2, 8, generator=gen) * 50, torch.randn(n, 2, 8, generator=gen) * 50
    k1 = torch.randn(n, 1, 12, generator=gen) * 50
    pool.set_kv_buffer(0, slots, k0.to(torch.bfloat16), v0.to(torch.bfloat16))
    pool.set_kv_buffer(1, slots, k1.to(torch.bfloat16), torch.full((n, 1, 8), 1e9))  # MLA: v ignored
    assert torch.equal(pool.k_buffer[0][slots], quantize_kv(k0.to(torch.bfloat16), dtype, ks[0]))
    assert torch.equal(pool.v_buffer[0][slots], quantize_kv(v0.to(torch.bfloat16), dtype, vs[0]))
    stored = quantize_kv(k1.to(torch.bfloat16), dtype, ks[1])
    assert torch.equal(pool.k_buffer[1][slots], stored) and torch.equal(pool.v_buffer[1][slots], stored[..., :8])
    assert pool.v_buffer[1].data_ptr() == pool.k_buffer[1].data_ptr() and pool.kv_scales(1) == (ks[1], ks[1])
    untouched = torch.ones(64 * page, dtype=torch.bool)
    untouched[slots] = False
    assert not pool.k_buffer[0][untouched].float().any() and not pool.k_buffer[1][untouched].float().any()


def test_mla_pool_holds_one_buffer_and_counts_it_once():
    """An MLA layer's bytes are D per token (not D + Dv), in the pool and in the sizing formula."""
    kind = LayerKind(kind="full", num_heads=16, num_kv_heads=1, head_dim_qk=576, head_dim_v=512, scaling=0.1,
                     is_mla=True, layer_ids=[0, 1, 2])
    for dtype, name, elem in ((torch.bfloat16, "bfloat16", 2), (torch.float8_e4m3fn, "fp8_e4m3", 1)):
        pool = KVPool.for_layer_kinds([kind], 3, 32, 16, dtype, "cpu")
        assert pool.mla_layers == {0, 1, 2} and pool.nbytes() == 3 * 32 * 576 * elem
        assert kv_bytes_per_token([kind], 3, name) == 3 * 576 * elem
        assert all(v.shape == (32, 1, 512) and v.data_ptr() == k.data_ptr() for k, v in zip(pool.k_buffer,
                                                                                               pool.v_buffer))
    gqa = LayerKind(kind="full", num_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_v=64, scaling=0.1,
                    layer_ids=[0])
    assert kv_bytes_per_token([gqa], 1, "fp8_e5m2") == 2 * 128


@pytest.mark.parametrize("kw,field", [
    (dict(k_scales=[1.0]), "k_scales"),
    (dict(k_scales=[0.5, 0.0]), "k_scales[1]"),
    (dict(v_scales=[math.nan, 1.0]), "v_scales[0]"),
    (dict(k_scales=[math.inf, 1.0]), "k_scales[0]"),
    (dict(k_scales=[True, 1.0]), "k_scales[0]"),
    (dict(dtype=torch.bfloat16, k_scales=[2.0, 1.0]), "k_scales[0]"),
    (dict(mla_layers=[0]), "layer_dims[0]"),
    (dict(layer_dims=[(2, 8, 8), (1, 12, 8)], mla_layers=[1], k_scales=[1.0, 2.0]), "v_scales[1]"),
])
def test_pool_refuses_bad_scales_and_mla_dims(kw, field):
    """A scale list of the wrong length, a scale that is not finite > 0 (or a bool), a non-unit scale on a bf16
    cache, an MLA layer that is not one latent head, or two scales on one latent buffer: ConfigError naming it."""
    args = dict(layer_dims=[(2, 8, 8), (2, 8, 8)], dtype=torch.float8_e4m3fn)
    args.update(kw)
    with pytest.raises(ConfigError) as ei:
        KVPool(16, 1, args.pop("layer_dims"), args.pop("dtype"), "cpu", **args)
    assert ei.value.info.code == "invalid_value" and ei.value.info.flags[0].name == field and ei.value.info.remedy


# ---------------------------------------------------------------- backends and verification over the contract


def _drive(backend, layer, kv_dtype, ks, vs, q_dtype=torch.bfloat16, page=4, seed=0):
    """Extend (with and without prefixes) and decode through ``backend``; per-request rel. errors against float64
    over the dequantized stored K/V (written here from the scales, independently of the pool's read path)."""
    mla = layer.is_mla
    r2t = ReqToTokenPool(8, 64, "cpu")
    kv = KVPool(64 * page, page, [(layer.num_kv_heads, layer.head_dim, layer.v_head_dim)], kv_dtype, "cpu",
                mla_layers=[0] if mla else [], k_scales=[ks], v_scales=[vs])
    alloc = PageAllocator(r2t, 64 * page, page, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    hist: dict[int, tuple[list, list]] = {}
    errs = []
    steps = [(ForwardMode.EXTEND, [0, 1], [5, 9]), (ForwardMode.EXTEND, [0, 2], [3, 4]),
             (ForwardMode.DECODE, [0, 1, 2], [1, 1, 1])]
    for mode, rows, new in steps:
        fb = make_forward_batch(mode, rows, new, alloc, kv)
        backend.init_forward_metadata(fb)
        t = sum(new)
        q = (torch.randn(t, layer.num_heads, layer.head_dim, generator=gen) * 2).to(q_dtype)
        k = (torch.randn(t, layer.num_kv_heads, layer.head_dim, generator=gen) * 3).to(q_dtype)
        v = k[..., :layer.v_head_dim].clone() if mla else \
            (torch.randn(t, layer.num_kv_heads, layer.v_head_dim, generator=gen) * 3).to(q_dtype)
        out = backend.forward(q, k, v, layer, fb).reshape(t, layer.num_heads, layer.v_head_dim)
        start = 0
        for r, n in zip(rows, new):
            sl = slice(start, start + n)
            kh, vh = hist.setdefault(r, ([], []))
            kh.append(torch.tensor([fp8_round(x / ks, kv_dtype) * ks for x in k[sl].float().flatten().tolist()],
                                   dtype=torch.float64).view(n, layer.num_kv_heads, layer.head_dim))
            vv = kh[-1][..., :layer.v_head_dim] if mla else torch.tensor(
                [fp8_round(x / vs, kv_dtype) * vs for x in v[sl].float().flatten().tolist()],
                dtype=torch.float64).view(n, layer.num_kv_heads, layer.v_head_dim)
            vh.append(vv)
            kk, vvv = torch.cat(kh), torch.cat(vh)
            ref = reference_attention(q[sl], kk, vvv, q_positions=torch.arange(len(kk) - n, len(kk)),
                                      scale=layer.scaling)
            errs.append(rel_err(out[sl], ref))
            start += n
    return errs


LAYERS = {
    "gqa": AttentionLayer(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=32, v_head_dim=32, scaling=32 ** -0.5),
    "mha": AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=4, head_dim=32, v_head_dim=32, scaling=32 ** -0.5),
    "mla": AttentionLayer(layer_id=0, num_heads=8, num_kv_heads=1, head_dim=80, v_head_dim=64, scaling=0.15,
                          is_mla=True),
}


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("ks,vs", [(0.37, 1.7), (4.0, 0.125)])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_torch_native_reads_the_dequantized_stored_values(kv_dtype, ks, vs, kind):
    """torch_native over an fp8 cache with non-unit scales (GQA, MHA, MLA with its one latent buffer) matches float64
    over the dequantized stored K/V within the bf16 tolerance; ignoring the scales misses it by far."""
    layer = LAYERS[kind]
    if layer.is_mla:
        vs = ks  # one latent buffer, one scale
    assert max(_drive(TorchNativeBackend(), layer, kv_dtype, ks, vs)) <= tolerance("bfloat16", kv_dtype)
    assert max(_drive(TorchNativeBackend(), layer, kv_dtype, ks, vs, q_dtype=torch.float32)) <= 1e-4


def test_torch_native_ignoring_the_scales_fails_the_same_check(monkeypatch):
    """The check can fail: a torch_native that read stored values without their scales is far off."""
    monkeypatch.setattr(tn, "layer_kv_scales", lambda pool, lid: (1.0, 1.0))
    assert max(_drive(TorchNativeBackend(), LAYERS["gqa"], torch.float8_e4m3fn, 0.37, 1.7)) > 0.1


@pytest.mark.parametrize("kv_dtype", FP8)
def test_verify_backend_over_scaled_fp8_and_its_failure(kv_dtype, monkeypatch):
    """verify_backend on an fp8 pool with non-unit scales passes for torch_native (its detail states the scales),
    and fails (passed=False) for a backend that ignores them."""
    kind = LayerKind(kind="full", num_heads=8, num_kv_heads=2, head_dim_qk=64, head_dim_v=64, scaling=0.125,
                     layer_ids=[0, 1])
    mla = LayerKind(kind="full", num_heads=8, num_kv_heads=1, head_dim_qk=80, head_dim_v=64, scaling=0.15,
                    is_mla=True, layer_ids=[2])
    for kinds, ks, vs in (([kind], [0.5, 3.0], [2.0, 0.25]), ([mla], [1.0, 1.0, 0.3], [1.0, 1.0, 0.3])):
        n = 1 + max(l for k in kinds for l in k.layer_ids)
        pool = KVPool.for_layer_kinds(kinds, n, 64 * 4, 4, kv_dtype, "cpu", k_scales=ks[:n], v_scales=vs[:n])
        r2t = ReqToTokenPool(8, 64, "cpu")
        res = verify_backend(TorchNativeBackend(layer_kinds=kinds), role="primary", name="torch_native", model=None,
                             layer_kinds=kinds, req_to_token_pool=r2t, kv_pool=pool, torch_device="cpu",
                             dtype="bfloat16")
        assert res.passed and res.max_rel_err <= res.tol == 1e-2, res
        assert "k_scale/v_scale" in res.detail and str(kv_dtype).replace("torch.", "") in res.detail
        with monkeypatch.context() as m:
            m.setattr(tn, "layer_kv_scales", lambda pool, lid: (1.0, 1.0))
            bad = verify_backend(TorchNativeBackend(layer_kinds=kinds), role="primary", name="torch_native",
                                 model=None, layer_kinds=kinds, req_to_token_pool=r2t, kv_pool=pool,
                                 torch_device="cpu", dtype="bfloat16")
        assert not bad.passed and bad.max_rel_err > 0.1


def test_given_pools_need_one_latent_buffer_per_mla_layer():
    """build-mode refuses an engine's MLA pool whose V is a separate tensor (pools_mismatch naming v_buffer)."""
    from pipeline.setup.build import build_attention_backends
    from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec
    from conftest import CONFIGS

    model = load_model_spec(CONFIGS / "deepseek-v2-lite.json")
    import msgspec

    model = msgspec.structs.replace(model, num_hidden_layers=2, layer_types=model.layer_types[:2])
    facts = PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=128, page_size=1)
    req = SetupRequest(args=AttentionArgs(attention_backend="torch_native"), model=model, device="cpu", pool=facts)
    kinds = model.layer_kinds()
    good = KVPool.for_layer_kinds(kinds, 2, 128, 1, torch.bfloat16, "cpu")
    pools = {"req_to_token_pool": ReqToTokenPool(4, 64, "cpu"), "kv_pool": good}
    with build_attention_backends(req, pools=pools) as out:
        assert out.attn_backend is not None
    good.v_buffer[1] = good.v_buffer[1].clone()  # the old layout: a second V copy
    with pytest.raises(ConfigError) as ei:
        build_attention_backends(req, pools=pools)
    assert ei.value.info.code == "pools_mismatch" and ei.value.info.flags[0].name == "pools.kv_pool.v_buffer[1]"
