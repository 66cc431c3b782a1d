"""The e4m3 upcast by integer PTX (pipeline/backends/triton/kernels/fp8.py) on a CUDA GPU.

1. Bit for bit equal to Triton's own ``.to`` conversion and to torch's, for all 256 byte values placed at every
   position of tiles of the shapes the kernels load (K/V rows of head dim 64 to 256, 16 to 128 keys), to bf16
   and to fp16.
2. A NaN written to an e4m3 cache poisons exactly the outputs that read it, in decode and in extend, and no
   other request (a plain bit trick would have turned it into 480).
3. fp16 q over an e4m3 cache (the fp16 constants of the PTX), decode and extend, against a float64 reference
   over the dequantised cache.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pipeline.backends.triton import launch  # noqa: E402
from pipeline.backends.triton.kernels.fp8 import _kv_up  # noqa: E402
from pipeline.runtime.reference import reference_attention, rel_err  # noqa: E402

DEV = "cuda"


@triton.jit
def _up_kernel(X, Y, Z, R: tl.constexpr, C: tl.constexpr, F16: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(X + offs)
    if F16:
        tl.store(Y + offs, _kv_up(x, tl.float16, False))
        tl.store(Z + offs, x.to(tl.float16))
    else:
        tl.store(Y + offs, _kv_up(x, tl.bfloat16, False))
        tl.store(Z + offs, x.to(tl.bfloat16))


@pytest.mark.parametrize("rows,cols", [(16, 64), (64, 128), (128, 128), (32, 256), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_upcast_equals_to_for_every_byte(rows, cols, dtype):
    n = rows * cols
    for shift in range(0, 256, 37):   # every byte value at many positions (and lane offsets within a word)
        b = ((torch.arange(n, device=DEV) + shift) % 256).to(torch.uint8)
        x = b.view(torch.float8_e4m3fn).view(rows, cols)
        y = torch.empty(rows, cols, dtype=dtype, device=DEV)
        z = torch.empty_like(y)
        _up_kernel[(1,)](x, y, z, rows, cols, dtype == torch.float16)
        ref = x.to(dtype)
        nan = ref.isnan()
        assert bool(y[nan].isnan().all()) and bool(z[nan].isnan().all())
        assert torch.equal(y[~nan].view(torch.int16), ref[~nan].view(torch.int16))
        assert torch.equal(y[~nan].view(torch.int16), z[~nan].view(torch.int16))


def _cache(b, ctx, hkv, d, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    slots = b * ctx + 16
    k = (torch.randn(slots, hkv, d, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    v = (torch.randn(slots, hkv, d, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    perm = torch.randperm(slots - 16, device=DEV, generator=g)[: b * ctx] + 16
    r2t = perm.view(b, ctx).int()
    return k, v, r2t


def _decode(q, k, v, r2t, ks, vs):
    b, ctx = r2t.shape
    hkv = k.shape[1]
    out = torch.full_like(q, float("nan"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch.decode_attention(q, k, v, r2t, torch.arange(b, device=DEV), torch.full((b,), ctx, device=DEV,
                            dtype=torch.int32), out, sm_scale=q.shape[-1] ** -0.5,
                            max_splits=launch.decode_max_splits(b, hkv, sms, launch.DecodeConfig()),
                            k_scale=ks, v_scale=vs)
    return out


def _extend(q, k, v, r2t, new, ks, vs):
    """Each request's last ``new`` keys are its new tokens (given as k/v of the step), the rest its prefix."""
    b, ctx = r2t.shape
    rows = r2t[:, ctx - new:].reshape(-1).long()
    out = torch.full_like(q, float("nan"))
    qo = torch.arange(b + 1, device=DEV, dtype=torch.int32) * new
    launch.extend_attention(q, k[rows], v[rows], k, v, r2t, torch.arange(b, device=DEV), qo,
                            torch.full((b,), ctx - new, device=DEV, dtype=torch.int32), out, max_extend_len=new,
                            sm_scale=q.shape[-1] ** -0.5, k_scale=ks, v_scale=vs)
    return out


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_a_nan_in_the_cache_reaches_only_its_readers(mode):
    b, ctx, h, hkv, d, new = 4, 700, 16, 4, 128, 40
    k, v, r2t = _cache(b, ctx, hkv, d, seed=5)
    k.view(torch.uint8)[int(r2t[1, 100]), 2, 7] = 0x7F    # request 1, kv head 2, an early prefix key
    v.view(torch.uint8)[int(r2t[3, 200]), 0, 9] = 0xFF    # request 3, kv head 0 (negative NaN)
    t = b if mode == "decode" else b * new
    q = torch.randn(t, h, d, dtype=torch.bfloat16, device=DEV)
    out = _decode(q, k, v, r2t, 0.5, 0.25) if mode == "decode" else _extend(q, k, v, r2t, new, 0.5, 0.25)
    torch.cuda.synchronize()
    per_req = out.view(b, -1, h, d)
    g = h // hkv
    bad = {(1, hh) for hh in range(2 * g, 3 * g)} | {(3, hh) for hh in range(0, g)}
    for r in range(b):
        for hh in range(h):
            assert bool(per_req[r, :, hh].isnan().any()) == ((r, hh) in bad), (r, hh)


@pytest.mark.parametrize("mode,d", [("decode", 64), ("decode", 256), ("extend", 128), ("extend", 96)])
def test_fp16_q_over_an_e4m3_cache(mode, d):
    b, ctx, h, hkv, new, ks, vs = 3, 900, 8, 2, 70, 0.7, 1.9
    k, v, r2t = _cache(b, ctx, hkv, d, seed=d)
    t = b if mode == "decode" else b * new
    q = torch.randn(t, h, d, dtype=torch.float16, device=DEV)
    out = _decode(q, k, v, r2t, ks, vs) if mode == "decode" else _extend(q, k, v, r2t, new, ks, vs)
    torch.cuda.synchronize()
    qn = 1 if mode == "decode" else new
    for i in range(b):
        slots = r2t[i].long()
        ref = reference_attention(q[i * qn:(i + 1) * qn], k[slots].double() * ks, v[slots].double() * vs,
                                  q_positions=torch.arange(ctx - qn, ctx, device=DEV), scale=d ** -0.5)
        assert rel_err(out[i * qn:(i + 1) * qn], ref) <= 1e-2, (mode, d, i)
