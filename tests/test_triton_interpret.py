"""The Triton kernels and backend on CPU under ``TRITON_INTERPRET=1``, against the float64 reference.

Small shapes (a few requests, tens of keys, 16-wide tiles) so the interpreter stays fast; the
GPU grid lives in ``tests/gpu/test_triton_gpu.py``. The interpreter mode is switched on by a
module fixture that re-creates the kernels and restores the environment afterwards, so other
test modules in the same process are unaffected.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from pipeline.backends.base import AttentionLayer
from pipeline.contracts import ForwardMode
from pipeline.errors import BuildError, CapabilityMismatch
from pipeline.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.reference import reference_attention, rel_err

DEC = None  # launch module, set by the fixture
SMALL_DEC = dict(block_n=16, split_min=32, num_warps=4, num_stages=1)
SMALL_EXT = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """Re-create the kernels as interpreted functions for this module only."""
    global DEC
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    from pipeline.backends.triton import launch
    from pipeline.backends.triton.kernels import decode, extend

    importlib.reload(decode)
    importlib.reload(extend)
    DEC = launch
    yield launch
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old
    importlib.reload(decode)
    importlib.reload(extend)


def _paged(lens, hkv, d, page, dtype, seed):
    """Pool + req_to_token with scrambled pages; returns (kb, vb, r2t, rows)."""
    g = torch.Generator().manual_seed(seed)
    slots = (sum(lens) // page + len(lens) + 2) * page
    rp = ReqToTokenPool(len(lens) + 2, max(lens) + 1, "cpu")
    alloc = PageAllocator(rp, slots, page, seed=seed)
    rows = list(range(1, len(lens) + 1))
    for r, n in zip(rows, lens):
        alloc.extend(r, n)
    kb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    vb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    return kb, vb, rp.req_to_token, rows


def _feature_kwargs(features, h, seed):
    g = torch.Generator().manual_seed(seed + 7)
    kw = {}
    if "window" in features:
        kw["sliding_window"] = 13
    if "softcap" in features:
        kw["logit_softcap"] = 2.5
    if "sinks" in features:
        kw["sinks"] = torch.randn(h, generator=g) * 2
    return kw


def _ref(q, k, v, qpos, scale, kw):
    return reference_attention(q, k, v, q_positions=qpos, scale=scale, window=kw.get("sliding_window"),
                               softcap=kw.get("logit_softcap"), sinks=kw.get("sinks"))


DECODE_CASES = [
    # (H, Hkv, D, page, dtype, features, max_splits)
    (4, 4, 64, 1, torch.bfloat16, (), 1),
    (4, 2, 64, 4, torch.bfloat16, ("window",), 4),
    (8, 2, 64, 16, torch.float16, ("softcap", "sinks"), 3),
    (4, 1, 96, 4, torch.bfloat16, ("window", "softcap", "sinks"), 8),
]


@pytest.mark.parametrize("h,hkv,d,page,dtype,features,max_splits", DECODE_CASES)
def test_decode_kernel_matches_reference(h, hkv, d, page, dtype, features, max_splits):
    """Split-K decode over scrambled pages equals the float64 reference for ragged lengths."""
    lens = [1, 37, 70, 16]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, dtype, seed=h + d + page)
    q = torch.randn(len(lens), h, d).to(dtype)
    kw = _feature_kwargs(features, h, seed=d)
    out = torch.full((len(lens), h, d), float("nan"), dtype=dtype)
    cfg = DEC.DecodeConfig(**SMALL_DEC)
    DEC.decode_attention(q, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), out,
                         sm_scale=d ** -0.5, max_splits=max_splits, config=cfg, **kw)
    for i, (r, n) in enumerate(zip(rows, lens)):
        slots = r2t[r, :n].long()
        ref = _ref(q[i:i + 1], kb[slots], vb[slots], torch.tensor([n - 1]), d ** -0.5, kw)
        assert rel_err(out[i:i + 1], ref) <= 1e-2, (i, n)


EXTEND_CASES = [
    # (H, Hkv, D, page, dtype, features)
    (4, 4, 64, 1, torch.bfloat16, ()),
    (4, 2, 64, 4, torch.float16, ("window", "sinks")),
    (8, 2, 96, 16, torch.bfloat16, ("softcap",)),
    (4, 1, 64, 4, torch.bfloat16, ("window", "softcap", "sinks")),
]


@pytest.mark.parametrize("h,hkv,d,page,dtype,features", EXTEND_CASES)
def test_extend_kernel_matches_reference(h, hkv, d, page, dtype, features):
    """Extend (paged prefix + causal new tokens, ragged) equals the float64 reference per request."""
    prefix, new = [0, 5, 23], [19, 1, 7]
    lens = [p + n for p, n in zip(prefix, new)]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, dtype, seed=3 * h + d)
    q = torch.randn(sum(new), h, d).to(dtype)
    # The new tokens' K/V are the pool rows of their slots (as after save_kv_cache).
    new_slots = torch.cat([r2t[r, p:p + n].long() for r, p, n in zip(rows, prefix, new)])
    k, v = kb[new_slots].clone(), vb[new_slots].clone()
    kw = _feature_kwargs(features, h, seed=d + 1)
    qo = torch.tensor([0, 19, 20, 27], dtype=torch.int32)
    out = torch.full((sum(new), h, d), float("nan"), dtype=dtype)
    DEC.extend_attention(q, k, v, kb, vb, r2t, torch.tensor(rows), qo, torch.tensor(prefix, dtype=torch.int32), out,
                         max_extend_len=max(new), sm_scale=d ** -0.5, config=DEC.ExtendConfig(**SMALL_EXT), **kw)
    for i, (r, p, n) in enumerate(zip(rows, prefix, new)):
        slots = r2t[r, :p + n].long()
        sl = slice(int(qo[i]), int(qo[i + 1]))
        ref = _ref(q[sl], kb[slots], vb[slots], torch.arange(p, p + n), d ** -0.5, kw)
        assert rel_err(out[sl], ref) <= 1e-2, (i, p, n)
