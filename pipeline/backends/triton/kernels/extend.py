"""Extend (prefill with a cached prefix) over sglang's paged KV cache.

Grid ``(H, B, cdiv(max_extend_len, BLOCK_M))``: program ``(h, b, ·)`` owns ``BLOCK_M`` new tokens
of request ``b`` and query head ``h``, the blocks taken last-first (the longest causal rows start first, the
short ones fill the tail). Head index varies fastest, so the ``G`` query heads of one kv group run side by side
and read the same K/V tiles from L2. With ``PACK_GQA`` the grid is ``(Hkv, B, cdiv(max_extend_len * G,
BLOCK_M))`` and a program's rows are (token, head) pairs of one kv group (token-major), so a K/V tile is loaded
into shared memory once for all ``G`` heads.

Phase 1 attends to the cached prefix ``[0, prefix_len)``, gathered through ``req_to_token`` from
the pool (any page size). Phase 2 attends to the new tokens themselves, read contiguously from the
``k``/``v`` tensors of this step (rows ``qo_indptr[b] …``), causally: new token ``i`` sees new
token ``j`` when ``j <= i``. Each phase is cut into tiles that need a mask (the prefix's ragged end, the
causal diagonal, a window's edge, every tile under chunked attention) and tiles that every row of the block
sees whole, which skip building one (:mod:`.extend_tiles`). With a sliding window, key position ``kp`` is
visible from query position ``qp`` when ``qp - kp < window``; phase 1 skips tiles wholly outside the window. With
chunked local attention (Llama-4) it is visible when ``kp // chunk == qp // chunk``; both phases
start at the chunk of the block's first query.
Sink logits add ``exp(sink)`` to the softmax denominator. Scores use ``exp2`` with the scale
folded in; softcap as in :mod:`.decode`. fp8 KV as in :mod:`.decode`: the pool's K/V and this step's
new K/V are both given in the stored format (fp8, or q's dtype), upcast to q's dtype in registers,
``k_scale`` folded into the score scale, ``v_scale`` applied to the normalised output.
"""

import triton
import triton.language as tl

from pipeline.backends.triton.kernels.decode import _scale
from pipeline.backends.triton.kernels.extend_tiles import _phase


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

    Grid ``(H or Hkv, B, num_blocks)``; block ``mb`` is ``num_blocks - 1 - program_id(2)``, so the blocks with
    the most keys (the last new tokens see the longest causal history) start first and the short ones fill the
    tail. Rows: without ``PACK_GQA`` program ``(h, b, ·)`` owns new tokens ``mb * BLOCK_M …`` of q head ``h``;
    with it, program ``(kvh, b, ·)`` owns ``BLOCK_M`` (token, head) rows of kv head ``kvh``'s ``G`` q heads,
    packed token-major (row ``r`` = token ``r // G``, head ``kvh * G + r % G``, as FlashInfer packs
    ``qo_len * group_size`` rows for GQA), so each K/V tile is read once per group instead of ``G`` times.
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
    q_pos = prefix + tok
    rows = (q_start + tok).to(tl.int64)
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

    # Phase 1: cached prefix, gathered through req_to_token; from the first key the block's first token sees.
    lo = prefix * 0
    if USE_WINDOW:
        lo = tl.maximum(prefix + tok_first - window + 1, 0)
    if USE_CHUNK:
        lo = tl.maximum(lo, ((prefix + tok_first) // chunk) * chunk)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_end = (prefix // BLOCK_N) * BLOCK_N
    if USE_CHUNK:
        full_end = lo
    r2t = ReqToToken + req * stride_r2t
    acc, l_i, m_i = _phase(acc, l_i, m_i, q, q_pos, KBuf + kvh * stride_kh, VBuf + kvh * stride_vh, r2t, stride_kt,
                           stride_vt, lo, full_from, full_end, prefix, prefix, 0, score_scale, softcap, window, chunk,
                           offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, USE_WINDOW, USE_SOFTCAP,
                           USE_CHUNK, UPCAST)

    # Phase 2: the new tokens themselves, causally, read from this step's k/v. Tiles wholly at or before
    # the block's first token are seen by every row (causal); the diagonal tiles are masked.
    lo2 = prefix * 0
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
                           D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST)

    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        l_i += tl.exp2(sink - m_i)
    out = acc / l_i[:, None] * _scale(VScale, v_scale, V_SCALE_PTR)
    tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & (offs_dv[None, :] < DV))
