"""Absorbed-MLA attention over the paged latent cache (DeepSeek-V2/V3, Kimi-K2), in Triton (docs/internals.md)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation; UPCAST (CPU interpreter only) multiplies in fp32 first."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b (fp32 accumulator)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc)
    return tl.dot(a, b, acc=acc)


@triton.jit
def _round(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 -> the model dtype, rounding to nearest even as the GPU does. Triton's CPU interpreter
    (UPCAST) truncates fp32 -> bf16, which biases P and the output by up to 2^-8; round by hand there."""
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _mla_bounds(seq_len, max_splits, SPLIT_MIN: tl.constexpr, BLOCK_N: tl.constexpr):
    """(n_splits, split_len) of one request: split ``s`` covers keys [s * split_len, min(.., seq_len))."""
    n_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, SPLIT_MIN), 1), max_splits)
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    return n_splits, split_len


@triton.jit
def _softmax_step(qk, vis, m_i, l_i, acc, LAZY: tl.constexpr):
    """Online softmax of one tile of scaled log2 scores ``qk`` [M, N]: (p [M, N] fp32, rescaled acc, m, l). ``LAZY``
    raises the max only when a row exceeds it by > 8 (FlashAttention-4's trick; exact, p <= 2^8)."""
    qk = tl.where(vis, qk, float("-inf"))
    m_cand = tl.maximum(m_i, tl.max(qk, 1))
    if LAZY:
        if tl.max(m_cand - m_i, 0) > 8.0:
            alpha = tl.exp2(m_i - m_cand)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_cand
    else:
        alpha = tl.exp2(m_i - m_cand)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_cand
    p = tl.exp2(qk - m_i[:, None])
    return p, acc, m_i, l_i + tl.sum(p, 1)


@triton.jit
def _mla_tile(acc, m_i, l_i, q_lat, q_rope, KV, slot, n_mask, vis, stride_kt, qk_scale,
              DL: tl.constexpr, DR: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
              DETACH: tl.constexpr, LAZY: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile: load latent + rope rows at ``slot`` [BLOCK_N] once, score, online softmax, P @ lat; ``vis`` [M,
    BLOCK_N] marks the counted pairs; ``acc`` [M, BLOCK_L] fp32."""
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    row = KV + slot[:, None] * stride_kt
    lat = tl.load(row + offs_l[None, :], mask=n_mask[:, None] & (offs_l[None, :] < DL), other=0.0)
    rope = tl.load(row + DL + offs_r[None, :], mask=n_mask[:, None] & (offs_r[None, :] < DR), other=0.0)
    # Two scaled dots added: a dot feeding another dot (as its acc=, which Triton makes of a bare add)
    # gets Triton's chained-dot warp layout (see DETACH below).
    qk = _dot(q_lat, tl.trans(lat), UPCAST) * qk_scale + _dot(q_rope, tl.trans(rope), UPCAST) * qk_scale
    if DETACH:
        # Same math in both branches: a region hides P @ lat from the scores dot, so Triton splits keys over warp groups
        # instead of replicating scores (benchmarks/NOTES.md).
        if qk_scale > 0:
            p, acc, m_i, l_i = _softmax_step(qk, vis, m_i, l_i, acc, LAZY)
        else:
            p, acc, m_i, l_i = _softmax_step(qk, vis, m_i, l_i, acc, LAZY)
    else:
        p, acc, m_i, l_i = _softmax_step(qk, vis, m_i, l_i, acc, LAZY)
    acc = _dot_acc(_round(p, lat.dtype, UPCAST), lat, acc, UPCAST)
    return acc, m_i, l_i


@triton.jit
def _prefetch_l2(KV, slot, valid, stride_kt, ROW_LINES: tl.constexpr, LINES_PAD: tl.constexpr,
                 LINE_ELEMS: tl.constexpr, ENABLED: tl.constexpr):
    """Ask L2 for the cache rows ``slot`` [BLOCK_N] (where ``valid``), one ``prefetch.global.L2`` per 128-byte line;
    fire and forget, off under the interpreter."""
    if ENABLED:
        lines = tl.arange(0, LINES_PAD)[None, :]
        want = (valid[:, None] & (lines < ROW_LINES)).to(tl.int32)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                                  "=r,l,r", [(KV + slot[:, None] * stride_kt + lines * LINE_ELEMS).to(tl.int64), want],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mla_decode_split_kernel(
    Q, KV, ReqToToken, ReqIdx, SeqLens, OPart, LsePart, Out,
    sm_scale, H, max_splits,
    stride_qb, stride_qh, stride_kt, stride_r2t,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    DL: tl.constexpr, DR: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr, DIRECT: tl.constexpr,
    DETACH: tl.constexpr, LAZY: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
    ROW_LINES: tl.constexpr, LINES_PAD: tl.constexpr, LINE_ELEMS: tl.constexpr,
):
    """Stage 1: one (head block, key range, request): partial attention of BLOCK_H heads. ``PREFETCH`` asks L2 for the
    rows of the tile two ahead (benchmarks/NOTES.md); results are identical either way."""
    hb = tl.program_id(0)
    s = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    n_splits, split_len = _mla_bounds(seq_len, max_splits, SPLIT_MIN, BLOCK_N)
    if s >= n_splits:
        return
    lo = s * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    req = tl.load(ReqIdx + b).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = Q + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & (offs_l[None, :] < DL), other=0.0)
    q_rope = tl.load(q_row + DL + offs_r[None, :], mask=h_mask[:, None] & (offs_r[None, :] < DR), other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    r2t = ReqToToken + req * stride_r2t
    if PREFETCH:   # the rows of the second tile (the first is copied at once)
        pf_n = tl.arange(0, BLOCK_N)
        pf_pos = lo + BLOCK_N + pf_n
        _prefetch_l2(KV, tl.load(r2t + pf_pos, mask=pf_pos < hi, other=0).to(tl.int64), pf_pos < hi, stride_kt,
                     ROW_LINES, LINES_PAD, LINE_ELEMS, not UPCAST)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        if PREFETCH:   # indices of the tile two ahead, loaded now, used for its L2 prefetch at the end
            pf_pos = start + 2 * BLOCK_N + pf_n
            pf_slot = tl.load(r2t + pf_pos, mask=pf_pos < hi, other=0).to(tl.int64)
        slot = tl.load(r2t + pos, mask=n_mask, other=0).to(tl.int64)
        acc, m_i, l_i = _mla_tile(acc, m_i, l_i, q_lat, q_rope, KV, slot, n_mask, n_mask[None, :], stride_kt,
                                  qk_scale, DL, DR, BLOCK_L, BLOCK_R, DETACH, LAZY, UPCAST)
        if PREFETCH:
            _prefetch_l2(KV, pf_slot, pf_pos < hi, stride_kt, ROW_LINES, LINES_PAD, LINE_ELEMS, not UPCAST)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_mask = h_mask[:, None] & (offs_l[None, :] < DL)
    if DIRECT:
        tl.store(Out + b * stride_outb + heads[:, None] * stride_outh + offs_l[None, :],
                 _round(out, Out.dtype.element_ty, UPCAST), mask=o_mask)
    else:
        # An empty split (its range past the end: l == 0) gets -inf and weighs nothing in the merge.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(OPart + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_l[None, :],
                 _round(out, OPart.dtype.element_ty, UPCAST), mask=o_mask)
        tl.store(LsePart + b * stride_lb + heads * stride_lh + s, lse, mask=h_mask)


@triton.jit
def mla_decode_merge_kernel(
    OPart, LsePart, SeqLens, Out, H, max_splits,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    DL: tl.constexpr, BLOCK_L: tl.constexpr, MERGE_H: tl.constexpr, S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr, UPCAST: tl.constexpr,
):
    """Stage 2: MERGE_H heads of one request: ``sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)``."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * MERGE_H + tl.arange(0, MERGE_H)
    h_mask = heads < H
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    n_splits = tl.minimum(tl.maximum(tl.cdiv(seq_len, SPLIT_MIN), 1), max_splits)   # as _mla_bounds
    offs_s = tl.arange(0, S_PAD)
    offs_l = tl.arange(0, BLOCK_L)
    lse_rows = LsePart + b * stride_lb + heads * stride_lh
    lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=h_mask[:, None] & (offs_s[None, :] < n_splits),
                  other=float("-inf"))
    m = tl.max(lse, 1)
    m = tl.where(h_mask, m, 0.0)
    denom = tl.sum(tl.where(offs_s[None, :] < n_splits, tl.exp2(lse - m[:, None]), 0.0), 1)
    acc = tl.zeros([MERGE_H, BLOCK_L], dtype=tl.float32)
    o_rows = OPart + b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :]
    o_mask = h_mask[:, None] & (offs_l[None, :] < DL)
    for s in range(0, n_splits):
        w = tl.exp2(tl.load(lse_rows + s, mask=h_mask, other=0.0) - m)
        acc += w[:, None] * tl.load(o_rows + s * stride_os, mask=o_mask, other=0.0).to(tl.float32)
    out = _round(acc / tl.where(h_mask, denom, 1.0)[:, None], Out.dtype.element_ty, UPCAST)
    tl.store(Out + b * stride_outb + heads[:, None] * stride_outh + offs_l[None, :], out, mask=o_mask)


@triton.jit
def mla_extend_kernel(
    Q, KVNew, KV, ReqToToken, ReqIdx, QoIndptr, PrefixLens, Out,
    sm_scale, H,
    stride_qt, stride_qh, stride_knt, stride_kt, stride_r2t, stride_ot, stride_oh,
    DL: tl.constexpr, DR: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DETACH: tl.constexpr, LAZY: tl.constexpr, UPCAST: tl.constexpr,
):
    """One block of BLOCK_M packed (new token, head) rows of one request: prefix phase, then causal phase."""
    mb = tl.program_id(0)
    b = tl.program_id(1)
    q_start = tl.load(QoIndptr + b).to(tl.int32)
    ext_len = tl.load(QoIndptr + b + 1).to(tl.int32) - q_start
    if mb * BLOCK_M >= ext_len * H:
        return
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    req = tl.load(ReqIdx + b).to(tl.int64)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < ext_len * H
    tok = rows // H
    head = rows % H
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    q_row = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=r_mask[:, None] & (offs_l[None, :] < DL), other=0.0)
    q_rope = tl.load(q_row + DL + offs_r[None, :], mask=r_mask[:, None] & (offs_r[None, :] < DR), other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)

    # Phase 1: the cached prefix (every row sees all of it), gathered through req_to_token.
    r2t = ReqToToken + req * stride_r2t
    for start in range(0, prefix, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < prefix
        slot = tl.load(r2t + pos, mask=n_mask, other=0).to(tl.int64)
        acc, m_i, l_i = _mla_tile(acc, m_i, l_i, q_lat, q_rope, KV, slot, n_mask, n_mask[None, :], stride_kt,
                                  qk_scale, DL, DR, BLOCK_L, BLOCK_R, DETACH, LAZY, UPCAST)

    # Phase 2: this step's new latent rows, causally (new token j visible from row token i when j <= i).
    last_tok = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // H, ext_len - 1)
    for start in range(0, last_tok + 1, BLOCK_N):
        j = start + offs_n
        n_mask = j <= last_tok
        krow = (q_start + j).to(tl.int64)
        vis = n_mask[None, :] & (j[None, :] <= tok[:, None])
        acc, m_i, l_i = _mla_tile(acc, m_i, l_i, q_lat, q_rope, KVNew, krow, n_mask, vis, stride_knt,
                                  qk_scale, DL, DR, BLOCK_L, BLOCK_R, DETACH, LAZY, UPCAST)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_ptr = Out + (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
    tl.store(o_ptr, _round(out, Out.dtype.element_ty, UPCAST), 
             mask=r_mask[:, None] & (offs_l[None, :] < DL))

