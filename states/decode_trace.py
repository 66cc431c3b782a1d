"""The decode forward's allocations, tensor by tensor, for the CUDA-graph memory estimate (:mod:`states.graph_memory`).

:func:`_decode_trace` replays what :meth:`pipeline.runtime.model.AttentionStack.forward` allocates and frees for one
decode token per request, in order, through a :class:`~states.cuda_allocator._Trace` over a model of PyTorch's
caching allocator: the float32 residual stream, the normed input in the model dtype, the QKV projection and RoPE's
float32 temporaries (:func:`_qk`, :func:`_rope`, :func:`_rms`), the KV write (fp8 quantization's float32 copies,
:func:`_kv_write`), the decode backend's own allocations (its registry entry's ``graph_decode_allocs``), the output
projection, its float32 copy and the residual add; for absorbed MLA also the absorbed query, the latent, its norm
and the up-projection. Torch-free.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pipeline.backends import registry
from pipeline.core.contracts import LayerKind, ModelSpec
from states.cuda_allocator import _Trace

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
