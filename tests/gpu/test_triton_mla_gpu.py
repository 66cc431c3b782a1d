"""The absorbed-MLA Triton kernels on a CUDA GPU at DeepSeek-V2-Lite (16 heads) and DeepSeek-V3 (128 heads) dims.

Latent 512 + rope 64 per cached token, ragged contexts up to 32k, pages 1 / 16 / 64, bf16 and fp16.
Every call writes into an output poisoned with NaN first. Yardsticks: torch_native on the same paged
batch for every request (fp32 math; its V buffer holds the latent's first 512 dims, as the model writes
it), float64 attention (:func:`pipeline.runtime.reference.reference_attention`, head chunks so 128 heads x 32k
keys fit) for sampled requests; tolerance 1e-2 of ``max|ref|`` (bf16/fp16). The backend's routing of
MLA layers must give the launcher's result bit for bit, and a decode CUDA graph replayed after the
lengths change must equal an eager call bit for bit (split path and direct path). Skipped without CUDA.

Run: ``python -m pytest -q tests/gpu/test_triton_mla_gpu.py`` on the GPU machine.
"""

from __future__ import annotations

import math

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
DV, DR = 512, 64
D = DV + DR
# Softmax scales as the models define them: (qk_nope 128 + rope 64)^-0.5 * YaRN mscale(factor 40)^2,
# mscale_all_dim 0.707 (V2-Lite) and 1.0 (V3) — pipeline.core.model_spec computes the same from config.json.
SCALE = {16: 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, 128: 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2}


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _layer(h):
    return AttentionLayer(layer_id=0, num_heads=h, num_kv_heads=1, head_dim=D, v_head_dim=DV, scaling=SCALE[h],
                          is_mla=True)


def _setup(prefix, page, dtype, seed, extra):
    """A latent pool with the given prefixes cached (random rows; V = the rows' first 512 dims, as the model
    writes it); room for ``extra`` more tokens."""
    total = sum(prefix) + extra
    slots = (total // page + len(prefix) * 2 + 4) * page
    rp = ReqToTokenPool(len(prefix) + 1, max(prefix) + extra + 1, DEV)
    kv = KVPool(slots, page, [(1, D, DV)], dtype, DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv.k_buffer[0].normal_(generator=g)
    kv.v_buffer[0].copy_(kv.k_buffer[0][..., :DV])
    alloc = PageAllocator(rp, slots, page, seed=seed)
    rows = list(range(1, len(prefix) + 1))
    for r, p in zip(rows, prefix):
        if p:
            alloc.extend(r, p)
    return rp, kv, alloc, rows


def _ref64(q, rows, scale, q_positions):
    """float64 attention of q [n, H, D] over latent rows [L, 1, D], 16 heads at a time."""
    outs = [reference_attention(q[:, h0:h0 + 16], rows, rows[..., :DV], q_positions=q_positions, scale=scale)
            for h0 in range(0, q.shape[1], 16)]
    return torch.cat(outs, dim=1)


def _check(out, fb, layer, q, sample):
    """Every request vs torch_native; sampled requests vs float64."""
    from pipeline.backends.torch_native import TorchNativeBackend

    assert not torch.isnan(out).any()
    h, new = layer.num_heads, fb.extend_seq_lens_cpu
    tn = TorchNativeBackend(torch_device=DEV)
    tn.init_forward_metadata(fb)
    lat = fb.token_to_kv_pool.k_buffer[0][fb.out_cache_loc]
    tn_out = tn.forward(q, lat, lat[..., :DV], layer, fb, save_kv_cache=False).view(-1, h, DV)
    starts = [sum(new[:i]) for i in range(len(new))]
    for i in range(fb.batch_size):
        sl = slice(starts[i], starts[i] + new[i])
        assert rel_err(out[sl], tn_out[sl]) <= TOL, ("torch_native", i)
    r2t, kb = fb.req_to_token_pool.req_to_token, fb.token_to_kv_pool.k_buffer[0]
    for i in sample:
        sl = slice(starts[i], starts[i] + new[i])
        s = fb.seq_lens_cpu[i]
        rows = kb[r2t[int(fb.req_pool_indices[i]), :s].long()]
        ref = _ref64(q[sl], rows, layer.scaling, torch.arange(s - new[i], s, device=DEV))
        assert rel_err(out[sl], ref) <= TOL, ("float64", i)


def _run(mode, prefix, new, page, h, dtype, seed):
    from pipeline.backends.triton import launch_mla
    from pipeline.backends.triton.backend import TritonAttnBackend

    torch.manual_seed(seed)
    rp, kv, alloc, rows = _setup(prefix, page, dtype, seed, extra=sum(new))
    fb = make_forward_batch(mode, rows, new, alloc, kv)
    t = fb.num_tokens
    q = torch.randn(t, h, D, dtype=dtype, device=DEV)
    kv.k_buffer[0][fb.out_cache_loc] = torch.randn(t, 1, D, dtype=dtype, device=DEV)   # the step's new latent
    kv.v_buffer[0][fb.out_cache_loc] = kv.k_buffer[0][fb.out_cache_loc][..., :DV]
    layer = _layer(h)
    out = torch.full((t, h, DV), float("nan"), dtype=dtype, device=DEV)
    r2t = rp.req_to_token
    if mode is ForwardMode.DECODE:
        cfg = launch_mla.default_mla_decode_config(h, torch.device(DEV))
        launch_mla.mla_decode_attention(q, kv.k_buffer[0], r2t, fb.req_pool_indices, fb.seq_lens, out,
                                        sm_scale=layer.scaling, config=cfg,
                                        max_splits=launch_mla.mla_decode_max_splits(t, h, _sms(), cfg))
    else:
        qo = torch.zeros(len(new) + 1, dtype=torch.int32, device=DEV)
        qo[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        launch_mla.mla_extend_attention(q, kv.k_buffer[0][fb.out_cache_loc], kv.k_buffer[0], r2t,
                                        fb.req_pool_indices, qo, fb.extend_prefix_lens, out,
                                        max_extend_len=max(new), sm_scale=layer.scaling)
    torch.cuda.synchronize()
    _check(out, fb, layer, q, sample=sorted({0, len(prefix) // 2, len(prefix) - 1}))
    be = TritonAttnBackend(torch_device=DEV, layer_dims=[(h, 1, D, DV)], num_sms=_sms())
    be.init_forward_metadata(fb)
    routed = be.forward(q, None, None, layer, fb, save_kv_cache=False).view(t, h, DV)
    assert torch.equal(routed, out), "the backend's MLA route must launch the same kernels"


def _ragged(b, max_len, seed, min_len=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (b,), generator=g).tolist()
    lens[0] = max_len
    return lens


DECODE_GRID = [
    # (B, max ctx, page, H, dtype) — 16 heads: DeepSeek-V2-Lite; 128 heads: DeepSeek-V3
    (1, 1, 1, 16, torch.bfloat16),
    (7, 5000, 16, 16, torch.bfloat16),
    (64, 32768, 16, 16, torch.bfloat16),
    (256, 2048, 64, 16, torch.float16),
    (1, 32768, 1, 128, torch.bfloat16),
    (33, 4096, 1, 128, torch.bfloat16),
    (8, 32768, 64, 128, torch.bfloat16),
    (64, 8192, 16, 128, torch.float16),
    (160, 1024, 16, 128, torch.bfloat16),
]


@pytest.mark.parametrize("b,ctx,page,h,dtype", DECODE_GRID)
def test_mla_decode_grid(b, ctx, page, h, dtype):
    """Decode over ragged cached contexts equals torch_native and float64."""
    _run(ForwardMode.DECODE, _ragged(b, ctx - 1, seed=b + ctx), [1] * b, page, h, dtype, seed=b + h)


EXTEND_GRID = [
    # (prefix, new, page, H, dtype)
    ([0, 100, 3000, 17], [512, 1, 77, 300], 16, 16, torch.bfloat16),
    ([5, 0, 64], [33, 200, 1], 1, 128, torch.float16),
    ([1000, 7, 0], [129, 64, 250], 64, 128, torch.bfloat16),
    ([32000, 12], [64, 5], 16, 128, torch.bfloat16),
    (_ragged(16, 8000, seed=3), _ragged(16, 1000, seed=4, min_len=1), 16, 16, torch.bfloat16),
]


@pytest.mark.parametrize("prefix,new,page,h,dtype", EXTEND_GRID)
def test_mla_extend_grid(prefix, new, page, h, dtype):
    """Extend (paged prefix + causal new tokens, ragged) equals torch_native and float64."""
    _run(ForwardMode.EXTEND, prefix, new, page, h, dtype, seed=len(prefix) + h)


@pytest.mark.parametrize("h,bs", [(16, 8), (128, 8), (128, 64)])
def test_mla_cuda_graph_replay_equals_eager(h, bs):
    """A decode graph captured once replays to the eager result bit for bit after rows and lengths change
    (128 heads at bs 8 takes the split + merge path, at bs 64 the direct path); the graph's output is
    poisoned with NaN before each replay."""
    from pipeline.backends.triton import launch_mla
    from pipeline.backends.triton.backend import TritonAttnBackend

    dtype = torch.bfloat16
    rp, kv, alloc, rows = _setup([100] * bs, 16, dtype, seed=5, extra=bs * 6000)   # growth below: < 5600 each
    layer = _layer(h)
    be = TritonAttnBackend(torch_device=DEV, layer_dims=[(h, 1, D, DV)], num_sms=_sms())
    cfg = launch_mla.default_mla_decode_config(h, torch.device(DEV))
    assert (launch_mla.mla_decode_max_splits(bs, h, _sms(), cfg) == 1) == (h == 128 and bs == 64)
    be.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    fb = make_forward_batch(ForwardMode.DECODE, rows, [1] * bs, alloc, kv)
    q = torch.randn(bs, h, D, dtype=dtype, device=DEV)
    lat = torch.randn(bs, 1, D, dtype=dtype, device=DEV)
    v = torch.empty(bs, 1, DV, dtype=dtype, device=DEV)
    loc = fb.out_cache_loc.clone()
    fb.out_cache_loc = loc
    be.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE,
                                                None)

    def step():   # the latent's V view is copied inside the graph, as the model does before attention
        v.copy_(lat[..., :DV])
        return be.forward(q, lat, v, layer, fb)

    g, out = capture_graph(step)
    gen = torch.Generator().manual_seed(9)
    for step in range(3):
        for r in rows:   # lengthen each request by a different amount (up to ~2900 tokens)
            n = int(torch.randint(0, 3000 // (step + 1), (1,), generator=gen))
            if n:
                alloc.extend(r, n)
        fb2 = make_forward_batch(ForwardMode.DECODE, rows[::-1], [1] * bs, alloc, kv)
        q.normal_()
        lat.normal_()
        loc.copy_(fb2.out_cache_loc)
        be.init_forward_metadata_replay_cuda_graph(bs, fb2.req_pool_indices, fb2.seq_lens, sum(fb2.seq_lens_cpu),
                                                   None, ForwardMode.DECODE, None, None)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        graphed = out.clone()
        be.init_forward_metadata(fb2)
        eager = be.forward(q, lat, lat[..., :DV].contiguous(), layer, fb2)
        assert torch.equal(graphed, eager), step
        _check(graphed.view(bs, h, DV), fb2, layer, q, sample=[0, bs - 1])


@pytest.mark.parametrize("b", [8, 64])
def test_mla_sweep_candidates_are_correct(b):
    """Every config the benchmark sweep may pick (benchmarks/mla_decode.py --sweep) computes DeepSeek-V3 decode
    right (128 heads, ragged contexts up to 6000, page 16; split path at B=8, direct at B=64): against float64
    for sampled requests; the L2-prefetch variants equal the same config without prefetch bit for bit (the
    prefetch moves data, never math)."""
    import dataclasses

    from pipeline.backends.triton import launch_mla

    h, dtype = 128, torch.bfloat16
    lens = _ragged(b, 6000, seed=b, min_len=1)
    # req_to_token rows a multiple of 16 long: the kernels specialise as in the benchmark, whose variants
    # benchmarks/gpu_check.sh's triton part compiles in parallel processes while this runs
    rp, kv, alloc, rows = _setup(lens, 16, dtype, seed=b, extra=-(max(lens) + 1) % 16)
    r2t = rp.req_to_token
    q = torch.randn(b, h, D, dtype=dtype, device=DEV)
    idx = torch.tensor(rows, dtype=torch.int64, device=DEV)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    refs = {i: _ref64(q[i:i + 1], kv.k_buffer[0][r2t[rows[i], :lens[i]].long()], SCALE[h],
                      torch.tensor([lens[i] - 1], device=DEV)) for i in (0, b // 2, b - 1)}
    cands = [("default", launch_mla.default_mla_decode_config(h, torch.device(DEV)))] + list(launch_mla.SWEEP_DECODE)
    outs = {}
    for name, cfg in cands:
        splits = launch_mla.mla_decode_max_splits(b, h, _sms(), cfg)
        out = torch.full((b, h, DV), float("nan"), dtype=dtype, device=DEV)
        launch_mla.mla_decode_attention(q, kv.k_buffer[0], r2t, idx, seq, out, sm_scale=SCALE[h], max_splits=splits,
                                        config=cfg)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), name
        for i, ref in refs.items():
            assert rel_err(out[i:i + 1], ref) <= TOL, (name, i)
        outs[cfg] = out
    for cfg, out in outs.items():
        if cfg.prefetch:
            plain = dataclasses.replace(cfg, prefetch=False)
            ref_out = torch.full_like(out, float("nan"))
            launch_mla.mla_decode_attention(q, kv.k_buffer[0], r2t, idx, seq, ref_out, sm_scale=SCALE[h],
                                            max_splits=launch_mla.mla_decode_max_splits(b, h, _sms(), cfg),
                                            config=plain)
            assert torch.equal(out, ref_out), cfg
