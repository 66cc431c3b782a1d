"""The absorbed-MLA Triton kernels on CPU under ``TRITON_INTERPRET=1``, against float64 attention.

Yardsticks: :func:`pipeline.runtime.reference.reference_attention` in float64 over the cached latent rows
(keys = the whole row, values = its first ``Dv`` dims), per request; torch_native on the same paged
batch; and the un-absorbed float64 model (:func:`pipeline.runtime.model.reference_forward`) for a DeepSeek-V2-Lite
layer run end to end through the backend. Shapes stay small (tens of keys, 16-row tiles) so the
interpreter is quick; the real-size grid is ``tests/gpu/test_triton_mla_gpu.py``.

Interpreter mode is fixed when triton is first imported; see ``tests/test_triton_interpret.py`` for
the same arrangement (run directly when the process is in interpreter mode, else in a subprocess).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
DIRECT = not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and (
    "triton" not in sys.modules or type(sys.modules["triton"].language.sum).__name__ == "InterpretedFunction")

pytestmark = pytest.mark.skipif(HAS_CUDA,
                                reason="CUDA present: tests/gpu/test_triton_mla_gpu.py runs the compiled kernels")

from conftest import CONFIGS  # noqa: E402
from pipeline.backends.base import AttentionLayer  # noqa: E402
from pipeline.backends.triton import launch_mla as M  # noqa: E402
from pipeline.core.contracts import ForwardMode, LayerKind  # noqa: E402
from pipeline.core.errors import BuildError, CapabilityMismatch, LayerMismatch  # noqa: E402
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch  # noqa: E402
from pipeline.runtime.reference import reference_attention, rel_err  # noqa: E402

TOL = 1e-2   # bf16/fp16 inputs and output (output rounding alone is up to 2^-9 relative)
SMALL_DEC = dict(block_n=16, split_min=16, num_warps=4, num_stages=1, merge_block_h=8)
SMALL_EXT = dict(block_n=16, num_warps=4, num_stages=1)


@pytest.mark.skipif(DIRECT, reason="triton is in interpreter mode in this process: the tests run directly")
def test_interpreter_suite_in_subprocess():
    """Triton was imported before TRITON_INTERPRET could be set: run this module in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fixed draws per test; the kernel tests run only in interpreter mode."""
    if not DIRECT and request.node.name != "test_interpreter_suite_in_subprocess":
        pytest.skip("ran in a subprocess with TRITON_INTERPRET=1 (see test_interpreter_suite_in_subprocess)")
    torch.manual_seed(1234)


def _latent_cache(lens, d, page, dtype, seed):
    """A latent cache [slots, 1, d] of random rows and req_to_token with scrambled pages; (kv, r2t, rows)."""
    g = torch.Generator().manual_seed(seed)
    slots = (sum(lens) // page + len(lens) + 2) * page
    rp = ReqToTokenPool(len(lens) + 2, max(lens) + 1, "cpu")
    alloc = PageAllocator(rp, slots, page, seed=seed)
    rows = list(range(1, len(lens) + 1))
    for r, n in zip(rows, lens):
        alloc.extend(r, n)
    return torch.randn(slots, 1, d, generator=g).to(dtype), rp.req_to_token, rows


def _ref(q, kv_rows, dv, q_positions, scale):
    """float64 attention of q [T, H, D] over one request's latent rows [L, 1, D]; values = rows[..., :dv]."""
    return reference_attention(q, kv_rows, kv_rows[..., :dv], q_positions=q_positions, scale=scale)


DECODE_CASES = [
    # (H, Dv, rope, page, dtype, block_h, max_splits, lazy, bf16 partials, L2 prefetch) — Dv + rope = the cache row
    (16, 512, 64, 1, torch.bfloat16, 16, 1, True, False, False),   # DeepSeek-V2-Lite dims, one split: direct output
    (16, 512, 64, 16, torch.float16, 16, 5, False, False, True),   # V2-Lite dims, split-K + merge, eager rescale
    (40, 64, 16, 16, torch.bfloat16, 16, 4, True, False, True),    # 3 head blocks, the last partial; an empty split
    (32, 64, 32, 1, torch.bfloat16, 32, 3, True, True, False),
    (20, 96, 24, 4, torch.float16, 16, 2, True, True, True),       # dims that are not powers of two (masked tiles)
]


@pytest.mark.parametrize("h,dv,dr,page,dtype,block_h,max_splits,lazy,bf16_part,prefetch", DECODE_CASES)
def test_mla_decode_kernel_matches_reference(h, dv, dr, page, dtype, block_h, max_splits, lazy, bf16_part, prefetch):
    """Decode over scrambled pages and ragged lengths equals float64 attention per request.

    Lengths 1..129 with 16-key splits: a request of 129 keys and 4 splits gets 48-key ranges, so its
    last split is empty (its LSE is -inf and must weigh nothing in the merge). ``prefetch`` runs the
    L2-prefetch variant's index path (the prefetch instruction itself is PTX: GPU tests).
    """
    lens = [1, 37, 70, 16, 129]
    kv, r2t, rows = _latent_cache(lens, dv + dr, page, dtype, seed=h + dv + page)
    q = torch.randn(len(lens), h, dv + dr).to(dtype)
    out = torch.full((len(lens), h, dv), float("nan"), dtype=dtype)
    scale = (dv + dr) ** -0.5 * 1.3
    cfg = M.MLADecodeConfig(block_h=block_h, lazy_rescale=lazy, partial_bf16=bf16_part, prefetch=prefetch,
                            **SMALL_DEC)
    M.mla_decode_attention(q, kv, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), out,
                           sm_scale=scale, max_splits=max_splits, config=cfg)
    for i, (r, n) in enumerate(zip(rows, lens)):
        ref = _ref(q[i:i + 1], kv[r2t[r, :n].long()], dv, torch.tensor([n - 1]), scale)
        assert rel_err(out[i:i + 1], ref) <= TOL, (i, n)


def test_mla_decode_lazy_and_eager_rescale_agree_on_large_score_jumps():
    """Scores that grow along the context (the running max jumps by >2^8 several times) stay exact with
    lazy rescaling: both modes match float64, so neither drops or double-counts a rescale."""
    lens = [96, 50]
    kv, r2t, rows = _latent_cache(lens, 80, 1, torch.bfloat16, seed=5)
    ramp = torch.linspace(0, 12, kv.shape[0]).view(-1, 1, 1)
    kv = (kv.float() + ramp * (torch.arange(80) < 8).view(1, 1, -1)).to(torch.bfloat16)
    q = torch.zeros(2, 16, 80, dtype=torch.bfloat16)
    q[:, :, :8] = 3.0
    for lazy in (True, False):
        out = torch.empty(2, 16, 64, dtype=torch.bfloat16)
        M.mla_decode_attention(q, kv, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), out,
                               sm_scale=1.0, max_splits=2, config=M.MLADecodeConfig(block_h=16, lazy_rescale=lazy,
                                                                                   **SMALL_DEC))
        for i, (r, n) in enumerate(zip(rows, lens)):
            ref = _ref(q[i:i + 1], kv[r2t[r, :n].long()], 64, torch.tensor([n - 1]), 1.0)
            assert rel_err(out[i:i + 1], ref) <= TOL, (lazy, i)


EXTEND_CASES = [
    # (H, Dv, rope, page, dtype, block_m)
    (16, 512, 64, 1, torch.bfloat16, 32),     # V2-Lite dims; a 32-row block = 2 tokens x 16 heads
    (16, 64, 16, 16, torch.float16, 64),      # 4 tokens per block
    (40, 64, 16, 16, torch.bfloat16, 32),     # blocks straddle tokens mid-head-range
    (24, 96, 24, 4, torch.bfloat16, 32),      # 24 heads: every block straddles a token boundary
]


@pytest.mark.parametrize("h,dv,dr,page,dtype,block_m", EXTEND_CASES)
def test_mla_extend_kernel_matches_reference(h, dv, dr, page, dtype, block_m):
    """Extend (paged prefix + causal new tokens, bottom-right aligned, ragged) equals float64 per request."""
    prefix, new = [0, 5, 23, 40], [19, 1, 7, 3]
    lens = [p + n for p, n in zip(prefix, new)]
    kv, r2t, rows = _latent_cache(lens, dv + dr, page, dtype, seed=3 * h + dv)
    q = torch.randn(sum(new), h, dv + dr).to(dtype)
    new_slots = torch.cat([r2t[r, p:p + n].long() for r, p, n in zip(rows, prefix, new)])
    kv_new = kv[new_slots].clone()                      # as after save_kv_cache
    qo = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    out = torch.full((sum(new), h, dv), float("nan"), dtype=dtype)
    scale = (dv + dr) ** -0.5
    M.mla_extend_attention(q, kv_new, kv, r2t, torch.tensor(rows), qo, torch.tensor(prefix, dtype=torch.int32), out,
                           max_extend_len=max(new), sm_scale=scale,
                           config=M.MLAExtendConfig(block_m=block_m, **SMALL_EXT))
    for i, (r, p, n) in enumerate(zip(rows, prefix, new)):
        sl = slice(int(qo[i]), int(qo[i + 1]))
        ref = _ref(q[sl], kv[r2t[r, :p + n].long()], dv, torch.arange(p, p + n), scale)
        assert rel_err(out[sl], ref) <= TOL, (i, p, n)


def test_mla_extend_reads_new_rows_from_kv_new_not_the_cache():
    """The new tokens' rows come from ``kv_new`` (this step's tensors), the prefix from the cache."""
    prefix, new = [6], [5]
    kv, r2t, rows = _latent_cache([11], 80, 4, torch.bfloat16, seed=9)
    slots = r2t[1, :11].long()
    kv_new = torch.randn(5, 1, 80).to(torch.bfloat16)
    q = torch.randn(5, 16, 80).to(torch.bfloat16)
    out = torch.empty(5, 16, 64, dtype=torch.bfloat16)
    M.mla_extend_attention(q, kv_new, kv, r2t, torch.tensor(rows), torch.tensor([0, 5], dtype=torch.int32),
                           torch.tensor(prefix, dtype=torch.int32), out, max_extend_len=5, sm_scale=0.1,
                           config=M.MLAExtendConfig(block_m=32, **SMALL_EXT))
    keys = torch.cat([kv[slots[:6]], kv_new])
    assert rel_err(out, _ref(q, keys, 64, torch.arange(6, 11), 0.1)) <= TOL
    assert rel_err(out, _ref(q, kv[slots], 64, torch.arange(6, 11), 0.1)) > 0.05   # the stale cache rows differ


# ------------------------------------------------------------------------------------------- backend
def _v2_lite_layer():
    from pipeline.core.model_spec import load_model_spec

    spec = load_model_spec(CONFIGS / "deepseek-v2-lite.json")
    kind = spec.layer_kinds()[0]
    assert kind.is_mla and (kind.num_heads, kind.head_dim_qk, kind.head_dim_v) == (16, 576, 512)
    layer = AttentionLayer(layer_id=0, num_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                           scaling=kind.scaling, is_mla=True)
    return spec, kind, layer


def _mla_backend(num_sms=8, **kw):
    from pipeline.backends.triton.backend import TritonAttnBackend

    return TritonAttnBackend(torch_device="cpu", layer_dims=[(16, 1, 576, 512)], num_sms=num_sms,
                             mla_decode_config=M.MLADecodeConfig(block_h=16, **SMALL_DEC),
                             mla_extend_config=M.MLAExtendConfig(block_m=32, **SMALL_EXT), **kw)


def _mla_step(backend, mode, rows, new, alloc, kv, layer, g):
    fb = make_forward_batch(mode, rows, new, alloc, kv)
    t = fb.num_tokens
    q = torch.randn(t, 16, 576, generator=g).bfloat16()
    lat = torch.randn(t, 1, 576, generator=g).bfloat16()
    backend.init_forward_metadata(fb)
    # The model passes k = [c, k_rope] (576) and v = c (512), as pipeline.runtime.model does for MLA.
    return fb, q, lat, backend.forward(q.reshape(t, -1), lat, lat[..., :512].contiguous(), layer, fb)


def _check_mla_step(fb, q, out, layer):
    r2t, kb = fb.req_to_token_pool.req_to_token, fb.token_to_kv_pool.k_buffer[0]
    start = 0
    for row, s, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
        ref = _ref(q[start:start + n], kb[r2t[row, :s].long()], 512, torch.arange(s - n, s), layer.scaling)
        assert rel_err(out[start:start + n].view(n, 16, 512), ref) <= TOL
        start += n


def test_backend_mla_prefix_extend_decode_match_reference_and_torch_native():
    """DeepSeek-V2-Lite layer (16 heads, 512 + 64, YaRN-scaled softmax): extend, extend over the cached
    prefix, then decode steps through the backend — the latent lands in the pool, every output matches
    float64 attention and torch_native on the same paged batch."""
    from pipeline.backends.torch_native import TorchNativeBackend

    spec, kind, layer = _v2_lite_layer()
    # The model's softmax scale, not the absorbed 576 dims': (128 + 64)^-0.5 * YaRN mscale(40, 0.707)^2.
    assert abs(layer.scaling - 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2) < 1e-12
    rp = ReqToTokenPool(6, 128, "cpu")
    kv = KVPool.for_layer_kinds([kind], 1, 512, 16, torch.bfloat16, "cpu")
    assert kv.k_buffer[0].shape == (512, 1, 576) and kv.v_buffer[0].shape == (512, 1, 512)
    alloc, be, tn = PageAllocator(rp, 512, 16, seed=1), _mla_backend(), TorchNativeBackend(torch_device="cpu")
    g = torch.Generator().manual_seed(4)
    for mode, new in [(ForwardMode.EXTEND, [21, 6, 1]), (ForwardMode.EXTEND, [4, 9, 2]),
                      (ForwardMode.DECODE, [1, 1, 1])]:
        fb, q, lat, out = _mla_step(be, mode, [1, 3, 4], new, alloc, kv, layer, g)
        assert torch.equal(kv.k_buffer[0][fb.out_cache_loc], lat)
        assert out.shape == (sum(new), 16 * 512) and out.dtype == torch.bfloat16
        _check_mla_step(fb, q, out, layer)
        tn.init_forward_metadata(fb)
        assert rel_err(out, tn.forward(q, lat, lat[..., :512], layer, fb, save_kv_cache=False)) <= TOL


def test_backend_mla_stack_matches_unabsorbed_float64_model():
    """One DeepSeek-V2-Lite layer end to end (absorbed q through W_UK, latent cache, W_UV after attention)
    through the triton backend equals the float64 *un-absorbed* model (per-head k_nope / v from the
    latent), over extend, chunked extend and decode: the absorption, the YaRN scale and the kernels agree."""
    from pipeline.runtime.model import AttentionStack, reference_forward
    from pipeline.core.model_spec import load_model_spec

    spec = load_model_spec(CONFIGS / "deepseek-v2-lite.json")
    stack = AttentionStack(spec, dtype=torch.bfloat16, device="cpu", num_layers=1, seed=7)
    rp = ReqToTokenPool(3, 64, "cpu")
    kv = KVPool.for_layer_kinds(stack.spec.layer_kinds(), 1, 256, 4, torch.bfloat16, "cpu")
    alloc, be = PageAllocator(rp, 256, 4, seed=3), _mla_backend()
    g = torch.Generator().manual_seed(11)
    rows, hist, outs = [0, 1, 2], {0: [], 1: [], 2: []}, {0: [], 1: [], 2: []}
    for mode, new in [(ForwardMode.EXTEND, [5, 1, 7]), (ForwardMode.EXTEND, [2, 3, 1]),
                      (ForwardMode.DECODE, [1, 1, 1])]:
        fb = make_forward_batch(mode, rows, new, alloc, kv)
        x = torch.randn(sum(new), spec.hidden_size, generator=g).bfloat16()
        be.init_forward_metadata(fb)
        out, _ = stack.forward(x, fb, be)
        for r, px, po in zip(rows, x.split(new), out.split(new)):
            hist[r].append(px)
            outs[r].append(po)
    for r in rows:
        xs = torch.cat(hist[r])
        ref, _ = reference_forward(stack, xs, kv_dtype=torch.bfloat16)
        xd = xs.double()
        assert rel_err(torch.cat(outs[r]).double() - xd, ref - xd) <= 2e-2, r


def test_backend_mla_graph_hooks_replay_equals_eager():
    """Capture points MLA decode at the fixed buffers (split scratch sized for MLA); after the lengths and
    rows change, replay-mode metadata gives the eager result bit for bit, and both match float64."""
    spec, kind, layer = _v2_lite_layer()
    rp = ReqToTokenPool(6, 128, "cpu")
    kv = KVPool.for_layer_kinds([kind], 1, 512, 16, torch.bfloat16, "cpu")
    alloc, be = PageAllocator(rp, 512, 16, seed=2), _mla_backend(num_sms=8)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    assert M.mla_decode_max_splits(3, 16, 8, be.mla_decode_config) > 1   # split path (scratch used)
    bufs = [b.data_ptr() for b in be.owned_buffers()]
    assert be.owned_buffers()[2].numel() >= M.mla_decode_scratch_numel(1, 16, 512, 8)
    g = torch.Generator().manual_seed(6)
    _mla_step(be, ForwardMode.EXTEND, [1, 2, 3], [5, 12, 2], alloc, kv, layer, g)
    fb = make_forward_batch(ForwardMode.DECODE, [1, 2, 3], [1, 1, 1], alloc, kv)
    be.init_forward_metadata_capture_cuda_graph(3, 3, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None)
    alloc.extend(1, 40)
    fb2 = make_forward_batch(ForwardMode.DECODE, [3, 1, 2], [1, 1, 1], alloc, kv)
    be.init_forward_metadata_replay_cuda_graph(3, fb2.req_pool_indices, fb2.seq_lens, sum(fb2.seq_lens_cpu), None,
                                               ForwardMode.DECODE, None, None)
    q, lat = torch.randn(3, 16, 576, generator=g).bfloat16(), torch.randn(3, 1, 576, generator=g).bfloat16()
    graphed = be.forward(q, lat, lat[..., :512].contiguous(), layer, fb2)
    assert [b.data_ptr() for b in be.owned_buffers()] == bufs
    be.init_forward_metadata(fb2)
    assert torch.equal(graphed, be.forward(q, lat, lat[..., :512].contiguous(), layer, fb2))
    _check_mla_step(fb2, q, graphed, layer)


def test_create_accepts_mla_kinds_and_refuses_what_the_kernels_cannot_serve():
    """create() builds a backend for DeepSeek-V2-Lite's MLA kind; refuses a latent wider than 512 and an
    MLA layer with a window (CapabilityMismatch naming the field, before any allocation)."""
    from pipeline.backends.triton.backend import create

    spec, kind, layer = _v2_lite_layer()
    ctx = lambda kinds: SimpleNamespace(layer_kinds=kinds, torch_device="cpu",  # noqa: E731
                                        device=SimpleNamespace(sm_count=4), role="primary")
    be = create(ctx([kind]))
    assert be.layer_dims == [(16, 1, 576, 512)]
    wide = LayerKind(kind="full", num_heads=16, num_kv_heads=1, head_dim_qk=1088, head_dim_v=1024, scaling=0.1,
                     is_mla=True)
    with pytest.raises(CapabilityMismatch) as ei:
        create(ctx([wide]))
    assert ei.value.info.flags[0].name == "model.kv_lora_rank" and ei.value.info.remedy
    rp = ReqToTokenPool(2, 16, "cpu")
    kv = KVPool.for_layer_kinds([kind], 1, 32, 1, torch.bfloat16, "cpu")
    fb = make_forward_batch(ForwardMode.EXTEND, [1], [3], PageAllocator(rp, 32, 1), kv)
    windowed = AttentionLayer(layer_id=0, num_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512,
                              scaling=kind.scaling, sliding_window=8, is_mla=True)
    with pytest.raises(LayerMismatch) as ei:  # built for the model's window-less MLA kind: the per-layer check refuses
        be.forward(torch.zeros(3, 16, 576).bfloat16(), None, None, windowed, fb, save_kv_cache=False)
    assert ei.value.info.flags[1].name == "layer.sliding_window"


# ------------------------------------------------------------------------------------------- config
def test_default_config_table_by_head_count():
    """The config table is keyed by head count: 16 heads → 16-head tiles, 128 → 64-head tiles on sm90."""
    assert M.default_mla_decode_config(16).block_h == 16
    assert M.default_mla_decode_config(128).block_h == 64
    assert M.default_mla_decode_config(200) == M.default_mla_decode_config(128)
    assert M.default_mla_decode_config(8) == M.default_mla_decode_config(16)


@settings(max_examples=200, deadline=None)
@given(b=st.integers(1, 4096), h=st.integers(1, 256), sms=st.integers(1, 200),
       bh=st.sampled_from([16, 32, 64]), pps=st.integers(1, 8), cap=st.integers(1, 128))
def test_split_cap_is_near_the_best_wave_time(b, h, sms, bh, pps, cap):
    """The split cap is one of the candidates (1 .. at most two waves of programs, <= cap); its modelled time
    ceil(P*s/slots)/s is within SPLIT_GAIN of every other candidate's and never worse than one split; a batch
    that fills whole waves gets one split (no merge)."""
    cfg = M.MLADecodeConfig(block_h=bh, programs_per_sm=pps, max_splits_cap=cap)
    s = M.mla_decode_max_splits(b, h, sms, cfg)
    programs, slots = b * -(-h // bh), pps * sms
    t = lambda k: -(-programs * k // slots) / k  # noqa: E731
    cands = M.mla_split_candidates(b, h, sms, cfg)
    assert s in cands and 1 <= s <= cap and programs * (cands[-1] - 1) < 2 * slots
    assert all(t(s) * (1 - M.SPLIT_GAIN) <= t(k) for k in cands)
    assert t(s) <= t(1)
    if programs % slots == 0 or programs >= 2 * slots:
        assert s == 1
    assert M.mla_decode_scratch_numel(b, h, 512, s) == (0 if s == 1 else b * h * s * 513)


def test_split_cap_examples():
    """132 SMs, 128 heads in 64-head blocks, one program per SM: B=64 fills 128 slots (no split); B=40 (80
    programs) and B=34 split 3 ways; B=8 (16 programs) 8 ways; B=100 and 256 (>= a full wave) do not split."""
    cfg = M.MLADecodeConfig()
    got = [M.mla_decode_max_splits(b, 128, 132, cfg) for b in (64, 40, 34, 8, 100, 256)]
    assert got == [1, 3, 3, 8, 1, 1]
    assert M.mla_decode_max_splits(1, 128, 132, cfg) >= 60


# ------------------------------------------------------------------------------------------- errors
def _dec_args(**over):
    a = dict(q=torch.zeros(2, 16, 80, dtype=torch.bfloat16), kv_buffer=torch.zeros(32, 1, 80, dtype=torch.bfloat16),
             req_to_token=torch.zeros(3, 16, dtype=torch.int32), req_pool_indices=torch.tensor([1, 2]),
             seq_lens=torch.tensor([3, 4], dtype=torch.int32), out=torch.zeros(2, 16, 64, dtype=torch.bfloat16))
    a.update(over)
    return a


BAD_DECODE = [
    (dict(q=torch.zeros(2, 16, 80)), CapabilityMismatch, "q.dtype"),
    (dict(kv_buffer=torch.zeros(32, 1, 80, dtype=torch.float8_e4m3fn)), CapabilityMismatch, "kv_buffer.dtype"),
    (dict(kv_buffer=torch.zeros(32, 2, 80, dtype=torch.bfloat16)), BuildError, "kv_buffer.shape[1]"),
    (dict(kv_buffer=torch.zeros(32, 1, 96, dtype=torch.bfloat16)), BuildError, "q.shape[2]"),
    (dict(out=torch.zeros(2, 16, 80, dtype=torch.bfloat16)), BuildError, "out.shape"),
    (dict(out=torch.zeros(2, 8, 64, dtype=torch.bfloat16)), BuildError, "out.shape"),
    (dict(q=torch.zeros(2, 16, 1100, dtype=torch.bfloat16), kv_buffer=torch.zeros(32, 1, 1100, dtype=torch.bfloat16),
          out=torch.zeros(2, 16, 1024, dtype=torch.bfloat16)), CapabilityMismatch, "mla dims"),
    (dict(seq_lens=torch.tensor([3], dtype=torch.int32)), BuildError, "seq_lens.shape"),
    (dict(req_to_token=torch.zeros(3, 16, dtype=torch.int64)), BuildError, "req_to_token.dtype"),
    (dict(q=torch.zeros(2, 80, 16, dtype=torch.bfloat16).transpose(1, 2)), BuildError, "q.stride(-1)"),
    (dict(sm_scale=float("nan")), BuildError, "sm_scale"),
    (dict(sm_scale=0.0), BuildError, "sm_scale"),
    (dict(max_splits=0), BuildError, "max_splits"),
    (dict(scratch=torch.zeros(10)), BuildError, "scratch"),
    (dict(config=M.MLADecodeConfig(block_h=24)), BuildError, "config.block_h"),
    (dict(config=M.MLADecodeConfig(merge_block_h=3)), BuildError, "config.merge_block_h"),
]


@pytest.mark.parametrize("over,err,field", BAD_DECODE, ids=[c[2] + str(i) for i, c in enumerate(BAD_DECODE)])
def test_mla_decode_launcher_rejects_bad_input(over, err, field):
    """Bad inputs raise the typed error naming the field, with a remedy, before any launch."""
    kw = dict(sm_scale=0.1, max_splits=2)
    kw.update({k: over.pop(k) for k in ("sm_scale", "max_splits", "scratch", "config") if k in over})
    with pytest.raises(err) as ei:
        M.mla_decode_attention(**_dec_args(**over), **kw)
    assert ei.value.info.flags[0].name == field and ei.value.info.remedy


def _ext_args(**over):
    a = dict(q=torch.zeros(5, 16, 80, dtype=torch.bfloat16), kv_new=torch.zeros(5, 1, 80, dtype=torch.bfloat16),
             kv_buffer=torch.zeros(32, 1, 80, dtype=torch.bfloat16), req_to_token=torch.zeros(3, 16, dtype=torch.int32),
             req_pool_indices=torch.tensor([1, 2]), qo_indptr=torch.tensor([0, 2, 5], dtype=torch.int32),
             prefix_lens=torch.tensor([3, 0], dtype=torch.int32), out=torch.zeros(5, 16, 64, dtype=torch.bfloat16))
    a.update(over)
    return a


BAD_EXTEND = [
    (dict(kv_new=torch.zeros(5, 1, 64, dtype=torch.bfloat16)), BuildError, "kv_new.shape"),
    (dict(kv_new=torch.zeros(5, 1, 80, dtype=torch.float16)), BuildError, "kv_new.dtype"),
    (dict(qo_indptr=torch.tensor([0, 5], dtype=torch.int32)), BuildError, "qo_indptr.shape"),
    (dict(prefix_lens=torch.tensor([3, 0, 1], dtype=torch.int32)), BuildError, "req_pool_indices.shape"),
    (dict(max_extend_len=-1), BuildError, "max_extend_len"),
    (dict(out=torch.zeros(5, 16, 80, dtype=torch.bfloat16)), BuildError, "out.shape"),
]


@pytest.mark.parametrize("over,err,field", BAD_EXTEND, ids=[c[2] for c in BAD_EXTEND])
def test_mla_extend_launcher_rejects_bad_input(over, err, field):
    """Bad extend inputs raise the typed error naming the field, with a remedy, before any launch."""
    kw = dict(sm_scale=0.1, max_extend_len=3)
    kw.update({k: over.pop(k) for k in ("max_extend_len",) if k in over})
    with pytest.raises(err) as ei:
        M.mla_extend_attention(**_ext_args(**over), **kw)
    assert ei.value.info.flags[0].name == field and ei.value.info.remedy
