"""Extend (prefill with a cached prefix) over sglang's paged KV cache.

Grid ``(H, cdiv(max_extend_len, BLOCK_M), B)``: program ``(h, mb, b)`` owns ``BLOCK_M`` new tokens
of request ``b`` and query head ``h``. Head index varies fastest, so the ``G`` query heads of one kv
group run side by side and read the same K/V tiles from L2. With ``PACK_GQA`` the grid is ``(Hkv,
cdiv(max_extend_len * G, BLOCK_M), B)`` and a program's rows are (token, head) pairs of one kv group
(token-major), so a K/V tile is loaded into shared memory once for all ``G`` heads.

Phase 1 attends to the cached prefix ``[0, prefix_len)``, gathered through ``req_to_token`` from
the pool (any page size). Phase 2 attends to the new tokens themselves, read contiguously from the
``k``/``v`` tensors of this step (rows ``qo_indptr[b] …``), causally: new token ``i`` sees new
token ``j`` when ``j <= i``. With a sliding window, key position ``kp`` is visible from query
position ``qp`` when ``qp - kp < window``; phase 1 skips tiles wholly outside the window. With
chunked local attention (Llama-4) it is visible when ``kp // chunk == qp // chunk``; both phases
start at the chunk of the block's first query.
Sink logits add ``exp(sink)`` to the softmax denominator. Scores use ``exp2`` with the scale
folded in; softcap as in :mod:`.decode`. fp8 KV as in :mod:`.decode`: the pool's K/V and this step's
new K/V are both given in the stored format (fp8, or q's dtype), upcast to q's dtype in registers,
``k_scale`` folded into the score scale, ``v_scale`` applied to the normalised output.
"""

import triton
import triton.language as tl

from pipeline.backends.triton.kernels.decode import _dot, _scale, _softcap


@triton.jit
def _scores(q, k, sm_scale, softcap, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    qk = _dot(q, tl.trans(k), UPCAST)
    if USE_SOFTCAP:
        qk = _softcap(qk * sm_scale, softcap) * 1.4426950408889634
    else:
        qk = qk * (sm_scale * 1.4426950408889634)
    return qk


@triton.jit
def extend_kernel(
    Q, KNew, VNew, KBuf, VBuf, ReqToToken, ReqIdx, QoIndptr, PrefixLens, Sinks, Out, KScale, VScale,
    sm_scale, k_scale, v_scale, softcap, window, chunk, G,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t, stride_ot, stride_oh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, USE_CHUNK: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    PACK_GQA: tl.constexpr,
):
    """One block of query rows of one request: prefix phase, then causal phase.

    Rows: without ``PACK_GQA`` program ``(h, mb, b)`` owns new tokens ``mb * BLOCK_M …`` of q head ``h``;
    with it, program ``(kvh, mb, b)`` owns ``BLOCK_M`` (token, head) rows of kv head ``kvh``'s ``G`` q heads,
    packed token-major (row ``r`` = token ``r // G``, head ``kvh * G + r % G``, as FlashInfer packs
    ``qo_len * group_size`` rows for GQA), so each K/V tile is read once per group instead of ``G`` times.
    """
    pid0 = tl.program_id(0)
    mb = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(QoIndptr + b).to(tl.int32)
    ext_len = tl.load(QoIndptr + b + 1).to(tl.int32) - q_start
    offs_r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GQA:
        kvh = pid0
        n_rows = ext_len * G
        tok = offs_r // G
        head = kvh * G + offs_r % G
        tok_first = (mb * BLOCK_M) // G
        tok_end = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G + 1, ext_len)   # one past the block's last token
    else:
        kvh = pid0 // G
        n_rows = ext_len
        tok = offs_r
        head = pid0 + offs_r * 0
        tok_first = mb * BLOCK_M
        tok_end = tl.minimum(ext_len, (mb + 1) * BLOCK_M)
    if mb * BLOCK_M >= n_rows:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    req = tl.load(ReqIdx + b).to(tl.int64)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_r < n_rows
    q_pos = prefix + tok
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    score_scale = sm_scale * _scale(KScale, k_scale, K_SCALE_PTR)   # real score = stored q.k * k_scale

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Phase 1: cached prefix, gathered through req_to_token; from the first key the block's first token sees.
    lo = prefix * 0
    if USE_WINDOW:
        lo = tl.maximum(prefix + tok_first - window + 1, 0)
    if USE_CHUNK:
        lo = tl.maximum(lo, ((prefix + tok_first) // chunk) * chunk)
    lo = (lo // BLOCK_N) * BLOCK_N
    r2t = ReqToToken + req * stride_r2t
    for start in range(lo, prefix, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < prefix
        slot = tl.load(r2t + pos, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(KBuf + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & (offs_d[None, :] < D), other=0.0).to(q.dtype)
        qk = _scores(q, k, score_scale, softcap, USE_SOFTCAP, UPCAST)
        vis = n_mask[None, :]
        if USE_WINDOW:
            vis = vis & ((q_pos[:, None] - pos[None, :]) < window)
        if USE_CHUNK:
            vis = vis & ((q_pos[:, None] // chunk) == (pos[None, :] // chunk))
        qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VBuf + slot[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    # Phase 2: the new tokens themselves, causally, read from this step's k/v.
    lo2 = prefix * 0
    if USE_WINDOW:
        lo2 = tl.maximum(tok_first - window + 1, 0)
    if USE_CHUNK:
        lo2 = tl.maximum(lo2, ((prefix + tok_first) // chunk) * chunk - prefix)
    lo2 = (lo2 // BLOCK_N) * BLOCK_N
    for start in range(lo2, tok_end, BLOCK_N):
        n_idx = start + offs_n
        n_mask = n_idx < ext_len
        krow = (q_start + n_idx).to(tl.int64)
        k = tl.load(KNew + krow[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :],
                    mask=n_mask[:, None] & (offs_d[None, :] < D), other=0.0).to(q.dtype)
        qk = _scores(q, k, score_scale, softcap, USE_SOFTCAP, UPCAST)
        vis = n_mask[None, :] & (n_idx[None, :] <= tok[:, None])
        if USE_WINDOW:
            vis = vis & ((tok[:, None] - n_idx[None, :]) < window)
        if USE_CHUNK:
            vis = vis & ((q_pos[:, None] // chunk) == ((prefix + n_idx)[None, :] // chunk))
        qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VNew + krow[:, None] * stride_vnt + kvh * stride_vnh + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        l_i += tl.exp2(sink - m_i)
    out = acc / l_i[:, None] * _scale(VScale, v_scale, V_SCALE_PTR)
    tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))
