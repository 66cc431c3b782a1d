"""Absorbed-MLA extend over the paged latent cache, in Triton (the decode kernels and the shared tiles: :mod:`.mla`).

:func:`mla_extend_kernel`, grid ``(cdiv(max_extend_len * H, BLOCK_M), B)``: request ``b``'s new tokens times
heads packed token-major (row ``r`` = token ``r // H``, head ``r % H``, as FlashInfer's MLA scheduler packs
``qo_len * num_heads``); phase 1 attends to the cached prefix gathered through ``req_to_token``, phase 2 to the
step's new latent rows, causally (bottom-right aligned: new token ``i`` sees prefix + new tokens ``0..i``).

Rows are packed into the M dimension of ``tl.dot`` as the decode kernels pack heads, and both phases go through
:func:`~.mla._mla_tile` (one latent tile loaded once, used for scores and values). No validation here: see
``launch_mla.py``.
"""

import triton
import triton.language as tl

from pipeline.backends.triton.kernels.mla import _mla_tile, _round


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
