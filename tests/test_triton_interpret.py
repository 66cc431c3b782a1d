"""The Triton kernels and backend on CPU under ``TRITON_INTERPRET=1``, against the float64 reference.

Small shapes (a few requests, tens of keys, 16-wide tiles) so the interpreter stays fast; the GPU
grid lives in ``tests/gpu/test_triton_gpu.py``.

Interpreter mode is decided when triton is first imported (``triton.language``'s own jit helpers,
``tl.sum``/``tl.cdiv``…, are created then). So: on a CUDA machine this module is skipped (the GPU
tests run the compiled kernels, and the variable must not leak into them); on CPU, if triton is not
imported yet the variable is set here; if another test module imported triton first, the whole
module re-runs in a fresh subprocess with the variable set (one test reports it).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
DIRECT = not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and (
    "triton" not in sys.modules or type(sys.modules["triton"].language.sum).__name__ == "InterpretedFunction")

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="CUDA present: tests/gpu/test_triton_gpu.py runs the compiled kernels")

from pipeline.backends.base import AttentionLayer  # noqa: E402
from pipeline.backends.triton import launch as DEC  # noqa: E402
from pipeline.core.contracts import ForwardMode  # noqa: E402
from pipeline.core.errors import BuildError, CapabilityMismatch  # noqa: E402
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch  # noqa: E402
from pipeline.runtime.reference import reference_attention, rel_err  # noqa: E402

SMALL_DEC = dict(block_n=16, block_n_single=32, split_min=32, num_warps=4, num_stages=1)
SMALL_EXT = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


@pytest.mark.skipif(DIRECT, reason="triton is in interpreter mode in this process: the tests run directly")
def test_interpreter_suite_in_subprocess():
    """Triton was imported before TRITON_INTERPRET could be set: run this module in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fixed draws per test, so a CI failure reproduces; the kernel tests run only in interpreter mode."""
    if not DIRECT and request.node.name != "test_interpreter_suite_in_subprocess":
        pytest.skip("ran in a subprocess with TRITON_INTERPRET=1 (see test_interpreter_suite_in_subprocess)")
    torch.manual_seed(1234)


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
                               softcap=kw.get("logit_softcap"), sinks=kw.get("sinks"),
                               chunk=kw.get("attention_chunk_size"))


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


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("h,hkv,d,page,dtype,features", EXTEND_CASES)
def test_extend_kernel_matches_reference(h, hkv, d, page, dtype, features, pack):
    """Extend (paged prefix + causal new tokens, ragged) equals the float64 reference per request, with one
    q head per program and with the GQA group's heads packed into the rows (blocks straddle tokens)."""
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
                         max_extend_len=max(new), sm_scale=d ** -0.5,
                         config=DEC.ExtendConfig(**SMALL_EXT, pack_gqa=pack), **kw)
    for i, (r, p, n) in enumerate(zip(rows, prefix, new)):
        slots = r2t[r, :p + n].long()
        sl = slice(int(qo[i]), int(qo[i + 1]))
        ref = _ref(q[sl], kb[slots], vb[slots], torch.arange(p, p + n), d ** -0.5, kw)
        assert rel_err(out[sl], ref) <= 1e-2, (i, p, n)



@pytest.mark.parametrize("window,pack", [(None, False), (13, False), (40, False), (13, True)])
def test_kernels_never_read_rows_outside_the_requests(window, pack):
    """Every pool row that holds none of the batch's tokens (the padding slot 0, free and stale slots) is NaN:
    extend (ragged prefixes, every tile kind, with and without a window) and decode stay finite and equal the
    float64 reference — no such row enters a score or the ``P V`` dot, not even with probability 0."""
    h, hkv, d, page = 4, 2, 64, 4
    prefix, new = [0, 5, 23, 37], [19, 1, 7, 30]
    lens = [a + n for a, n in zip(prefix, new)]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, torch.bfloat16, seed=17)
    used = torch.cat([r2t[r, :n].long() for r, n in zip(rows, lens)])
    unused = torch.ones(kb.shape[0], dtype=torch.bool)
    unused[used] = False
    assert unused[0] and unused.sum() > 0
    kb[unused], vb[unused] = float("nan"), float("nan")
    kw = {"sliding_window": window} if window else {}
    q = torch.randn(sum(new), h, d).to(torch.bfloat16)
    new_slots = torch.cat([r2t[r, a:a + n].long() for r, a, n in zip(rows, prefix, new)])
    qo = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    out = torch.full((sum(new), h, d), float("nan"), dtype=torch.bfloat16)
    DEC.extend_attention(q, kb[new_slots].clone(), vb[new_slots].clone(), kb, vb, r2t, torch.tensor(rows), qo,
                         torch.tensor(prefix, dtype=torch.int32), out, max_extend_len=max(new), sm_scale=d ** -0.5,
                         config=DEC.ExtendConfig(**SMALL_EXT, pack_gqa=pack), **kw)
    qd = torch.randn(len(lens), h, d).to(torch.bfloat16)
    outd = torch.full((len(lens), h, d), float("nan"), dtype=torch.bfloat16)
    DEC.decode_attention(qd, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), outd,
                         sm_scale=d ** -0.5, max_splits=4, config=DEC.DecodeConfig(**SMALL_DEC), **kw)
    assert torch.isfinite(out).all() and torch.isfinite(outd).all()
    for i, (r, a, n) in enumerate(zip(rows, prefix, new)):
        slots = r2t[r, :a + n].long()
        sl = slice(int(qo[i]), int(qo[i + 1]))
        assert rel_err(out[sl], _ref(q[sl], kb[slots], vb[slots], torch.arange(a, a + n), d ** -0.5, kw)) <= 1e-2
        assert rel_err(outd[i:i + 1], _ref(qd[i:i + 1], kb[slots], vb[slots], torch.tensor([a + n - 1]),
                                           d ** -0.5, kw)) <= 1e-2

# Chunked local attention (Llama-4): chunk sizes below, at and above the 16-key tile, 1 (each query
# sees only itself) and a chunk that is not a multiple of the page size; lengths put chunk boundaries
# right before / after the last query and inside the split ranges.
CHUNK_DECODE = [  # (chunk, page, max_splits, extra features)
    (1, 4, 2, ()), (5, 1, 4, ("sinks",)), (16, 16, 4, ()), (48, 4, 8, ()), (24, 4, 8, ("window", "softcap")),
]


@pytest.mark.parametrize("chunk,page,max_splits,features", CHUNK_DECODE)
def test_decode_kernel_chunked_matches_reference(chunk, page, max_splits, features):
    """Chunked decode: the query at L-1 sees keys [(L-1)//C*C, L) only; equals the float64 reference."""
    h, hkv, d, dtype = 4, 2, 64, torch.bfloat16
    lens = [1, 37, 130, 16, 64, 65, 49]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, dtype, seed=chunk + page)
    q = torch.randn(len(lens), h, d).to(dtype)
    kw = dict(_feature_kwargs(features, h, seed=chunk), attention_chunk_size=chunk)
    out = torch.full((len(lens), h, d), float("nan"), dtype=dtype)
    DEC.decode_attention(q, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), out,
                         sm_scale=d ** -0.5, max_splits=max_splits, config=DEC.DecodeConfig(**SMALL_DEC), **kw)
    for i, (r, n) in enumerate(zip(rows, lens)):
        slots = r2t[r, :n].long()
        ref = _ref(q[i:i + 1], kb[slots], vb[slots], torch.tensor([n - 1]), d ** -0.5, kw)
        assert rel_err(out[i:i + 1], ref) <= 1e-2, (i, n)
    # the chunk bites: ignoring it changes the result of a request whose chunk starts after 0
    i = lens.index(130)
    slots = r2t[rows[i], :130].long()
    full = _ref(q[i:i + 1], kb[slots], vb[slots], torch.tensor([129]), d ** -0.5, {**kw, "attention_chunk_size": None})
    assert rel_err(out[i:i + 1], full) > 5e-2


@pytest.mark.parametrize("chunk,page,features,pack", [(8, 4, (), False), (16, 16, ("sinks",), True),
                                                      (20, 1, ("window",), True), (1, 4, (), False),
                                                      (7, 3, ("softcap",), True)])
def test_extend_kernel_chunked_matches_reference(chunk, page, features, pack):
    """Chunked extend: prefix and new tokens both masked by chunk; blocks past the first (30 new tokens)."""
    h, hkv, d, dtype = 4, 2, 64, torch.bfloat16
    prefix, new = [0, 5, 23, 40], [19, 1, 7, 30]
    lens = [p + n for p, n in zip(prefix, new)]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, dtype, seed=chunk * 3 + page)
    q = torch.randn(sum(new), h, d).to(dtype)
    new_slots = torch.cat([r2t[r, p:p + n].long() for r, p, n in zip(rows, prefix, new)])
    k, v = kb[new_slots].clone(), vb[new_slots].clone()
    kw = dict(_feature_kwargs(features, h, seed=chunk), attention_chunk_size=chunk)
    qo = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    out = torch.full((sum(new), h, d), float("nan"), dtype=dtype)
    DEC.extend_attention(q, k, v, kb, vb, r2t, torch.tensor(rows), qo, torch.tensor(prefix, dtype=torch.int32), out,
                         max_extend_len=max(new), sm_scale=d ** -0.5,
                         config=DEC.ExtendConfig(**SMALL_EXT, pack_gqa=pack), **kw)
    for i, (r, p, n) in enumerate(zip(rows, prefix, new)):
        slots = r2t[r, :p + n].long()
        sl = slice(int(qo[i]), int(qo[i + 1]))
        ref = _ref(q[sl], kb[slots], vb[slots], torch.arange(p, p + n), d ** -0.5, kw)
        assert rel_err(out[sl], ref) <= 1e-2, (i, p, n)


# ------------------------------------------------------------------------------- what the kernels read
class _ReadSpy:
    """Records every element a kernel loads under the interpreter (its masked-load builder op, wrapped for the
    duration of a ``with``): ``rows(buf)`` maps the loads that fell inside ``buf`` to (program id, row) pairs.
    Test-only: the kernels carry no instrumentation."""

    def __enter__(self):
        from triton.runtime import interpreter as interp

        self._b = interp.interpreter_builder
        self._orig = self._b.create_masked_load
        self._orig_plain = self._b.create_load   # the kernels load unmasked where a tile is known whole
        self.loads = []

        def spy(ptrs, mask, other, *a):
            self.loads.append((tuple(self._b.grid_idx), ptrs.data[mask.data].copy()))
            return self._orig(ptrs, mask, other, *a)

        def spy_plain(ptrs, *a):
            self.loads.append((tuple(self._b.grid_idx), ptrs.data.reshape(-1).copy()))
            return self._orig_plain(ptrs, *a)

        self._b.create_masked_load = spy
        self._b.create_load = spy_plain
        return self

    def __exit__(self, *exc):
        self._b.create_masked_load = self._orig
        self._b.create_load = self._orig_plain

    def rows(self, buf: torch.Tensor) -> set:
        lo, row_bytes = buf.data_ptr(), buf.stride(0) * buf.element_size()
        hi = lo + buf.shape[0] * row_bytes
        out = set()
        for pid, addrs in self.loads:
            a = addrs.astype("int64")
            for r in set(((a[(a >= lo) & (a < hi)] - lo) // row_bytes).tolist()):
                out.add((pid, r))
        return out


def _positions(r2t, rows, lens):
    """slot -> (request index, position) over the requests' tokens."""
    return {int(r2t[r, t]): (i, t) for i, (r, n) in enumerate(zip(rows, lens)) for t in range(n)}


@pytest.mark.parametrize("window,chunk,max_splits", [(24, None, 4), (7, None, 8), (40, 32, 4), (None, 16, 2)])
def test_decode_reads_only_the_visible_keys(window, chunk, max_splits):
    """Sliding window / chunk: decode loads exactly the K and V rows of the visible keys [start, L) of each
    request — pages before the window or chunk start are never read (the split ranges begin there), and
    the result still equals the reference."""
    h, hkv, d, page = 4, 2, 64, 4
    lens = [200, 37, 130, 5, 64]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, torch.bfloat16, seed=11)
    q = torch.randn(len(lens), h, d).to(torch.bfloat16)
    kw = {k: x for k, x in (("sliding_window", window), ("attention_chunk_size", chunk)) if x is not None}
    out = torch.full((len(lens), h, d), float("nan"), dtype=torch.bfloat16)
    with _ReadSpy() as spy:
        DEC.decode_attention(q, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), out,
                             sm_scale=d ** -0.5, max_splits=max_splits, config=DEC.DecodeConfig(**SMALL_DEC), **kw)
    pos = _positions(r2t, rows, lens)
    for buf in (kb, vb):
        read = {}
        for (pid, _, _), slot in spy.rows(buf):   # stage-1 grid (B * Hkv, splits): pid = b * Hkv + kv head
            i, t = pos[slot]
            assert i == pid // hkv, "a program read another request's keys"
            read.setdefault(i, set()).add(t)
        for i, n in enumerate(lens):
            start = max(n - window, 0) if window else 0
            if chunk:
                start = max(start, (n - 1) // chunk * chunk)
            assert read[i] == set(range(start, n)), (i, n, sorted(read[i])[:3])
    for i, (r, n) in enumerate(zip(rows, lens)):
        slots = r2t[r, :n].long()
        assert rel_err(out[i:i + 1], _ref(q[i:i + 1], kb[slots], vb[slots], torch.tensor([n - 1]), d ** -0.5,
                                           kw)) <= 1e-2


@pytest.mark.parametrize("window,chunk,pack", [(16, None, False), (5, None, False), (None, 24, False),
                                               (16, None, True), (None, 24, True)])
def test_extend_skips_key_tiles_outside_every_window(window, chunk, pack):
    """Extend with a window (or chunk): a program (head, block of BLOCK_M new tokens) never loads a cached or
    new key tile that lies wholly before the first key its first query sees, so the keys it reads are
    bounded by window + BLOCK_M + 2 tiles, not by the prefix (result equal to the reference)."""
    h, hkv, d, page = (4, 2, 64, 4) if pack else (2, 1, 64, 4)
    g = h // hkv
    prefix, new = [150, 0, 40], [40, 33, 9]
    lens = [p + n for p, n in zip(prefix, new)]
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, torch.bfloat16, seed=5)
    q = torch.randn(sum(new), h, d).to(torch.bfloat16)
    new_slots = torch.cat([r2t[r, p:p + n].long() for r, p, n in zip(rows, prefix, new)])
    k, v = kb[new_slots].clone(), vb[new_slots].clone()
    kw = {x: y for x, y in (("sliding_window", window), ("attention_chunk_size", chunk)) if y is not None}
    qo = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    out = torch.full((sum(new), h, d), float("nan"), dtype=torch.bfloat16)
    cfg = DEC.ExtendConfig(**SMALL_EXT, pack_gqa=pack)
    bm, bn = cfg.block_m, cfg.block_n
    with _ReadSpy() as spy:
        DEC.extend_attention(q, k, v, kb, vb, r2t, torch.tensor(rows), qo, torch.tensor(prefix, dtype=torch.int32),
                             out, max_extend_len=max(new), sm_scale=d ** -0.5, config=cfg, **kw)
    pos = _positions(r2t, rows, lens)
    per_prog = {}
    n_blocks = -(-max(new) * (g if pack else 1) // bm)
    for buf in (kb, k):
        for (hh, b, z), row in spy.rows(buf):   # grid (head, request, block taken last-first)
            mb = n_blocks - 1 - z
            t = pos[row][1] if buf is kb else prefix[b] + row - int(qo[b])
            if buf is kb:
                assert pos[row][0] == b
            per_prog.setdefault((hh, mb, b), set()).add(t)
    assert per_prog, "the spy saw no key loads"
    for (hh, mb, b), ts in per_prog.items():
        first_q = prefix[b] + (mb * bm // g if pack else mb * bm)
        first_visible = max(first_q - window + 1, 0) if window else first_q // chunk * chunk
        # the first tile read holds a visible key (tiles start on multiples of BLOCK_N: absolute positions in
        # the prefix, new-token indices in the causal phase)
        assert min(ts) > first_visible - bn, ((hh, mb, b), min(ts), first_visible)
        span = (window - 1 if window else chunk) + bm + 2 * bn
        assert len(ts) <= span, ((hh, mb, b), len(ts))
    assert max(len(ts) for ts in per_prog.values()) < prefix[0]   # the long prefix was not walked
    for i, (r, p, n) in enumerate(zip(rows, prefix, new)):
        slots = r2t[r, :p + n].long()
        sl = slice(int(qo[i]), int(qo[i + 1]))
        assert rel_err(out[sl], _ref(q[sl], kb[slots], vb[slots], torch.arange(p, p + n), d ** -0.5, kw)) <= 1e-2


# ------------------------------------------------------------------------------------------- fp8 KV
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _quantise(real, fmt, scale):
    """The pool's rule: stored = round_to_fp8(real / scale) (scale a float or a 0-d tensor)."""
    return (real.float() / scale).to(FP8[fmt])


def _deq(stored, scale):
    """What the stored values mean: stored * scale, in float64 (the reference's input)."""
    return stored.double() * float(scale)


def _fp8_paged(lens, hkv, d, page, fmt, k_scale, v_scale, seed):
    kb, vb, r2t, rows = _paged(lens, hkv, d, page, torch.float32, seed)
    # magnitudes that use the fp8 range around the scales (incl. e4m3 subnormals near 2^-9 * scale)
    return _quantise(kb * 3 * float(k_scale), fmt, k_scale), _quantise(vb * 2 * float(v_scale), fmt, v_scale), r2t, rows


FP8_DECODE_CASES = [
    # (fmt, q dtype, H, Hkv, D, page, k_scale, v_scale, scales as tensors, features, max_splits)
    ("e4m3", torch.bfloat16, 8, 2, 64, 1, 0.37, 2.5, False, (), 4),
    ("e5m2", torch.bfloat16, 4, 4, 64, 16, 1.75, 0.06, True, ("window", "sinks"), 3),
    ("e4m3", torch.float16, 4, 1, 96, 4, 0.011, 0.5, True, ("softcap",), 8),
    ("e5m2", torch.float16, 8, 2, 64, 4, 3.0, 1.0, False, ("window", "softcap", "sinks"), 1),
]


@pytest.mark.parametrize("fmt,qdt,h,hkv,d,page,ks,vs,as_tensor,features,max_splits", FP8_DECODE_CASES)
def test_decode_kernel_fp8_matches_dequantised_reference(fmt, qdt, h, hkv, d, page, ks, vs, as_tensor, features,
                                                         max_splits):
    """fp8 K/V (both formats, non-unit scales given as floats or 0-d tensors, bf16/fp16 q) equal the float64
    reference over the dequantised stored K/V; the scales bite (scale 1.0 gives a different result)."""
    lens = [1, 37, 70, 16]
    kb, vb, r2t, rows = _fp8_paged(lens, hkv, d, page, fmt, ks, vs, seed=h + d + page)
    q = torch.randn(len(lens), h, d).to(qdt)
    kw = _feature_kwargs(features, h, seed=d)
    scales = dict(k_scale=torch.tensor(ks), v_scale=torch.tensor(vs)) if as_tensor else dict(k_scale=ks, v_scale=vs)
    out = torch.full((len(lens), h, d), float("nan"), dtype=qdt)
    DEC.decode_attention(q, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), out,
                         sm_scale=d ** -0.5, max_splits=max_splits, config=DEC.DecodeConfig(**SMALL_DEC), **kw,
                         **scales)
    unscaled = torch.full_like(out, float("nan"))
    DEC.decode_attention(q, kb, vb, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32), unscaled,
                         sm_scale=d ** -0.5, max_splits=max_splits, config=DEC.DecodeConfig(**SMALL_DEC), **kw)
    for i, (r, n) in enumerate(zip(rows, lens)):
        slots = r2t[r, :n].long()
        ref = _ref(q[i:i + 1], _deq(kb[slots], ks), _deq(vb[slots], vs), torch.tensor([n - 1]), d ** -0.5, kw)
        assert rel_err(out[i:i + 1], ref) <= 1e-2, (i, n)
    assert rel_err(unscaled, out) > 0.05


FP8_EXTEND_CASES = [
    # (fmt, q dtype, H, Hkv, D, page, k_scale, v_scale, scales as tensors, features)
    ("e4m3", torch.bfloat16, 4, 2, 64, 4, 0.37, 2.5, True, (), False),
    ("e5m2", torch.bfloat16, 8, 2, 64, 16, 1.75, 0.06, False, ("window", "sinks"), True),
    ("e4m3", torch.float16, 4, 4, 96, 1, 0.011, 0.5, False, ("softcap",), False),
    ("e5m2", torch.float16, 4, 1, 64, 4, 3.0, 1.0, True, ("window", "softcap", "sinks"), True),
]


@pytest.mark.parametrize("fmt,qdt,h,hkv,d,page,ks,vs,as_tensor,features,pack", FP8_EXTEND_CASES)
def test_extend_kernel_fp8_matches_dequantised_reference(fmt, qdt, h, hkv, d, page, ks, vs, as_tensor, features,
                                                         pack):
    """fp8 extend: paged fp8 prefix + the new tokens in the stored fp8 format, against float64 attention over
    the dequantised stored K/V (ragged, blocks past the first)."""
    prefix, new = [0, 5, 23], [19, 1, 7]
    lens = [p + n for p, n in zip(prefix, new)]
    kb, vb, r2t, rows = _fp8_paged(lens, hkv, d, page, fmt, ks, vs, seed=3 * h + d)
    q = torch.randn(sum(new), h, d).to(qdt)
    new_slots = torch.cat([r2t[r, p:p + n].long() for r, p, n in zip(rows, prefix, new)])
    k, v = kb[new_slots].clone(), vb[new_slots].clone()
    kw = _feature_kwargs(features, h, seed=d + 1)
    scales = dict(k_scale=torch.tensor(ks), v_scale=torch.tensor(vs)) if as_tensor else dict(k_scale=ks, v_scale=vs)
    qo = torch.tensor([0, 19, 20, 27], dtype=torch.int32)
    out = torch.full((sum(new), h, d), float("nan"), dtype=qdt)
    DEC.extend_attention(q, k, v, kb, vb, r2t, torch.tensor(rows), qo, torch.tensor(prefix, dtype=torch.int32), out,
                         max_extend_len=max(new), sm_scale=d ** -0.5,
                         config=DEC.ExtendConfig(**SMALL_EXT, pack_gqa=pack), **kw, **scales)
    for i, (r, p, n) in enumerate(zip(rows, prefix, new)):
        slots = r2t[r, :p + n].long()
        sl = slice(int(qo[i]), int(qo[i + 1]))
        ref = _ref(q[sl], _deq(kb[slots], ks), _deq(vb[slots], vs), torch.arange(p, p + n), d ** -0.5, kw)
        assert rel_err(out[sl], ref) <= 1e-2, (i, p, n)


# ------------------------------------------------------------------------------------------- backend
def _backend(h, hkv, d, **kw):
    from pipeline.backends.triton.backend import TritonAttnBackend

    return TritonAttnBackend(torch_device="cpu", layer_dims=[(h, hkv, d, d)], num_sms=2,
                             decode_config=DEC.DecodeConfig(**SMALL_DEC), extend_config=DEC.ExtendConfig(**SMALL_EXT),
                             **kw)


def _engine(h=4, hkv=2, d=64, page=4, dtype=torch.bfloat16):
    rp = ReqToTokenPool(6, 128, "cpu")
    kv = KVPool(512, page, [(hkv, d, d)], dtype, "cpu")
    return rp, kv, PageAllocator(rp, 512, page, seed=1)


def _step(backend, mode, rows, new, alloc, kv, layer, dtype):
    fb = make_forward_batch(mode, rows, new, alloc, kv)
    t = fb.num_tokens
    q = torch.randn(t, layer.num_heads, layer.head_dim).to(dtype)
    k = torch.randn(t, layer.num_kv_heads, layer.head_dim).to(dtype)
    v = torch.randn(t, layer.num_kv_heads, layer.head_dim).to(dtype)
    backend.init_forward_metadata(fb)
    return fb, q, k, v, backend.forward(q.reshape(t, -1), k, v, layer, fb)


def _check_step(fb, q, out, layer):
    r2t, pool = fb.req_to_token_pool.req_to_token, fb.token_to_kv_pool
    start = 0
    for row, s, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
        slots = r2t[row, :s].long()
        ref = reference_attention(q[start:start + n], pool.k_buffer[0][slots], pool.v_buffer[0][slots],
                                  q_positions=torch.arange(s - n, s), scale=layer.scaling,
                                  window=layer.sliding_window, softcap=layer.logit_softcap, sinks=layer.sinks,
                                  chunk=layer.attention_chunk_size)
        assert rel_err(out[start:start + n].view(n, layer.num_heads, -1), ref) <= 1e-2
        start += n


def test_backend_extend_then_decode_writes_kv_and_matches_reference():
    """Extend then two decode steps through the backend: K/V land in the pool; outputs match the reference."""
    rp, kv, alloc = _engine()
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, scaling=0.125,
                           sliding_window=9, sinks=torch.randn(4))
    be = _backend(4, 2, 64)
    fb, q, k, v, out = _step(be, ForwardMode.EXTEND, [1, 3], [21, 6], alloc, kv, layer, torch.bfloat16)
    assert torch.equal(kv.k_buffer[0][fb.out_cache_loc], k) and torch.equal(kv.v_buffer[0][fb.out_cache_loc], v)
    assert out.shape == (27, 4 * 64) and out.dtype == torch.bfloat16
    _check_step(fb, q, out, layer)
    for _ in range(2):
        fb, q, k, v, out = _step(be, ForwardMode.DECODE, [3, 1], [1, 1], alloc, kv, layer, torch.bfloat16)
        assert torch.equal(kv.k_buffer[0][fb.out_cache_loc], k)
        _check_step(fb, q, out, layer)


def test_backend_chunked_layer_extend_decode_and_graph_replay():
    """A Llama-4 style chunked layer through the backend: extend, decode across a chunk boundary, and a
    graph-hook replay equal to eager; each against the float64 reference and torch_native."""
    from pipeline.backends.torch_native import TorchNativeBackend

    rp, kv, alloc = _engine()
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, scaling=0.125,
                           attention_chunk_size=8)
    be, tn = _backend(4, 2, 64), TorchNativeBackend(torch_device="cpu")
    fb, q, k, v, out = _step(be, ForwardMode.EXTEND, [1, 3, 4], [21, 6, 7], alloc, kv, layer, torch.bfloat16)
    _check_step(fb, q, out, layer)
    tn.init_forward_metadata(fb)
    assert rel_err(out, tn.forward(q, k, v, layer, fb, save_kv_cache=False)) <= 1e-2
    for _ in range(2):  # lengths 22/7/8 then 23/8/9: request 4 crosses into a new chunk
        fb, q, k, v, out = _step(be, ForwardMode.DECODE, [1, 3, 4], [1, 1, 1], alloc, kv, layer, torch.bfloat16)
        _check_step(fb, q, out, layer)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fb = make_forward_batch(ForwardMode.DECODE, [1, 3, 4], [1, 1, 1], alloc, kv)
    be.init_forward_metadata_capture_cuda_graph(3, 3, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None)
    q, k, v = torch.randn(3, 4, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16()
    graphed = be.forward(q, k, v, layer, fb)
    be.init_forward_metadata(fb)
    assert torch.equal(graphed, be.forward(q, k, v, layer, fb, save_kv_cache=False))
    _check_step(fb, q, graphed, layer)


def test_backend_matches_torch_native():
    """The triton backend and torch_native agree on the same ragged extend batch (fp16, softcap)."""
    from pipeline.backends.torch_native import TorchNativeBackend

    rp, kv, alloc = _engine(h=4, hkv=4, dtype=torch.float16)
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=4, head_dim=64, v_head_dim=64, scaling=0.125,
                           logit_softcap=3.0)
    fb, q, k, v, out = _step(_backend(4, 4, 64), ForwardMode.EXTEND, [2, 4, 5], [3, 17, 1], alloc, kv, layer,
                             torch.float16)
    tn = TorchNativeBackend(torch_device="cpu")
    tn.init_forward_metadata(fb)
    assert rel_err(out, tn.forward(q, k, v, layer, fb, save_kv_cache=False)) <= 1e-2


def test_graph_hooks_refresh_fixed_buffers_for_changed_lengths():
    """Capture points decode at fixed buffers; replay refreshes them and equals an eager run bit for bit."""
    rp, kv, alloc = _engine()
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=64, scaling=0.125)
    be = _backend(4, 2, 64)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    bufs = [b.data_ptr() for b in be.owned_buffers()]
    _step(be, ForwardMode.EXTEND, [1, 2, 3], [5, 30, 2], alloc, kv, layer, torch.bfloat16)
    fb = make_forward_batch(ForwardMode.DECODE, [1, 2, 3], [1, 1, 1], alloc, kv)
    be.init_forward_metadata_capture_cuda_graph(3, 3, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None)
    alloc.extend(1, 40)  # lengths change after capture
    fb2 = make_forward_batch(ForwardMode.DECODE, [3, 1, 2], [1, 1, 1], alloc, kv)
    be.init_forward_metadata_replay_cuda_graph(3, fb2.req_pool_indices, fb2.seq_lens, sum(fb2.seq_lens_cpu), None,
                                               ForwardMode.DECODE, None, None)
    assert be._graph["seq_lens"][:3].tolist() == fb2.seq_lens_cpu
    q, k, v = torch.randn(3, 4, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16()
    graphed = be.forward(q, k, v, layer, fb2)
    assert [b.data_ptr() for b in be.owned_buffers()] == bufs
    be.init_forward_metadata(fb2)
    assert torch.equal(graphed, be.forward(q, k, v, layer, fb2))
    _check_step(fb2, q, graphed, layer)
    with pytest.raises(CapabilityMismatch):
        be.init_forward_metadata_capture_cuda_graph(2, 8, fb.req_pool_indices, fb.seq_lens, None,
                                                    ForwardMode.EXTEND, None)
    be.close()
    assert be.owned_buffers() == [] and be.closed


# ------------------------------------------------------------------------------------------- errors
def _dec_args(**over):
    a = dict(q=torch.zeros(2, 4, 64, dtype=torch.bfloat16), k_buffer=torch.zeros(32, 2, 64, dtype=torch.bfloat16),
             v_buffer=torch.zeros(32, 2, 64, dtype=torch.bfloat16), req_to_token=torch.zeros(3, 16, dtype=torch.int32),
             req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([3, 4], dtype=torch.int32),
             out=torch.zeros(2, 4, 64, dtype=torch.bfloat16))
    a.update(over)
    return a


@pytest.mark.parametrize("over,err,field", [
    (dict(q=torch.zeros(2, 4, 64)), CapabilityMismatch, "q.dtype"),
    (dict(q=torch.zeros(2, 3, 64, dtype=torch.bfloat16), out=torch.zeros(2, 3, 64, dtype=torch.bfloat16)),
     BuildError, "num_heads"),
    (dict(k_buffer=torch.zeros(32, 2, 64, dtype=torch.float16)), CapabilityMismatch, "k_buffer.dtype"),
    (dict(q=torch.zeros(2, 4, 512, dtype=torch.bfloat16), k_buffer=torch.zeros(32, 2, 512, dtype=torch.bfloat16),
          v_buffer=torch.zeros(32, 2, 512, dtype=torch.bfloat16)), CapabilityMismatch, "head_dim"),
    (dict(seq_lens=torch.tensor([3], dtype=torch.int32)), BuildError, "seq_lens.shape"),
    (dict(req_to_token=torch.zeros(3, 16, dtype=torch.int64)), BuildError, "req_to_token.dtype"),
    (dict(q=torch.zeros(2, 64, 4, dtype=torch.bfloat16).transpose(1, 2)), BuildError, "q.stride(-1)"),
    (dict(sinks=torch.zeros(3)), BuildError, "sinks.shape"),
    (dict(sliding_window=0), BuildError, "sliding_window"),
    (dict(attention_chunk_size=0), BuildError, "attention_chunk_size"),
    (dict(k_buffer=torch.zeros(32, 2, 64)), CapabilityMismatch, "k_buffer.dtype"),
    (dict(k_buffer=torch.zeros(32, 2, 64, dtype=torch.float8_e4m3fn)), BuildError, "v_buffer.dtype"),
    (dict(k_buffer=torch.zeros(32, 2, 64, dtype=torch.float8_e4m3fn),
          v_buffer=torch.zeros(32, 2, 64, dtype=torch.float8_e5m2)), BuildError, "v_buffer.dtype"),
    (dict(k_scale=0.0), BuildError, "k_scale"),
    (dict(k_scale=float("nan")), BuildError, "k_scale"),
    (dict(v_scale=-1.0), BuildError, "v_scale"),
    (dict(v_scale=True), BuildError, "v_scale"),
    (dict(k_scale="1.0"), BuildError, "k_scale"),
    (dict(k_scale=torch.ones(2)), BuildError, "k_scale"),
    (dict(v_scale=torch.ones((), dtype=torch.int32)), BuildError, "v_scale"),
])
def test_decode_launcher_rejects_bad_input(over, err, field):
    """Bad inputs raise the typed error naming the field, before any launch."""
    kw = {k: over.pop(k) for k in ("sinks", "sliding_window", "attention_chunk_size", "k_scale", "v_scale")
          if k in over}
    with pytest.raises(err) as ei:
        DEC.decode_attention(**_dec_args(**over), sm_scale=0.1, max_splits=2, **kw)
    assert ei.value.info.flags[0].name == field and ei.value.info.remedy


def _ext_args(**over):
    a = dict(q=torch.zeros(3, 4, 64, dtype=torch.bfloat16), k=torch.zeros(3, 2, 64, dtype=torch.float8_e4m3fn),
             v=torch.zeros(3, 2, 64, dtype=torch.float8_e4m3fn),
             k_buffer=torch.zeros(32, 2, 64, dtype=torch.float8_e4m3fn),
             v_buffer=torch.zeros(32, 2, 64, dtype=torch.float8_e4m3fn),
             req_to_token=torch.zeros(3, 16, dtype=torch.int32),
             req_pool_indices=torch.tensor([1, 2]), qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32),
             prefix_lens=torch.tensor([2, 4], dtype=torch.int32), out=torch.zeros(3, 4, 64, dtype=torch.bfloat16))
    a.update(over)
    return a


@pytest.mark.parametrize("over,err,field", [
    (dict(k=torch.zeros(3, 2, 64, dtype=torch.bfloat16)), BuildError, "k.dtype"),
    (dict(v=torch.zeros(3, 2, 64, dtype=torch.float8_e5m2)), BuildError, "v.dtype"),
    (dict(k_scale=float("inf")), BuildError, "k_scale"),
    (dict(v_scale=torch.ones(1, 1, dtype=torch.float32).expand(2, 1)), BuildError, "v_scale"),
])
def test_extend_launcher_rejects_bad_fp8_input(over, err, field):
    """Extend: the new K/V must be in the pool's stored format; scales as for decode; nothing launched."""
    kw = {k: over.pop(k) for k in ("k_scale", "v_scale") if k in over}
    args = _ext_args(**over)
    args["out"].fill_(float("nan"))
    with pytest.raises(err) as ei:
        DEC.extend_attention(**args, max_extend_len=2, sm_scale=0.1, **kw)
    assert ei.value.info.flags[0].name == field and ei.value.info.remedy
    assert args["out"].isnan().all()   # nothing written


@dataclasses.dataclass(frozen=True)
class ScaledLayer(AttentionLayer):
    """A layer carrying its KV dequantisation scales (as sglang's RadixAttention does)."""

    k_scale: float = 1.0
    v_scale: float = 1.0


def scaled_pool(slots, page, dims, dtype, device, ks, vs, **layer_kw):
    """(pool, layer) whose KV scales are (ks, vs): the pool's own per-layer scales where KVPool takes them (the
    contract of pipeline.backends.memory: the backend reads ``pool.kv_scales``), else carried by the layer."""
    try:
        return KVPool(slots, page, dims, dtype, device, k_scales=[ks], v_scales=[vs]), AttentionLayer(**layer_kw)
    except TypeError:
        return KVPool(slots, page, dims, dtype, device), ScaledLayer(**layer_kw, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_backend_fp8_pool_extend_decode_and_graph_replay(fmt):
    """An fp8 pool through the backend with the layer's non-unit scales: extend (new tokens read back in the
    stored format), decode, and a graph-hook replay equal to eager; each against the float64 reference over
    the dequantised stored K/V."""
    rp = ReqToTokenPool(6, 128, "cpu")
    kv, layer = scaled_pool(512, 4, [(2, 64, 64)], FP8[fmt], "cpu", 0.5, 3.0, layer_id=0, num_heads=4,
                            num_kv_heads=2, head_dim=64, v_head_dim=64, scaling=0.125, sliding_window=19)
    alloc = PageAllocator(rp, 512, 4, seed=1)
    be = _backend(4, 2, 64)

    def check(fb, q, out):
        start = 0
        for row, s, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
            slots = r2t[row, :s].long()
            ref = reference_attention(q[start:start + n], _deq(kv.k_buffer[0][slots], 0.5),
                                      _deq(kv.v_buffer[0][slots], 3.0), q_positions=torch.arange(s - n, s),
                                      scale=layer.scaling, window=layer.sliding_window)
            assert rel_err(out[start:start + n].view(n, 4, -1), ref) <= 1e-2
            start += n

    r2t = rp.req_to_token
    fb, q, k, v, out = _step(be, ForwardMode.EXTEND, [1, 3], [21, 6], alloc, kv, layer, torch.bfloat16)
    assert kv.k_buffer[0].dtype == FP8[fmt]
    check(fb, q, out)
    fb, q, k, v, out = _step(be, ForwardMode.DECODE, [3, 1], [1, 1], alloc, kv, layer, torch.bfloat16)
    check(fb, q, out)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fb = make_forward_batch(ForwardMode.DECODE, [1, 3], [1, 1], alloc, kv)
    be.init_forward_metadata_capture_cuda_graph(2, 2, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE, None)
    q, k, v = torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16(), torch.randn(2, 2, 64).bfloat16()
    graphed = be.forward(q, k, v, layer, fb)
    be.init_forward_metadata(fb)
    assert torch.equal(graphed, be.forward(q, k, v, layer, fb, save_kv_cache=False))
    check(fb, q, graphed)


def test_factory_refuses_mla_kind():
    """create() refuses an MLA layer kind its MLA kernels cannot serve (latent > 512) with CapabilityMismatch."""
    from types import SimpleNamespace

    from pipeline.backends.triton.backend import create
    from pipeline.core.contracts import LayerKind

    mla = LayerKind(kind="full", num_heads=16, num_kv_heads=1, head_dim_qk=1088, head_dim_v=1024, scaling=0.1,
                    is_mla=True)
    ctx = SimpleNamespace(layer_kinds=[mla], torch_device="cpu", device=SimpleNamespace(sm_count=4), role="primary")
    with pytest.raises(CapabilityMismatch):
        create(ctx)


def test_extend_pack_rule():
    """GQA packing: forced by the config, else only for grouped heads whose longest extend is shorter than a tile."""
    cfg = DEC.ExtendConfig(block_m=128)
    assert DEC.extend_packs_gqa(cfg, 4, 64) and not DEC.extend_packs_gqa(cfg, 4, 128)
    assert not DEC.extend_packs_gqa(cfg, 1, 1)
    assert DEC.extend_packs_gqa(DEC.ExtendConfig(pack_gqa=True), 1, 4096)
    assert not DEC.extend_packs_gqa(DEC.ExtendConfig(pack_gqa=False), 8, 1)


def test_benchmark_table_runs_on_cpu(monkeypatch):
    """benchmarks/triton_kernels.py end to end on tiny shapes under the interpreter (one shot at the GPU table):
    our rows compute, agree with float64 where FlashInfer is absent (err columns need FlashInfer), the targets
    are derived per run, and a FlashInfer variant that was not warmed up is an error row, not a crash."""
    import importlib
    import sys as _sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(root))
    tk = importlib.import_module("triton_kernels")
    small = dict(DECODE_B=(1, 3), DECODE_CTX=(32,), EXTEND_SHAPES=((2, 16, 16), (1, 32, 0)), WINDOW=32,
                 WINDOW_CTX=64, EXT_WINDOW=(1, 16, 48, 16), FP8_SHAPE=(3, 32),
                 SINK=dict(h=8, hkv=2, d=32, b=2, ctx=64, window=16), WS_BYTES=64, COPY_BYTES=1 << 10,
                 DEVICE="cpu", H=8, HKV=2, D=32, SWEEP_DECODE_SHAPES=((3, 64), (1, 32)))
    for k, v in small.items():
        monkeypatch.setattr(tk, k, v)
    ticks = iter(range(1, 10 ** 6))
    monkeypatch.setattr(tk, "_us", lambda fn: (fn(), float(next(ticks)))[1])
    monkeypatch.setattr(tk, "_graph", lambda fn: fn)
    monkeypatch.setattr(tk, "_sms", lambda dev: 2)    # few split programs: the interpreter runs each one
    monkeypatch.setattr(tk, "_FI_OK", set())          # nothing warmed: every FlashInfer row must be an error row
    monkeypatch.setitem(_sys.modules, "flashinfer", None)
    rs = tk.rows("cpu", runs=1, sweep=True)
    ours = [r for r in rs if r["impl"].startswith("triton")]
    fis = [r for r in rs if r["impl"].startswith("flashinfer")]
    assert ours and all("time_us" in r for r in ours), [r for r in ours if "error" in r][:2]
    assert fis and all("not warmed up" in r["error"] for r in fis)
    kinds = {r["kind"] for r in ours}
    assert kinds == {"decode", "window", "fp8", "sinks", "extend", "extend-window", "decode-sweep", "extend-sweep",
                     "fp8-sweep"}
    assert {r.get("run") for r in ours} == {1, None}   # the sweep runs once, outside the runs
    fp8 = [r for r in ours if r["kind"] == "fp8"]
    assert {r["impl"] for r in fp8} == {"triton-e4m3", "triton-e5m2"} and all("vs_bf16" in r for r in fp8)
    win = [r for r in ours if r["kind"] in ("window", "extend-window") and "window=" in r["shape"]]
    assert win and all("vs_full" in r for r in win)
    summ = dict(tk.summary(tk.targets(rs)))
    assert summ and set(summ.values()) <= {"met", "NOT met", "no data"}
    assert any(k.startswith("window ") and v in ("met", "NOT met") for k, v in summ.items())
    # a target counts as met only if it is met in every run
    two = [dict(kind="decode", shape="B=1 ctx=32", impl="triton", time_us=1.0, ratio=x, run=i)
           for i, x in ((1, 0.99), (2, 0.95))] + [dict(kind="decode", shape="B=3 ctx=32", impl="triton", time_us=1.0,
                                                       ratio=0.98, run=i) for i in (1, 2)]
    assert dict(tk.summary(tk.targets(two))) == {"decode B=1 ctx=32 vs flashinfer-tc": "NOT met",
                                                 "decode B=3 ctx=32 vs flashinfer-tc": "met"}
    jobs = tk.precompile_jobs(sweep=True)   # the GPU run compiles these in parallel processes first
    assert len(jobs) == len(set(jobs)) > 10
    for job in jobs[:: max(1, len(jobs) // 6)] + [j for j in jobs if "|1|" in j or "e5m2" in j]:
        assert tk._precompile_job(job).startswith("ok"), job
