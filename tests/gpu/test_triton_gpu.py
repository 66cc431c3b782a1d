"""The Triton backend on a CUDA GPU: its grid against torch_native (fp32) and the float64 reference.

Batches 1…256, ragged contexts up to 32k, pages 1/16/64, GQA 1/4/8, head dims 64/96/128/256,
bf16/fp16, sliding window / softcap / sinks. Outputs are NaN-poisoned first; the metric is
``max|out - ref| / max|ref|`` per request, bf16/fp16 tolerance 1e-2. A CUDA graph captured once
replays equal to eager execution for changed lengths. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pipeline.backends.base import AttentionLayer  # noqa: E402
from pipeline.core.contracts import ForwardMode  # noqa: E402
from pipeline.platforms.cuda import capture_graph
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch  # noqa: E402
from pipeline.runtime.reference import reference_attention, rel_err  # noqa: E402

DEV = "cuda"
TOL = 1e-2


def _backends(h, hkv, d):
    from pipeline.backends.torch_native import TorchNativeBackend
    from pipeline.backends.triton.backend import TritonAttnBackend

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return TritonAttnBackend(torch_device=DEV, layer_dims=[(h, hkv, d, d)], num_sms=sms), TorchNativeBackend(torch_device=DEV)


def _layer(h, hkv, d, features, seed, chunk=None):
    g = torch.Generator().manual_seed(seed)
    return AttentionLayer(layer_id=0, num_heads=h, num_kv_heads=hkv, head_dim=d, v_head_dim=d, scaling=d ** -0.5,
                          sliding_window=300 if "window" in features else None,
                          logit_softcap=4.0 if "softcap" in features else None,
                          sinks=(torch.randn(h, generator=g) * 2).to(DEV) if "sinks" in features else None,
                          attention_chunk_size=chunk)


def _setup(prefix, page, h, hkv, d, dtype, seed, extra):
    """Pools with the given prefixes cached (random K/V in every slot); room for ``extra`` more tokens."""
    total = sum(prefix) + extra
    slots = (total // page + len(prefix) * 2 + 4) * page
    rp = ReqToTokenPool(len(prefix) + 1, max(prefix) + extra + 1, DEV)
    kv = KVPool(slots, page, [(hkv, d, d)], dtype, DEV)
    kv.k_buffer[0].normal_()
    kv.v_buffer[0].normal_()
    alloc = PageAllocator(rp, slots, page, seed=seed)
    rows = list(range(1, len(prefix) + 1))
    for r, p in zip(rows, prefix):
        if p:
            alloc.extend(r, p)
    return rp, kv, alloc, rows


def _check_against_refs(out, tn_out, fb, layer, q, sample):
    """Every request vs torch_native; sampled requests vs the float64 reference."""
    assert not torch.isnan(out).any()
    pool, r2t = fb.token_to_kv_pool, fb.req_to_token_pool.req_to_token
    h, d = layer.num_heads, layer.head_dim
    new = fb.extend_seq_lens_cpu
    starts = [sum(new[:i]) for i in range(len(new))]
    for i in range(fb.batch_size):
        sl = slice(starts[i], starts[i] + new[i])
        assert rel_err(out[sl], tn_out[sl]) <= TOL, ("torch_native", i)
    for i in sample:
        sl = slice(starts[i], starts[i] + new[i])
        row, s = int(fb.req_pool_indices[i]), fb.seq_lens_cpu[i]
        slots = r2t[row, :s].long()
        ref = reference_attention(q[sl].view(-1, h, d), pool.k_buffer[0][slots], pool.v_buffer[0][slots],
                                  q_positions=torch.arange(s - new[i], s, device=DEV), scale=layer.scaling,
                                  window=layer.sliding_window, softcap=layer.logit_softcap, sinks=layer.sinks,
                                  chunk=layer.attention_chunk_size)
        assert rel_err(out[sl].view(-1, h, d), ref) <= TOL, ("reference", i)


def _run(mode, prefix, new, page, h, hkv, d, dtype, features, seed, chunk=None):
    torch.manual_seed(seed)
    rp, kv, alloc, rows = _setup(prefix, page, h, hkv, d, dtype, seed, extra=sum(new))
    fb = make_forward_batch(mode, rows, new, alloc, kv)
    t = fb.num_tokens
    q = torch.randn(t, h, d, dtype=dtype, device=DEV)
    k = torch.randn(t, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(t, hkv, d, dtype=dtype, device=DEV)
    layer = _layer(h, hkv, d, features, seed, chunk)
    tri, tn = _backends(h, hkv, d)
    tri.init_forward_metadata(fb)
    out = tri.forward(q, k, v, layer, fb)
    tn.init_forward_metadata(fb)
    tn_out = tn.forward(q, k, v, layer, fb, save_kv_cache=False)
    torch.cuda.synchronize()
    _check_against_refs(out, tn_out, fb, layer, q, sample=sorted({0, len(prefix) // 2, len(prefix) - 1}))


def _ragged(b, max_len, seed, min_len=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (b,), generator=g).tolist()
    lens[0] = max_len
    return lens


DECODE_GRID = [
    # (B, max ctx, page, H, Hkv, D, dtype, features)
    (1, 1, 1, 32, 8, 128, torch.bfloat16, ()),
    (7, 5000, 16, 32, 8, 128, torch.bfloat16, ()),
    (256, 2048, 64, 16, 16, 64, torch.float16, ()),
    (64, 32768, 16, 32, 4, 128, torch.bfloat16, ()),
    (16, 3000, 1, 16, 4, 256, torch.bfloat16, ("window", "softcap", "sinks")),
    (33, 1500, 16, 8, 8, 64, torch.bfloat16, ("window",)),
    (9, 2500, 64, 32, 8, 128, torch.float16, ("softcap", "sinks")),
    (5, 32768, 16, 64, 8, 128, torch.bfloat16, ("window", "softcap", "sinks")),
    (12, 4000, 16, 16, 4, 96, torch.bfloat16, ()),
    (128, 1024, 1, 32, 8, 256, torch.float16, ()),
]


@pytest.mark.parametrize("b,ctx,page,h,hkv,d,dtype,features", DECODE_GRID)
def test_decode_grid(b, ctx, page, h, hkv, d, dtype, features):
    """Decode over ragged cached contexts equals torch_native and the float64 reference."""
    _run(ForwardMode.DECODE, _ragged(b, ctx - 1, seed=b + ctx), [1] * b, page, h, hkv, d, dtype, features, seed=b)


EXTEND_GRID = [
    # (prefix, new, page, H, Hkv, D, dtype, features)
    ([0, 100, 3000, 17], [512, 1, 77, 300], 16, 32, 8, 128, torch.bfloat16, ()),
    ([5, 0, 64], [33, 200, 1], 1, 8, 8, 64, torch.float16, ("window",)),
    ([1000, 7, 0], [129, 64, 250], 64, 16, 4, 256, torch.bfloat16, ("window", "softcap", "sinks")),
    ([2000, 31], [100, 257], 16, 64, 8, 128, torch.float16, ("softcap", "sinks")),
    ([300, 0], [90, 45], 16, 16, 4, 96, torch.bfloat16, ()),
    (_ragged(16, 8000, seed=3), _ragged(16, 1000, seed=4, min_len=1), 16, 32, 8, 128, torch.bfloat16, ()),
]


@pytest.mark.parametrize("prefix,new,page,h,hkv,d,dtype,features", EXTEND_GRID)
def test_extend_grid(prefix, new, page, h, hkv, d, dtype, features):
    """Extend (paged prefix + causal new tokens, ragged) equals torch_native and the float64 reference."""
    _run(ForwardMode.EXTEND, prefix, new, page, h, hkv, d, dtype, features, seed=len(prefix) + d)


def _decode_graph_steps(tri, layer, rows, alloc, kv, heads, grows, *, max_bs=16):
    """Capture one decode graph over ``rows`` (one new token each; ``heads`` = (H, Hkv, D)), then for each list in
    ``grows`` lengthen request i by ``grows[i] - 1`` tokens, reverse the rows, draw new q/k/v, replay with the output
    NaN-poisoned, and run the same batch eagerly. Asserts replay == eager bit for bit at every step and yields
    ``(step, batch, q, graphed, eager)`` for the caller's reference checks."""
    (h, hkv, d), bs = heads, len(rows)
    tri.init_cuda_graph_state(max_bs=max_bs, max_num_tokens=max_bs)
    fb = make_forward_batch(ForwardMode.DECODE, rows, [1] * bs, alloc, kv)
    q, k, v = (torch.randn(bs, n, d, dtype=torch.bfloat16, device=DEV) for n in (h, hkv, hkv))
    loc = fb.out_cache_loc.clone()
    fb.out_cache_loc = loc
    tri.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE,
                                                 None)
    g, out = capture_graph(lambda: tri.forward(q, k, v, layer, fb))
    for step, grow in enumerate(grows):
        for r, n in zip(rows, grow):   # lengthen each request by a different amount
            if n > 1:
                alloc.extend(r, n - 1)
        fb2 = make_forward_batch(ForwardMode.DECODE, rows[::-1], [1] * bs, alloc, kv)
        for x in (q, k, v):
            x.normal_()
        loc.copy_(fb2.out_cache_loc)
        tri.init_forward_metadata_replay_cuda_graph(bs, fb2.req_pool_indices, fb2.seq_lens, sum(fb2.seq_lens_cpu),
                                                    None, ForwardMode.DECODE, None, None)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graphed = out.clone()
        tri.init_forward_metadata(fb2)
        eager = tri.forward(q, k, v, layer, fb2, save_kv_cache=False)   # the replay already stored this step's K/V
        assert torch.equal(graphed, eager), step
        yield step, fb2, q, graphed, eager


def test_cuda_graph_replay_equals_eager_for_changed_lengths():
    """A decode graph captured once replays to the eager result after lengths and rows change."""
    h, hkv, d, page, bs = 32, 8, 128, 16, 8
    rp, kv, alloc, rows = _setup([100] * bs, page, h, hkv, d, torch.bfloat16, seed=5, extra=6000)
    layer = _layer(h, hkv, d, ("window", "sinks"), seed=5)
    tri, _ = _backends(h, hkv, d)
    for step, fb2, q, graphed, eager in _decode_graph_steps(tri, layer, rows, alloc, kv, (h, hkv, d),
                                                            [[1] * bs, [500, 1, 3000, 7, 1, 64, 2, 900]]):
        _check_against_refs(graphed, eager, fb2, layer, q, sample=range(bs))


# Chunked local attention (Llama-4-Scout's layers: 40 q / 8 kv heads of 128, chunk 8192), contexts that
# cross chunk boundaries (split-K decode ranges start at the chunk), and small chunks that bite often.
CHUNK_DECODE = [
    # (B, max ctx, page, H, Hkv, D, dtype, features, chunk)
    (8, 20000, 16, 40, 8, 128, torch.bfloat16, (), 8192),
    (64, 3000, 1, 40, 8, 128, torch.bfloat16, (), 1000),
    (5, 9000, 64, 40, 8, 128, torch.float16, ("sinks",), 8192),
    (16, 2500, 16, 32, 8, 128, torch.bfloat16, ("window", "softcap"), 256),
]


@pytest.mark.parametrize("b,ctx,page,h,hkv,d,dtype,features,chunk", CHUNK_DECODE)
def test_chunked_local_attention_decode(b, ctx, page, h, hkv, d, dtype, features, chunk):
    """Chunked decode equals torch_native and the float64 reference over contexts crossing chunk boundaries."""
    _run(ForwardMode.DECODE, _ragged(b, ctx - 1, seed=b + chunk), [1] * b, page, h, hkv, d, dtype, features, seed=b,
         chunk=chunk)


CHUNK_EXTEND = [
    # (prefix, new, page, H, Hkv, D, dtype, features, chunk): boundaries inside prefixes and new tokens
    ([0, 8000, 8190, 100], [512, 400, 5, 300], 16, 40, 8, 128, torch.bfloat16, (), 8192),
    ([1000, 0, 37], [129, 700, 250], 64, 40, 8, 128, torch.bfloat16, ("sinks",), 128),
    ([300, 5], [90, 45], 1, 40, 8, 128, torch.float16, (), 7),
]


@pytest.mark.parametrize("prefix,new,page,h,hkv,d,dtype,features,chunk", CHUNK_EXTEND)
def test_chunked_local_attention_extend(prefix, new, page, h, hkv, d, dtype, features, chunk):
    """Chunked extend equals torch_native and the float64 reference."""
    _run(ForwardMode.EXTEND, prefix, new, page, h, hkv, d, dtype, features, seed=len(prefix) + chunk, chunk=chunk)


def test_chunked_local_attention():
    """A chunked decode graph replays equal to eager after lengths cross chunk boundaries, and equals the
    reference (the chunk start is recomputed from seq_len inside the kernels at replay)."""
    h, hkv, d, page, bs, chunk = 40, 8, 128, 16, 4, 512
    rp, kv, alloc, rows = _setup([500, 1023, 100, 2000], page, h, hkv, d, torch.bfloat16, seed=9, extra=4000)
    layer = _layer(h, hkv, d, (), seed=9, chunk=chunk)
    tri, _ = _backends(h, hkv, d)
    for step, fb2, q, graphed, eager in _decode_graph_steps(tri, layer, rows, alloc, kv, (h, hkv, d),
                                                            [[12, 1, 412, 48], [700, 2, 3, 1]], max_bs=8):
        _check_against_refs(graphed, eager, fb2, layer, q, sample=range(bs))


# ------------------------------------------------------------------------------------------ GQA-packed extend
@pytest.mark.parametrize("prefix,new,page,h,hkv,d,dtype,features", [EXTEND_GRID[0], EXTEND_GRID[2], EXTEND_GRID[5]])
def test_extend_grid_gqa_packed(prefix, new, page, h, hkv, d, dtype, features):
    """Extend with the GQA group's heads packed into each program's rows (forced on, any extend length) equals
    torch_native and the float64 reference, as the unpacked layout does."""
    import dataclasses

    from pipeline.backends.triton import launch
    from pipeline.backends.triton.backend import TritonAttnBackend

    torch.manual_seed(len(prefix) + d)
    rp, kv, alloc, rows = _setup(prefix, page, h, hkv, d, dtype, len(prefix) + d, extra=sum(new))
    fb = make_forward_batch(ForwardMode.EXTEND, rows, new, alloc, kv)
    t = fb.num_tokens
    q, k, v = (torch.randn(t, n, d, dtype=dtype, device=DEV) for n in (h, hkv, hkv))
    layer = _layer(h, hkv, d, features, len(prefix) + d)
    cfg = dataclasses.replace(launch.default_extend_config(d, torch.device(DEV)), pack_gqa=True)
    tri = TritonAttnBackend(torch_device=DEV, layer_dims=[(h, hkv, d, d)], extend_config=cfg,
                            num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    _, tn = _backends(h, hkv, d)
    tri.init_forward_metadata(fb)
    out = tri.forward(q, k, v, layer, fb)
    tn.init_forward_metadata(fb)
    tn_out = tn.forward(q, k, v, layer, fb, save_kv_cache=False)
    torch.cuda.synchronize()
    _check_against_refs(out, tn_out, fb, layer, q, sample=sorted({0, len(prefix) // 2, len(prefix) - 1}))


# ------------------------------------------------------------------------------------------ fp8 KV
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _fp8_pool(slots, page, hkv, d, fmt, ks, vs):
    """An fp8 KVPool carrying the scales where it takes them (pipeline.backends.memory's contract); (pool, has_scales)."""
    try:
        return KVPool(slots, page, [(hkv, d, d)], FP8[fmt], DEV, k_scales=[ks], v_scales=[vs]), True
    except TypeError:
        return KVPool(slots, page, [(hkv, d, d)], FP8[fmt], DEV), False


def _fp8_setup(prefix, page, h, hkv, d, fmt, ks, vs, seed, extra):
    """An fp8 pool (stored = round_to_fp8(real / scale), real ~ N(0, 1)) with the prefixes cached."""
    total = sum(prefix) + extra
    slots = (total // page + len(prefix) * 2 + 4) * page
    rp = ReqToTokenPool(len(prefix) + 1, max(prefix) + extra + 1, DEV)
    kv, _ = _fp8_pool(slots, page, hkv, d, fmt, ks, vs)
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv.k_buffer[0].copy_((torch.randn(slots, hkv, d, device=DEV, generator=g) / ks).to(FP8[fmt]))
    kv.v_buffer[0].copy_((torch.randn(slots, hkv, d, device=DEV, generator=g) / vs).to(FP8[fmt]))
    alloc = PageAllocator(rp, slots, page, seed=seed)
    rows = list(range(1, len(prefix) + 1))
    for r, p in zip(rows, prefix):
        if p:
            alloc.extend(r, p)
    return rp, kv, alloc, rows


def _dequantised(kv, ks, vs):
    deq = KVPool(kv.size, kv.page_size, [(kv.k_buffer[0].shape[1], kv.k_buffer[0].shape[2], kv.v_buffer[0].shape[2])],
                 torch.float32, DEV)
    deq.k_buffer[0].copy_(kv.k_buffer[0].float() * ks)
    deq.v_buffer[0].copy_(kv.v_buffer[0].float() * vs)
    return deq


FP8_GRID = [
    # (mode, prefix (decode: ctx), new, page, H, Hkv, D, fmt, k_scale, v_scale, scales as tensors, features)
    ("decode", 4096, None, 16, 32, 8, 128, "e4m3", 0.5, 0.25, False, ()),
    ("decode", 32768, None, 1, 32, 8, 128, "e5m2", 1.7, 0.3, True, ("window",)),
    ("decode", 2000, None, 64, 16, 16, 128, "e4m3", 0.02, 3.0, True, ("softcap", "sinks")),   # MHA
    ("decode", 3000, None, 16, 8, 8, 64, "e5m2", 2.0, 0.5, False, ()),                        # MHA, D 64
    ("extend", [0, 100, 3000, 17], [512, 1, 77, 300], 16, 32, 8, 128, "e4m3", 0.5, 0.25, True, ()),
    ("extend", [1000, 7, 0], [129, 64, 250], 64, 32, 8, 128, "e5m2", 1.3, 0.7, False, ("window", "sinks")),
    ("extend", [5, 0, 64], [33, 200, 1], 1, 16, 16, 128, "e4m3", 0.05, 4.0, False, ("softcap",)),   # MHA
]


@pytest.mark.parametrize("mode,prefix,new,page,h,hkv,d,fmt,ks,vs,as_tensor,features", FP8_GRID)
def test_fp8_kv_grid(mode, prefix, new, page, h, hkv, d, fmt, ks, vs, as_tensor, features):
    """fp8 K/V (e4m3 / e5m2, non-unit scales as floats or device tensors, bf16 q), GQA 32/8 and MHA, ragged
    contexts, pages 1/16/64: decode and extend equal torch_native over the dequantised stored K/V for every
    request and float64 for sampled ones; outputs NaN-poisoned first."""
    import dataclasses

    from pipeline.backends.torch_native import TorchNativeBackend
    from pipeline.backends.triton import launch

    seed = h + d + page
    torch.manual_seed(seed)
    if mode == "decode":
        b = {4096: 64, 32768: 7, 2000: 33, 3000: 5}[prefix]
        prefix, new = _ragged(b, prefix - 1, seed=b), [1] * b
    rp, kv, alloc, rows = _fp8_setup(prefix, page, h, hkv, d, fmt, ks, vs, seed, extra=sum(new))
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    fb = make_forward_batch(fm, rows, new, alloc, kv)
    t, loc = fb.num_tokens, fb.out_cache_loc
    kv.k_buffer[0][loc] = (torch.randn(t, hkv, d, device=DEV) / ks).to(FP8[fmt])   # the step's new K/V, stored
    kv.v_buffer[0][loc] = (torch.randn(t, hkv, d, device=DEV) / vs).to(FP8[fmt])
    q = torch.randn(t, h, d, dtype=torch.bfloat16, device=DEV)
    layer = _layer(h, hkv, d, features, seed)
    scales = dict(k_scale=torch.tensor(ks, device=DEV), v_scale=torch.tensor(vs, device=DEV)) if as_tensor else \
        dict(k_scale=ks, v_scale=vs)
    feats = dict(sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap, sinks=layer.sinks)
    out = torch.full((t, h, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    kb, vb, r2t = kv.k_buffer[0], kv.v_buffer[0], rp.req_to_token
    if mode == "decode":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        launch.decode_attention(q, kb, vb, r2t, fb.req_pool_indices, fb.seq_lens, out, sm_scale=layer.scaling,
                                max_splits=launch.decode_max_splits(t, hkv, sms, launch.DecodeConfig()), **feats,
                                **scales)
    else:
        qo = torch.zeros(len(new) + 1, dtype=torch.int32, device=DEV)
        qo[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        launch.extend_attention(q, kb[loc], vb[loc], kb, vb, r2t, fb.req_pool_indices, qo, fb.extend_prefix_lens,
                                out, max_extend_len=max(new), sm_scale=layer.scaling, **feats, **scales)
    torch.cuda.synchronize()
    deq = _dequantised(kv, ks, vs)
    fb_deq = dataclasses.replace(fb, token_to_kv_pool=deq)
    tn = TorchNativeBackend(torch_device=DEV)
    tn.init_forward_metadata(fb_deq)
    tn_out = tn.forward(q, deq.k_buffer[0][loc], deq.v_buffer[0][loc], layer, fb_deq, save_kv_cache=False)
    _check_against_refs(out.view(t, h * d), tn_out, fb_deq, layer, q, sample=sorted({0, len(rows) // 2,
                                                                                     len(rows) - 1}))


def test_fp8_cuda_graph_replay_equals_eager():
    """An fp8 (e4m3) pool through the backend, the layer carrying non-unit k_scale / v_scale: a decode graph
    captured once replays to the eager result bit for bit after rows and lengths change, and equals float64
    over the dequantised stored K/V."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class ScaledLayer(AttentionLayer):
        k_scale: float = 1.0
        v_scale: float = 1.0

    h, hkv, d, page, bs, ks, vs = 32, 8, 128, 16, 8, 0.5, 2.0
    rp, kv, alloc, rows = _fp8_setup([100] * bs, page, h, hkv, d, "e4m3", ks, vs, seed=7, extra=6000)
    base = _layer(h, hkv, d, ("window",), seed=7)
    pool_scales = hasattr(kv, "kv_scales")   # the pool's scales win where it has them (triton/backend.py)
    layer = base if pool_scales else ScaledLayer(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                                                 k_scale=ks, v_scale=vs)
    tri, _ = _backends(h, hkv, d)
    for step, fb2, q, graphed, _ in _decode_graph_steps(tri, layer, rows, alloc, kv, (h, hkv, d),
                                                        [[1] * bs, [500, 1, 3000, 7, 1, 64, 2, 900]]):
        r2t, kb, vb = fb2.req_to_token_pool.req_to_token, kv.k_buffer[0], kv.v_buffer[0]
        for i in range(bs):
            slots = r2t[int(fb2.req_pool_indices[i]), :fb2.seq_lens_cpu[i]].long()
            ref = reference_attention(q[i:i + 1], kb[slots].double() * ks, vb[slots].double() * vs,
                                      q_positions=torch.tensor([fb2.seq_lens_cpu[i] - 1], device=DEV),
                                      scale=layer.scaling, window=layer.sliding_window)
            assert rel_err(graphed[i:i + 1].view(1, h, d), ref) <= TOL, (step, i)
