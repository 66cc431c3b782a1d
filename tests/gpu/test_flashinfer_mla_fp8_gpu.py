"""Issue 16 on a CUDA GPU: MLA through every backend over the one-latent-buffer pool, and fp8 KV through flashinfer.

- **MLA** (absorbed, 512 + 64 latent dims, one latent buffer per layer with V a view of it): the ``flashinfer``
  backend (FlashInfer's MLA wrapper, fa3 on sm90), ``triton`` (our MLA kernels, through the backend) and
  ``torch_native``, at DeepSeek-V2-Lite dims (16 heads, its YaRN scale) and DeepSeek-V3 dims (128 heads), ragged
  contexts up to 32k, pages 1 / 16 / 64: an extend over cached prefixes (causal, several new tokens per request),
  an eager decode, then a decode CUDA graph captured once and replayed after the lengths grew.
- **fp8 KV** (e4m3, e5m2) with non-unit per-layer k_scale / v_scale, bf16 q, through ``flashinfer``: GQA 32/8 and
  MHA 32/32 heads of D 128, pages 1 / 16, decode on the CUDA-core and on the tensor-core path (both forced), paged
  extends, and a decode graph replay.

Every output is poisoned (the allocator's freed block refilled with NaN right before the call; a graph's static
output filled with NaN before the replay) and every request is compared with float64 attention over the
*dequantized stored* K/V (written here: ``stored.double() * scale``), tolerance 1e-2 (bf16 q,
pipeline.runtime.verify.TOLERANCE). Skipped without CUDA; the flashinfer cases also without FlashInfer.

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_flashinfer_mla_fp8_gpu.py``.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fi_reference import Scenario, dense_reference, make_kind, make_layer, make_mla_kind, rel_err  # noqa: E402
from pipeline.backends.flashinfer import rules as sz
from pipeline.core.contracts import ForwardMode  # noqa: E402
from pipeline.platforms.cuda import capture_graph

TOL = 1e-2
# DeepSeek's softmax scales: (128 + 64)^-0.5 * YaRN mscale(40, mscale_all_dim)^2 — V2-Lite 0.707, V3 1.0
SCALE = {16: 192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, 128: 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2}
CTX = [1, 31, 1000, 4097, 32767]      # ragged cached contexts, up to 32k
NEW = [3, 1, 17, 2, 1]                # new tokens of the extend over them
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _factory(name):
    if name == "flashinfer":
        if not _has_flashinfer():
            pytest.skip("FlashInfer is not installed")
        from pipeline.backends.flashinfer import backend as fib

        return fib.create
    if name == "triton":
        from pipeline.backends.triton import backend as tb

        return tb.create
    from pipeline.backends import torch_native as tn

    return tn.create


def _poison(nbytes: int) -> None:
    """Fill a freed block of the caching allocator with NaN (0xFF bytes), so the next output allocation of that
    size starts as NaN: a kernel that skips an element leaves a NaN behind."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.fill_(0xFF)
    del x


def _mla_ref(q, kv, n_prefix, scale):
    """float64 absorbed MLA of q [n, H, 576] over latent rows kv [L, 576] (V = first 512), bottom-right causal,
    one head block at a time (no [H, L, D] expansion: 128 heads x 32k keys would not fit)."""
    q64, k64 = q.double(), kv.double()
    n, length = q.shape[0], kv.shape[0]
    pos = n_prefix + torch.arange(n, device=q.device)
    mask = torch.arange(length, device=q.device)[None, :] > pos[:, None]        # [n, L]
    outs = []
    for h0 in range(0, q.shape[1], 32):
        s = torch.einsum("nhd,ld->hnl", q64[:, h0:h0 + 32], k64) * scale
        s = s.masked_fill(mask[None], -math.inf)
        outs.append(torch.einsum("hnl,lc->nhc", torch.softmax(s, -1), k64[:, :512]))
    return torch.cat(outs, 1)


def _mla_errs(sc, out, q, reqs, prefix, new, scale):
    errs, off = [], 0
    for r, p, n in zip(reqs, prefix, new):
        kr, _ = sc.request_kv(0, r, p + n)                                    # dequantized stored latents
        errs.append(rel_err(out[off:off + n], _mla_ref(q[off:off + n], kr[:, 0], p, scale)))
        off += n
    return errs


MLA_CASES = [(b, h, p) for b in ("flashinfer", "triton") for h in (16, 128) for p in (1, 16, 64)] + \
            [("torch_native", h, 16) for h in (16, 128)]


@pytest.mark.parametrize("backend,heads,page", MLA_CASES, ids=lambda x: str(x))
def test_mla_extend_decode_and_graph_replay(backend, heads, page):
    """MLA over one latent buffer per layer: extend over ragged prefixes to 32k, eager decode, decode graph replay
    after the lengths grew — every request within 1e-2 of float64, no NaN."""
    kind = make_mla_kind(heads, scaling=SCALE[heads])
    bs = len(CTX)
    sc = Scenario([kind], page_size=page, max_reqs=bs + 1, max_context_len=max(CTX) + 64, ws_bytes=384 << 20,
                  name=backend, extra={"cuda_graph_max_bs": bs})
    assert sc.kv.mla_layers == {0} and sc.kv.v_buffer[0].data_ptr() == sc.kv.k_buffer[0].data_ptr()
    be = _factory(backend)(sc.ctx)
    layer = make_layer(kind, 0)
    reqs = list(range(1, bs + 1))
    sc.fill_prefix(reqs, CTX)
    # extend: several new tokens per request over its cached prefix (causal among them)
    fb = sc.batch(ForwardMode.EXTEND, reqs, NEW)
    be.init_forward_metadata(fb)
    t = sum(NEW)
    q, k = sc.randn(t, heads, 576), sc.randn(t, 1, 576)
    _poison(t * heads * 512 * 2)
    out = be.forward(q, k, k[..., :512], layer, fb).view(t, heads, 512)
    assert not torch.isnan(out).any()
    assert max(_mla_errs(sc, out, q, reqs, CTX, NEW, kind.scaling)) <= TOL
    # eager decode
    pre = [c + n for c, n in zip(CTX, NEW)]
    fb = sc.batch(ForwardMode.DECODE, reqs, [1] * bs)
    be.init_forward_metadata(fb)
    q, k = sc.randn(bs, heads, 576), sc.randn(bs, 1, 576)
    _poison(bs * heads * 512 * 2)
    out = be.forward(q, k, k[..., :512], layer, fb).view(bs, heads, 512)
    assert not torch.isnan(out).any()
    assert max(_mla_errs(sc, out, q, reqs, pre, [1] * bs, kind.scaling)) <= TOL
    if backend == "torch_native":
        return  # no CUDA graphs (as sglang's torch_native)
    # decode graph: captured at these lengths, replayed after one more token per request
    be.init_cuda_graph_state(bs, bs)
    rows = torch.tensor(reqs, device="cuda")
    be.init_forward_metadata_capture_cuda_graph(bs, bs, rows, fb.seq_lens, None, ForwardMode.DECODE, None)
    q_static = torch.zeros(bs, heads, 576, dtype=torch.bfloat16, device="cuda")
    g, g_out = capture_graph(lambda: be.forward_decode(q_static, None, None, layer, fb, save_kv_cache=False))
    pre = [p + 1 for p in pre]
    fb2 = sc.batch(ForwardMode.DECODE, reqs, [1] * bs)
    k = sc.randn(bs, 1, 576)
    sc.kv.set_kv_buffer(0, fb2.out_cache_loc, k, None)
    be.init_forward_metadata_replay_cuda_graph(bs, rows, fb2.seq_lens, sum(fb2.seq_lens_cpu), None,
                                               ForwardMode.DECODE, None, torch.tensor(fb2.seq_lens_cpu))
    q_static.copy_(sc.randn(bs, heads, 576))
    g_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    out = g_out.view(bs, heads, 512)
    assert not torch.isnan(out).any()
    assert max(_mla_errs(sc, out, q_static, reqs, pre, [1] * bs, kind.scaling)) <= TOL


def _fp8_errs(sc, be, kind, layer, mode, reqs, prefix, new):
    sc.fill_prefix(reqs, prefix)
    pre = [sc.alloc.req_lens.get(r, 0) for r in reqs]
    fb = sc.batch(mode, reqs, new)
    be.init_forward_metadata(fb)
    t = sum(new)
    q = sc.randn(t, kind.num_heads, kind.head_dim_qk, scale=2.0)
    k, v = sc.randn(t, kind.num_kv_heads, 128, scale=3.0), sc.randn(t, kind.num_kv_heads, 128, scale=3.0)
    _poison(t * kind.num_heads * 128 * 2)
    out = be.forward(q, k, v, layer, fb).view(t, kind.num_heads, 128)
    assert not torch.isnan(out).any()
    errs, off = [], 0
    for r, p, n in zip(reqs, pre, new):
        kr, vr = sc.request_kv(0, r, p + n)   # stored fp8 * scale, in float64
        errs.append(rel_err(out[off:off + n], dense_reference(q[off:off + n], kr, vr, prefix=p, scale=kind.scaling)))
        off += n
    return max(errs), fb


FP8_CASES = [(fmt, heads, page, path) for fmt in FP8 for heads in ((32, 8), (32, 32)) for page in (1, 16)
             for path in ("cuda_core", "tensor_core")]


@pytest.mark.parametrize("fmt,heads,page,path", FP8_CASES, ids=lambda x: str(x))
def test_fp8_kv_flashinfer(fmt, heads, page, path, monkeypatch):
    """fp8 KV with k_scale 0.37 / v_scale 1.7 through flashinfer, decode forced onto each path: paged extends
    (no prefix, then over one), eager decode and a decode graph replay, all within 1e-2 of float64 over the
    dequantized stored K/V."""
    h, hkv = heads
    monkeypatch.setitem(sz.FP8_DECODE_PATH, h // hkv, path)
    kind = make_kind(h, hkv, 128)
    sc = Scenario([kind], page_size=page, max_reqs=8, max_context_len=8192, ws_bytes=384 << 20, kv_dtype=FP8[fmt],
                  k_scales=[0.37], v_scales=[1.7], extra={"cuda_graph_max_bs": 4})
    fib = _factory("flashinfer")
    be = fib(sc.ctx)
    layer = make_layer(kind, 0)
    err, _ = _fp8_errs(sc, be, kind, layer, ForwardMode.EXTEND, [1, 2, 3], [0, 0, 0], [300, 5, 77])
    assert err <= TOL and not be.extend_ragged
    err, _ = _fp8_errs(sc, be, kind, layer, ForwardMode.EXTEND, [1, 4], [0, 3000], [40, 129])
    assert err <= TOL
    err, fb = _fp8_errs(sc, be, kind, layer, ForwardMode.DECODE, [1, 2, 3, 4], [0, 1000, 7000, 0], [1] * 4)
    assert err <= TOL
    want = be.kinds[0].decode_tc if path == "tensor_core" else be.kinds[0].decode_cc
    assert be.kinds[0].active is want
    # decode graph over the fp8 cache (the scales are Python floats baked into the captured run)
    reqs = [1, 2, 3, 4]
    be.init_cuda_graph_state(4, 4)
    rows = torch.tensor(reqs, device="cuda")
    be.init_forward_metadata_capture_cuda_graph(4, 4, rows, fb.seq_lens, None, ForwardMode.DECODE, None)
    q_static = torch.zeros(4, h, 128, dtype=torch.bfloat16, device="cuda")
    g, g_out = capture_graph(lambda: be.forward_decode(q_static, None, None, layer, fb, save_kv_cache=False))
    fb2 = sc.batch(ForwardMode.DECODE, reqs, [1] * 4)
    sc.kv.set_kv_buffer(0, fb2.out_cache_loc, sc.randn(4, hkv, 128, scale=3.0), sc.randn(4, hkv, 128, scale=3.0))
    be.init_forward_metadata_replay_cuda_graph(4, rows, fb2.seq_lens, 0, None, ForwardMode.DECODE, None,
                                               torch.tensor(fb2.seq_lens_cpu))
    q_static.copy_(sc.randn(4, h, 128, scale=2.0))
    g_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    out = g_out.view(4, h, 128)
    assert not torch.isnan(out).any()
    for i, (r, n) in enumerate(zip(reqs, fb2.seq_lens_cpu)):
        kr, vr = sc.request_kv(0, r, n)
        assert rel_err(out[i:i + 1], dense_reference(q_static[i:i + 1], kr, vr, prefix=n - 1,
                                                     scale=kind.scaling)) <= TOL
