"""Flash-decoding over sglang's paged KV cache, in two kernels (docs/internals.md)."""

import triton
import triton.language as tl


@triton.jit
def _split_bounds(seq_len, window, chunk, max_splits, SPLIT_MIN: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr):
    """(kv_start, n_splits, split_len) of one request: visible keys are [kv_start, seq_len)."""
    kv_start = seq_len * 0
    if USE_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    if USE_CHUNK:
        kv_start = tl.maximum(kv_start, ((seq_len - 1) // chunk) * chunk)
    kv_len = seq_len - kv_start
    n_splits = tl.minimum(tl.maximum(tl.cdiv(kv_len, SPLIT_MIN), 1), max_splits)
    split_len = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
    return kv_start, n_splits, split_len


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), with tanh written through exp2 (no libdevice dependency)."""
    x = s / cap
    e = tl.exp2(x * (2.0 * 1.4426950408889634))
    return cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def _scale(ptr, value, FROM_PTR: tl.constexpr):
    """A dequantisation scale: ``value`` (fp32 argument) or, with FROM_PTR, the fp32 at ``ptr``."""
    if FROM_PTR:
        return tl.load(ptr).to(tl.float32)
    return value


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """tl.dot; with UPCAST the operands go to fp32 first (Triton's CPU interpreter mis-multiplies bf16)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def decode_split_kernel(
    Q, K, V, ReqToToken, ReqIdx, SeqLens, OPart, LsePart, KScale, VScale,
    sm_scale, k_scale, v_scale, softcap, window, chunk, G, HKV, max_splits,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, USE_CHUNK: tl.constexpr,
    K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
):
    """Stage 1: partial attention of one (request, kv head, key range) for its G query heads; K/V upcast to q's dtype,
    scores scaled by ``sm_scale * k_scale``, output by ``v_scale``."""
    pid = tl.program_id(0)   # b * HKV + kvh: a request's kv heads run side by side (docs/internals.md)
    b = pid // HKV
    kvh = pid % HKV
    s = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    kv_start, n_splits, split_len = _split_bounds(seq_len, window, chunk, max_splits, SPLIT_MIN, BLOCK_N,
                                                  USE_WINDOW, USE_CHUNK)
    if s >= n_splits:
        return
    lo = kv_start + s * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    req = tl.load(ReqIdx + b).to(tl.int64)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    score_scale = sm_scale * _scale(KScale, k_scale, K_SCALE_PTR)   # real score = stored q.k * k_scale
    qk_scale = score_scale * 1.4426950408889634

    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_DV], dtype=tl.float32)
    r2t = ReqToToken + req * stride_r2t
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        slot = tl.load(r2t + pos, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=n_mask[:, None] & (offs_d[None, :] < D), other=0.0).to(q.dtype)
        qk = _dot(q, tl.trans(k), UPCAST)
        if USE_SOFTCAP:
            qk = _softcap(qk * score_scale, softcap) * 1.4426950408889634
        else:
            qk = qk * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                    mask=n_mask[:, None] & (offs_dv[None, :] < DV), other=0.0).to(q.dtype)
        # p = hi + lo in v's dtype: two MMAs keep P's 16-bit rounding out of the result (free when memory-bound).
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = acc * alpha[:, None] + _dot(p_hi, v, UPCAST) + _dot(p_lo, v, UPCAST)
        m_i = m_new

    out = acc / tl.maximum(l_i, 1e-30)[:, None] * _scale(VScale, v_scale, V_SCALE_PTR)
    lse = m_i + tl.log2(l_i)
    o_ptr = OPart + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_dv[None, :]
    tl.store(o_ptr, out, mask=g_mask[:, None] & (offs_dv[None, :] < DV))
    tl.store(LsePart + b * stride_lb + heads * stride_lh + s, lse, mask=g_mask)


@triton.jit
def decode_merge_kernel(
    OPart, LsePart, SeqLens, Sinks, Out,
    window, chunk, max_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_MIN: tl.constexpr, USE_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, USE_CHUNK: tl.constexpr,
):
    """Stage 2: LSE-weighted merge of one (request, q head)'s partials (+ sink term)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    kv_start, n_splits, split_len = _split_bounds(seq_len, window, chunk, max_splits, SPLIT_MIN, BLOCK_N,
                                                  USE_WINDOW, USE_CHUNK)
    offs_s = tl.arange(0, S_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < n_splits
    lse = tl.load(LsePart + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    w = tl.where(s_mask, w, 0.0)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    o = tl.load(OPart + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_dv[None, :],
                mask=s_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0) / denom
    tl.store(Out + b * stride_outb + h * stride_outh + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < DV)
