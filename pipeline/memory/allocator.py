"""A model of PyTorch's CUDA caching allocator for one private pool, and the decode forward's allocations traced through
it (what :mod:`pipeline.memory.graphs` estimates). Torch-free (docs/internals.md)."""

from __future__ import annotations

import bisect
import os
import re
from typing import Mapping, Optional, Sequence

from pipeline.backends import registry
from pipeline.core.contracts import LayerKind, ModelSpec


MiB = 1 << 20
K_MIN_BLOCK = 512             # kMinBlockSize: every request rounded up to a multiple of this
K_SMALL_SIZE = 1 * MiB        # kSmallSize: the largest "small" request
K_SMALL_BUFFER = 2 * MiB      # kSmallBuffer: a small-pool segment
K_LARGE_BUFFER = 20 * MiB     # kLargeBuffer: the segment a request between 1 and 10 MiB gets
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here on a segment is the request rounded to kRoundLarge
K_ROUND_LARGE = 2 * MiB       # kRoundLarge

# PyTorch's default cuBLAS workspace: ":4096:8" (32 MiB) on Hopper, ":4096:2:16:8" elsewhere.
BLAS_WORKSPACE_32MIB_ARCHS = ("sm90",)


def blas_workspace_bytes(arch: str, env: Mapping[str, str] = os.environ) -> int:
    """Bytes of the cuBLAS workspace per (handle, stream) on ``arch``: ``CUBLAS_WORKSPACE_CONFIG`` summed when readable,
    else 32 MiB on :data:`BLAS_WORKSPACE_32MIB_ARCHS`, 4096 KiB x 2 + 16 KiB x 8 elsewhere."""
    text = env.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":([0-9]+):([0-9]+)", text)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 1024 * 8 if arch in BLAS_WORKSPACE_32MIB_ARCHS else 4096 * 1024 * 2 + 16 * 1024 * 8


class PoolModel:
    """One private pool of PyTorch's CUDA caching allocator (one stream): :meth:`malloc` / :meth:`free` block handles,
    :attr:`reserved` the bytes of every segment. Pure Python."""

    def __init__(self) -> None:
        self.reserved = 0
        self._next_seg = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> (size, seg, off)
        self._blocks: dict[tuple[int, int], tuple[int, bool, bool]] = {}  # (seg, off) -> (size, small, free)
        self._free_ends: dict[tuple[int, int], int] = {}  # (seg, end) -> off of the free block ending there

    @staticmethod
    def round_size(nbytes: int) -> int:
        """The request rounded up to a multiple of 512 bytes (at least 512)."""
        return max(K_MIN_BLOCK, -(-int(nbytes) // K_MIN_BLOCK) * K_MIN_BLOCK)

    @staticmethod
    def segment_size(rounded: int) -> int:
        """The segment a request of ``rounded`` bytes gets when no free block fits."""
        if rounded <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if rounded < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return -(-rounded // K_ROUND_LARGE) * K_ROUND_LARGE

    def malloc(self, nbytes: int) -> tuple[int, int]:
        """Take a block for ``nbytes`` (best fit, else a new segment), split it per the allocator's rule."""
        size = self.round_size(nbytes)
        small = size <= K_SMALL_SIZE
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1, -1))
        if i < len(free):
            bsize, seg, off = free.pop(i)
            del self._free_ends[(seg, off + bsize)]
        else:
            bsize, seg, off = self.segment_size(size), self._next_seg, 0
            self._next_seg += 1
            self.reserved += bsize
        rest = bsize - size
        if (rest >= K_MIN_BLOCK) if small else (rest > K_SMALL_SIZE):
            self._blocks[(seg, off + size)] = (rest, small, True)
            self._free_ends[(seg, off + bsize)] = off + size
            bisect.insort(free, (rest, seg, off + size))
            bsize = size
        self._blocks[(seg, off)] = (bsize, small, False)
        return seg, off

    def free(self, block: tuple[int, int]) -> None:
        """Return ``block``; it merges with a free block right after and right before it in its segment."""
        seg, off = block
        size, small, _ = self._blocks.pop(block)
        nxt = self._blocks.get((seg, off + size))
        if nxt is not None and nxt[2]:
            self._take_free(seg, off + size)
            size += nxt[0]
        prev = self._free_ends.get((seg, off))   # a free block ending where this one starts
        if prev is not None:
            psize = self._blocks[(seg, prev)][0]
            self._take_free(seg, prev)
            off, size = prev, size + psize
        self._blocks[(seg, off)] = (size, small, True)
        self._free_ends[(seg, off + size)] = off
        bisect.insort(self._free[small], (size, seg, off))

    def _take_free(self, seg: int, off: int) -> None:
        size, small, _ = self._blocks.pop((seg, off))
        del self._free_ends[(seg, off + size)]
        free, key = self._free[small], (size, seg, off)
        del free[bisect.bisect_left(free, key)]  # the list is sorted: a search, not list.remove's scan


class _Trace:
    """Allocations and frees of one forward, replayed into a :class:`PoolModel`."""

    def __init__(self, pool: PoolModel) -> None:
        self.pool = pool

    def a(self, nbytes: int) -> Optional[tuple[int, int]]:
        return self.pool.malloc(nbytes) if nbytes > 0 else None

    def f(self, *blocks: Optional[tuple[int, int]]) -> None:
        for b in blocks:
            if b is not None:
                self.pool.free(b)


ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}


def _rope(tr: _Trace, t: int, heads: int, d: int, elem: int) -> Optional[tuple[int, int]]:
    """``rope_neox`` of x [t, heads, d] in the model dtype (``elem`` bytes): its float32 temporaries, its output."""
    half = d // 2
    a = tr.a(half * 4)                           # arange
    b = tr.a(half * 4); tr.f(a)                  # negated
    c = tr.a(half * 4); tr.f(b)                  # / d
    inv = tr.a(half * 4); tr.f(c)                # theta ** …
    pf = tr.a(t * 4)                             # positions in float32
    ang = tr.a(t * half * 4); tr.f(pf)
    cos, sin = tr.a(t * half * 4), tr.a(t * half * 4)
    n = t * heads * half * 4
    x1, x2 = (tr.a(n), tr.a(n)) if elem != 4 else (None, None)  # .float() of a float32 tensor is itself
    p, q = tr.a(n), tr.a(n); r1 = tr.a(n); tr.f(p, q)
    p, q = tr.a(n), tr.a(n); r2 = tr.a(n); tr.f(p, q)
    cat = tr.a(2 * n); tr.f(r1, r2)
    out = cat
    if elem != 4:
        out = tr.a(t * heads * d * elem); tr.f(cat)
    tr.f(inv, ang, cos, sin, x1, x2)
    return out


def _rms(tr: _Trace, t: int, width: int, in_elem: int, out_elem: int) -> Optional[tuple[int, int]]:
    """``_rms(x).to(dtype)`` of x [t, width] (``in_elem`` bytes) → the normed tensor (``out_elem`` bytes)."""
    xf = tr.a(t * width * 4) if in_elem != 4 else None
    p = tr.a(t * width * 4)
    m = tr.a(t * 4); tr.f(p)
    s = tr.a(t * 4); tr.f(m)
    r = tr.a(t * 4); tr.f(s)
    y = tr.a(t * width * 4); tr.f(r)
    if in_elem != 4:  # _rms casts back to the input's dtype
        yy = tr.a(t * width * in_elem); tr.f(y); y = yy
    tr.f(xf)
    if out_elem != in_elem:
        z = tr.a(t * width * out_elem); tr.f(y); y = z
    return y


def _kv_write(tr: _Trace, t: int, heads: int, d: int, elem: int, kv_elem: int, fp8: bool) -> None:
    """The pool's ``set_kv_buffer`` of one of K/V [t, heads, d]: nothing for the same dtype, fp8 quantization's
    float32 copies otherwise (``quantize_kv``; scales are 1.0 in the runner)."""
    if fp8:
        y = tr.a(t * heads * d * 4) if elem != 4 else None
        c = tr.a(t * heads * d * 4); tr.f(y)
        q = tr.a(t * heads * d * kv_elem); tr.f(c)
        tr.f(q)
    elif kv_elem != elem:
        q = tr.a(t * heads * d * kv_elem); tr.f(q)


def _qk(tr: _Trace, spec: ModelSpec, k: LayerKind, t: int, elem: int) -> list[Optional[tuple[int, int]]]:
    """A layer's q and k from its normed input, as ``AttentionStack._qkv`` makes them for ``t`` tokens: the QKV
    projection and RoPE, or for absorbed MLA the q projection, the absorbed query, the latent, its norm and RoPE.
    Returns what stays alive until the next layer reassigns it: q, k and the projection (MLA: the normed latent)."""
    if k.is_mla:
        m = spec.mla
        qp = tr.a(t * k.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) * elem)
        q_abs = tr.a(t * k.num_heads * m.kv_lora_rank * elem)
        lat = tr.a(t * (m.kv_lora_rank + m.qk_rope_head_dim) * elem)
        c = _rms(tr, t, m.kv_lora_rank, elem, elem)
        k_rope = _rope(tr, t, 1, m.qk_rope_head_dim, elem)
        q_r = _rope(tr, t, k.num_heads, m.qk_rope_head_dim, elem)
        q = tr.a(t * k.num_heads * k.head_dim_qk * elem); tr.f(q_r)
        kk = tr.a(t * k.head_dim_qk * elem)
        tr.f(qp, q_abs, lat, k_rope)
        return [q, kk, c]
    qkv = tr.a(t * (k.num_heads + 2 * k.num_kv_heads) * k.head_dim_qk * elem)
    q = _rope(tr, t, k.num_heads, k.head_dim_qk, elem)
    kk = _rope(tr, t, k.num_kv_heads, k.head_dim_qk, elem)
    return [q, kk, qkv]


def _decode_trace(tr: _Trace, spec: ModelSpec, kinds: dict[int, LayerKind], t: int, elem: int, kv_dtype: str,
                  entry: registry.BackendEntry, aux: Sequence[int]) -> list[Optional[tuple[int, int]]]:
    """``AttentionStack.forward`` for ``t`` decode tokens; returns the blocks the graph keeps (its outputs)."""
    hd, kv_elem, fp8 = spec.hidden_size, ELEM_BYTES.get(kv_dtype, elem), kv_dtype.startswith("fp8")
    h = tr.a(t * hd * 4) if elem != 4 else None  # hidden.float()
    kept: list[Optional[tuple[int, int]]] = []
    prev: list[Optional[tuple[int, int]]] = []  # last layer's q, k, qkv / o buffers, alive until reassigned
    prev_o: list[Optional[tuple[int, int]]] = []
    for lid in sorted(kinds):
        k = kinds[lid]
        if lid in aux:
            kept.append(h)
        x = _rms(tr, t, hd, 4, elem)
        new = _qk(tr, spec, k, t, elem)
        tr.f(x)
        tr.f(*prev)
        prev = new
        _kv_write(tr, t, k.num_kv_heads, k.head_dim_qk, elem, kv_elem, fp8)
        if not k.is_mla:
            _kv_write(tr, t, k.num_kv_heads, k.head_dim_v, elem, kv_elem, fp8)
        out, tmp = None, []
        for nbytes, is_out in entry.graph_decode_allocs(k, t, elem):
            b = tr.a(nbytes)
            if is_out:
                out = b
            else:
                tmp.append(b)
        tr.f(*tmp)
        tr.f(*prev_o)  # `o = backend.forward(...)` drops the last layer's o
        prev_o = [out]
        if k.is_mla:
            up = tr.a(t * k.num_heads * spec.mla.v_head_dim * elem)  # einsum with W_UV, then o = it
            tr.f(out)
            prev_o = [up]
            flat = tr.a(t * k.num_heads * spec.mla.v_head_dim * elem)  # reshape of the permuted einsum output
        else:
            flat = None  # o.reshape of the backend's contiguous output is a view
        mm = tr.a(t * hd * elem); tr.f(flat)   # o_proj
        mf = tr.a(t * hd * 4) if elem != 4 else None
        if mf is not None:
            tr.f(mm)
        hn = tr.a(t * hd * 4); tr.f(mf if mf is not None else mm)  # h + o_proj.float()
        if h is not None and h not in kept:
            tr.f(h)
        h = hn
    tr.f(*prev, *prev_o)
    return kept + [h]

