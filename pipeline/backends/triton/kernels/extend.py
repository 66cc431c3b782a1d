"""Extend (prefill with a cached prefix) over sglang's paged KV cache (docs/internals.md)."""

from __future__ import annotations

import triton
import triton.language as tl

from pipeline.backends.triton.kernels.decode import _dot, _scale, _softcap


@triton.jit
def _load_rows(base, rows, stride, offs, n_mask, WIDTH: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr):
    """[BLOCK_N, BLOCK] rows of ``base`` (row ``rows[i]``, stride ``stride``); masked only where it must be."""
    ptrs = base + rows[:, None] * stride + offs[None, :]
    if MASK:
        if WIDTH == BLOCK:
            return tl.load(ptrs, mask=n_mask[:, None], other=0.0)
        return tl.load(ptrs, mask=n_mask[:, None] & (offs[None, :] < WIDTH), other=0.0)
    if WIDTH == BLOCK:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs[None, :] < WIDTH, other=0.0)


@triton.jit
def _scores(q, k, score_scale, softcap, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr):
    """``(qk, c)``: raw (or softcapped) scores of ``q`` against the key tile and the factor to log2 units; the scale is
    fused into the exponent's ``qk * c - m`` (one FMA per score)."""
    qk = _dot(q, tl.trans(k), UPCAST)
    c = score_scale * 1.4426950408889634
    if USE_SOFTCAP:
        qk = _softcap(qk * score_scale, softcap)
        c = score_scale * 0.0 + 1.4426950408889634
    return qk, c


@triton.jit
def _visible(qk, idx, n_mask, pos0, q_pos, window, chunk, trow, kpos, USE_WINDOW: tl.constexpr,
             USE_CHUNK: tl.constexpr, TREE: tl.constexpr):
    """``qk`` with the keys a row may not see set to -inf: past the phase's keys, causal, window, chunk. ``TREE``
    (target verify's new tokens): key ``idx`` sits at position ``kpos[idx]`` and a row sees it only where its tree
    mask row (``trow``: a pointer per row to its ``[n]`` bytes) has it — the row's ancestors and itself."""
    if TREE:
        kp = tl.load(kpos + idx, mask=n_mask, other=0).to(tl.int32)
        bit = tl.load(trow[:, None] + idx[None, :], mask=n_mask[None, :], other=0)
        vis = n_mask[None, :] & (bit != 0) & (kp[None, :] <= q_pos[:, None])
    else:
        kp = pos0 + idx
        vis = n_mask[None, :] & (kp[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        vis = vis & ((q_pos[:, None] - kp[None, :]) < window)
    if USE_CHUNK:
        vis = vis & ((q_pos[:, None] // chunk) == (kp[None, :] // chunk))
    return tl.where(vis, qk, float("-inf"))


@triton.jit
def _online(acc, l_i, m_i, qk, c, q, Vb, rows, stride_v, offs_dv, n_mask, DV: tl.constexpr,
            BLOCK_DV: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step: new row max and sum from the tile's scores ``qk * c``, the V tile loaded and
    ``P V`` accumulated inside the dot (fp32 accumulator). Returns ``(acc, l_i, m_i)``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * c)   # c > 0: the row max of qk * c
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * c - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(Vb, rows, stride_v, offs_dv, n_mask, DV, BLOCK_DV, MASK).to(q.dtype)
    acc = acc * alpha[:, None]
    if UPCAST:
        acc += _dot(p.to(v.dtype), v, UPCAST)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, hi, n_keys, pos0,
            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr, USE_WINDOW: tl.constexpr,
            USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr):
    """Online softmax over key tiles ``[lo, hi)`` (step ``BLOCK_N``) of one phase's keys ``0 … n_keys-1``. Key ``i``
    sits at ``pos0 + i``, row ``R2T[i]`` (``PAGED`` prefix) or ``i`` (new tokens). Without ``MASK`` every key is visible
    to every row (caller proved it). ``PAGED`` loads ``req_to_token`` rows one tile ahead so K/V gathers pipeline
    (benchmarks/NOTES.md); keys at or past ``hi`` get row 0 and are masked."""
    nxt = (offs_n * 0).to(tl.int64)
    if PAGED:
        nxt = tl.load(R2T + lo + offs_n, mask=(lo + offs_n) < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        idx = start + offs_n
        n_mask = idx < n_keys
        if PAGED:
            rows = nxt
            nxt = tl.load(R2T + idx + BLOCK_N, mask=(idx + BLOCK_N) < hi, other=0).to(tl.int64)
        else:
            rows = idx.to(tl.int64)
        k = _load_rows(Kb, rows, stride_k, offs_d, n_mask, D, BLOCK_D, MASK).to(q.dtype)
        qk, c = _scores(q, k, score_scale, softcap, USE_SOFTCAP, UPCAST)
        if MASK:
            qk = _visible(qk, idx, n_mask, pos0, q_pos, window, chunk, trow, kpos, USE_WINDOW, USE_CHUNK, TREE)
        acc, l_i, m_i = _online(acc, l_i, m_i, qk, c, q, Vb, rows, stride_v, offs_dv, n_mask, DV, BLOCK_DV, MASK,
                                UPCAST)
    return acc, l_i, m_i


@triton.jit
def _attend_cut(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, b, c, hi, n_keys, pos0,
                score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr, USE_WINDOW: tl.constexpr,
                USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr):
    """:func:`_attend` over ``[lo, hi)`` in one loop, tiles outside ``[b, c)`` masked behind a runtime branch. Loads are
    never masked: keys past the end read the last real row (no NaN enters ``P V``) and the scores mask them."""
    nxt = (offs_n * 0).to(tl.int64)
    safe = nxt
    if PAGED:   # the range's last row, for keys past hi; the index loads stay contiguous (vectorised)
        safe = tl.load(R2T + tl.maximum(hi - 1, 0) + offs_n * 0).to(tl.int64)
        ok = (lo + offs_n) < hi
        nxt = tl.where(ok, tl.load(R2T + lo + offs_n, mask=ok, other=0).to(tl.int64), safe)
    for start in range(lo, hi, BLOCK_N):
        idx = start + offs_n
        n_mask = idx < n_keys
        if PAGED:
            rows = nxt
            ok = (idx + BLOCK_N) < hi
            nxt = tl.where(ok, tl.load(R2T + idx + BLOCK_N, mask=ok, other=0).to(tl.int64), safe)
        else:
            rows = tl.minimum(idx, n_keys - 1).to(tl.int64)
        k = _load_rows(Kb, rows, stride_k, offs_d, n_mask, D, BLOCK_D, False).to(q.dtype)
        qk, cc = _scores(q, k, score_scale, softcap, USE_SOFTCAP, UPCAST)
        if (start < b) | (start >= c):
            qk = _visible(qk, idx, n_mask, pos0, q_pos, window, chunk, trow, kpos, USE_WINDOW, USE_CHUNK, TREE)
        acc, l_i, m_i = _online(acc, l_i, m_i, qk, cc, q, Vb, rows, stride_v, offs_dv, n_mask, DV, BLOCK_DV, False,
                                UPCAST)
    return acc, l_i, m_i


@triton.jit
def _phase(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, full_lo, full_hi, end, n_keys, pos0,
           score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos,
           D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           BLOCK_N: tl.constexpr, PAGED: tl.constexpr, USE_WINDOW: tl.constexpr,
           USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr):
    """One phase's tiles ``[lo, end)``: masked ``[lo, b)``, unmasked ``[b, c)`` (within ``[full_lo, full_hi)``), masked
    ``[c, end)``; ``lo >= end`` leaves all empty. With a window one loop (:func:`_attend_cut`), else three
    (benchmarks/NOTES.md)."""
    if USE_WINDOW:
        whole = (end // BLOCK_N) * BLOCK_N
        b = tl.maximum(lo, tl.minimum(full_lo, whole))
        c = tl.maximum(b, tl.minimum(full_hi, whole))
        return _attend_cut(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, b, c, end, n_keys, pos0,
                           score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos, D, DV, BLOCK_D,
                           BLOCK_DV, BLOCK_N, PAGED, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST, TREE)
    else:
        return _phase3(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, full_lo, full_hi, end, n_keys,
                       pos0, score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos, D, DV, BLOCK_D,
                       BLOCK_DV, BLOCK_N, PAGED, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST, TREE)


@triton.jit
def _phase3(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, full_lo, full_hi, end, n_keys, pos0,
            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGED: tl.constexpr, USE_WINDOW: tl.constexpr,
            USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr):
    """:func:`_phase` as three loops (see there)."""
    b = tl.maximum(lo, tl.minimum(full_lo, end))
    c = tl.maximum(b, tl.minimum(full_hi, end))
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, b, n_keys, pos0,
                            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos, D, DV, BLOCK_D,
                            BLOCK_DV, BLOCK_N, PAGED, True, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST, TREE)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, b, c, n_keys, pos0,
                            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos, D, DV, BLOCK_D,
                            BLOCK_DV, BLOCK_N, PAGED, False, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST, TREE)
    return _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, c, end, n_keys, pos0,
                   score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, trow, kpos, D, DV, BLOCK_D, BLOCK_DV,
                   BLOCK_N, PAGED, True, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST, TREE)


@triton.jit
def extend_kernel(
    Q, KNew, VNew, KBuf, VBuf, ReqToToken, ReqIdx, QoIndptr, PrefixLens, Sinks, Out, KScale, VScale,
    TreeMask, TreeIndptr, Positions,
    sm_scale, k_scale, v_scale, softcap, window, chunk, G,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_r2t, stride_ot, stride_oh,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, USE_CHUNK: tl.constexpr, K_SCALE_PTR: tl.constexpr, V_SCALE_PTR: tl.constexpr,
    PACK_GQA: tl.constexpr, USE_TREE: tl.constexpr,
):
    """One block of query rows of one request: prefix phase, then causal phase.

    Grid ``(H or Hkv, B, num_blocks)``; block ``mb = num_blocks - 1 - program_id(2)`` (longest first). ``PACK_GQA``:
    program ``(kvh, b, ·)`` owns ``BLOCK_M`` token-major (token, head) rows of kv head ``kvh``'s ``G`` q heads (row
    ``r`` = token ``r // G``, head ``kvh * G + r % G``, as FlashInfer), else new tokens ``mb * BLOCK_M …`` of q head
    ``h``.

    ``USE_TREE`` (target verify, sglang's custom mask): ``TreeMask[TreeIndptr[b] + i * n + j]`` (uint8) says token ``i``
    sees ``j``; ``Positions`` [T] (``prefix + depth``) for windows and chunks; the prefix is seen whole.
    """
    pid0 = tl.program_id(0)
    b = tl.program_id(1)
    mb = tl.num_programs(2) - 1 - tl.program_id(2)
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
    rows = (q_start + tok).to(tl.int64)
    trow = TreeMask   # unused unless USE_TREE
    kpos = Positions + q_start.to(tl.int64)
    if USE_TREE:
        q_pos = tl.load(Positions + rows, mask=m_mask, other=0).to(tl.int32)
        trow = TreeMask + tl.load(TreeIndptr + b).to(tl.int64) + (tl.minimum(tok, ext_len - 1) * ext_len).to(tl.int64)
    else:
        q_pos = prefix + tok
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    score_scale = sm_scale * _scale(KScale, k_scale, K_SCALE_PTR)   # real score = stored q.k * k_scale

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Tiles every row sees: with a window, keys after (last query - window); with chunks, none are proven.
    last_pos = prefix + tok_end - 1
    full_from = prefix * 0     # phase 1 (absolute positions)
    full_from2 = prefix * 0    # phase 2 (new-token index)
    if USE_WINDOW:
        full_from = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_from2 = tl.cdiv(tl.maximum(tok_end - window, 0), BLOCK_N) * BLOCK_N

    # Phase 1: cached prefix via req_to_token, from the first key the block's first token sees (trees: the root's
    # position).
    first_pos = prefix + tok_first
    if USE_TREE:
        first_pos = prefix
    lo = prefix * 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if USE_CHUNK:
        lo = tl.maximum(lo, (first_pos // chunk) * chunk)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_end = (prefix // BLOCK_N) * BLOCK_N
    if USE_CHUNK:
        full_end = lo
    r2t = ReqToToken + req * stride_r2t
    acc, l_i, m_i = _phase(acc, l_i, m_i, q, q_pos, KBuf + kvh * stride_kh, VBuf + kvh * stride_vh, r2t, stride_kt,
                           stride_vt, lo, full_from, full_end, prefix, prefix, 0, score_scale, softcap, window, chunk,
                           offs_n, offs_d, offs_dv, trow, kpos, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, USE_WINDOW,
                           USE_SOFTCAP, USE_CHUNK, UPCAST, False)

    # Phase 2: the new tokens, causally; tiles before the block's first token are fully visible, diagonal ones masked
    # (trees: every tile from the first masked).
    lo2 = prefix * 0
    if USE_TREE:
        full_end2 = lo2
    else:
        if USE_WINDOW:
            lo2 = tl.maximum(tok_first - window + 1, 0)
        if USE_CHUNK:
            lo2 = tl.maximum(lo2, ((prefix + tok_first) // chunk) * chunk - prefix)
        lo2 = (lo2 // BLOCK_N) * BLOCK_N
        full_end2 = ((tok_first + 1) // BLOCK_N) * BLOCK_N
        if USE_CHUNK:
            full_end2 = lo2
    kn = KNew + q_start.to(tl.int64) * stride_knt + kvh * stride_knh
    vn = VNew + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh
    acc, l_i, m_i = _phase(acc, l_i, m_i, q, q_pos, kn, vn, r2t, stride_knt, stride_vnt, lo2, full_from2, full_end2,
                           tok_end, ext_len, prefix, score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv,
                           trow, kpos, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, USE_WINDOW, USE_SOFTCAP, USE_CHUNK,
                           UPCAST, USE_TREE)

    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        l_i += tl.exp2(sink - m_i)
    out = acc / l_i[:, None] * _scale(VScale, v_scale, V_SCALE_PTR)
    tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))

