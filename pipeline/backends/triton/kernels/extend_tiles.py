"""The key-tile loops of the extend kernel (:mod:`.extend`): one phase's tiles through the online softmax.

A phase (the cached prefix, or the step's own new tokens) is cut into tiles that need a mask (the prefix's
ragged end, the causal diagonal, a window's edge, every tile under chunked attention) and tiles every row of the
query block sees whole, which skip building one, as FlashAttention-2 masks only its diagonal. :func:`_phase`
picks how the cut runs: three loops (:func:`_attend`, masked / unmasked / masked) or one loop that masks by a
runtime branch per tile (:func:`_attend_cut`). Tiling rationale and measurements: benchmarks/NOTES.md.
"""

import triton
import triton.language as tl

from pipeline.backends.triton.kernels.decode import _dot, _softcap


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
    """``(qk, c)``: the raw (or softcapped) scores of ``q`` against the key tile and the factor that puts them in
    log2 units. The scale is not applied to the whole tile first: it goes into the row max and into ``qk * c -
    m`` of the exponent, one fused multiply-add per score instead of a multiply and a subtract (H200: +1-2 % on
    every extend row; softmax arithmetic, not the MMAs, bounds a 128 x 128 tile at D 128)."""
    qk = _dot(q, tl.trans(k), UPCAST)
    c = score_scale * 1.4426950408889634
    if USE_SOFTCAP:
        qk = _softcap(qk * score_scale, softcap)
        c = score_scale * 0.0 + 1.4426950408889634
    return qk, c


@triton.jit
def _visible(qk, idx, n_mask, pos0, q_pos, window, chunk, USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr):
    """``qk`` with the keys a row may not see set to -inf: past the phase's keys, causal, window, chunk."""
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
            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGED: tl.constexpr, MASK: tl.constexpr, USE_WINDOW: tl.constexpr,
            USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over key tiles ``[lo, hi)`` (step ``BLOCK_N``) of one phase's keys ``0 … n_keys-1``.

    Key ``i`` of the phase sits at position ``pos0 + i``; its row is ``R2T[i]`` (``PAGED``, the cached prefix)
    or ``i`` (this step's new tokens, ``Kb``/``Vb`` already at the request's first row). Without ``MASK`` every
    key of every tile is visible to every row (the caller proved it), so no mask is built and the loads are
    plain.

    ``PAGED``: each tile's ``req_to_token`` rows are loaded one iteration ahead (loop-carried), so the K/V
    gathers of a tile never wait on an index load issued in the same iteration: the software pipeline then
    prefetches K/V as it does for contiguous keys (H200, 64 x 512 new on a 3584 prefix: 344 -> 386 TFLOP/s; the
    same kernel on contiguous slots without any index load reaches 394, benchmarks/NOTES.md). Keys at or past
    ``hi`` get row 0 (only the last range of a phase ends off a tile boundary, at ``n_keys``, where they are
    masked out anyway).
    """
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
            qk = _visible(qk, idx, n_mask, pos0, q_pos, window, chunk, USE_WINDOW, USE_CHUNK)
        acc, l_i, m_i = _online(acc, l_i, m_i, qk, c, q, Vb, rows, stride_v, offs_dv, n_mask, DV, BLOCK_DV, MASK,
                                UPCAST)
    return acc, l_i, m_i


@triton.jit
def _attend_cut(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, b, c, hi, n_keys, pos0,
                score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr, USE_WINDOW: tl.constexpr,
                USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr):
    """:func:`_attend` over ``[lo, hi)`` in ONE loop: a tile outside ``[b, c)`` builds its mask behind a runtime
    branch instead of running in a loop of its own. Loads are never masked: a key at or past ``hi`` (prefix) or
    ``n_keys`` (new tokens) reads the range's last real row instead, so no padding slot or stale row enters the
    ``P V`` dot even with probability 0 (a NaN there would poison it); the scores mask it out (every tile that
    holds one lies at or past ``c``). Each loop of its own fills and drains the software pipeline once; with a
    window's edge tiles that cost more than the branch (H200, 8 x 512 new on a 32256 prefix, window 4096: 881
    -> 732 us, outputs bit-equal; benchmarks/NOTES.md)."""
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
            qk = _visible(qk, idx, n_mask, pos0, q_pos, window, chunk, USE_WINDOW, USE_CHUNK)
        acc, l_i, m_i = _online(acc, l_i, m_i, qk, cc, q, Vb, rows, stride_v, offs_dv, n_mask, DV, BLOCK_DV, False,
                                UPCAST)
    return acc, l_i, m_i


@triton.jit
def _phase(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, full_lo, full_hi, end, n_keys, pos0,
           score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv,
           D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           BLOCK_N: tl.constexpr, PAGED: tl.constexpr, USE_WINDOW: tl.constexpr,
           USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr):
    """One phase's tiles ``[lo, end)`` (``lo`` a multiple of ``BLOCK_N``): masked ``[lo, b)``, unmasked ``[b, c)``
    and masked ``[c, end)``, where ``[full_lo, full_hi)`` (both multiples of ``BLOCK_N``) holds the tiles whose
    every key every row of the block sees. ``lo >= end`` (a window or chunk that starts past the prefix) leaves
    all three empty; ``lo <= b <= c <= end`` otherwise.

    With a window the three ranges run as one loop (:func:`_attend_cut`; the unmasked range stops at ``end``'s
    last whole tile): 17 % faster on the H200. Without one, three loops (:func:`_attend`): one loop for both
    phases was 1 % slower on 64 x 512 new on a 3584 prefix, and one loop for the new tokens only was 4 % slower
    on 8 x 4096 new (benchmarks/NOTES.md)."""
    if USE_WINDOW:
        whole = (end // BLOCK_N) * BLOCK_N
        b = tl.maximum(lo, tl.minimum(full_lo, whole))
        c = tl.maximum(b, tl.minimum(full_hi, whole))
        return _attend_cut(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, b, c, end, n_keys, pos0,
                           score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV,
                           BLOCK_N, PAGED, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST)
    else:
        return _phase3(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, full_lo, full_hi, end, n_keys,
                       pos0, score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV,
                       BLOCK_N, PAGED, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST)


@triton.jit
def _phase3(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, full_lo, full_hi, end, n_keys, pos0,
            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGED: tl.constexpr, USE_WINDOW: tl.constexpr,
            USE_SOFTCAP: tl.constexpr, USE_CHUNK: tl.constexpr, UPCAST: tl.constexpr):
    """:func:`_phase` as three loops (see there)."""
    b = tl.maximum(lo, tl.minimum(full_lo, end))
    c = tl.maximum(b, tl.minimum(full_hi, end))
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, lo, b, n_keys, pos0,
                            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV,
                            BLOCK_N, PAGED, True, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, b, c, n_keys, pos0,
                            score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV,
                            BLOCK_N, PAGED, False, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST)
    return _attend(acc, l_i, m_i, q, q_pos, Kb, Vb, R2T, stride_k, stride_v, c, end, n_keys, pos0,
                   score_scale, softcap, window, chunk, offs_n, offs_d, offs_dv, D, DV, BLOCK_D, BLOCK_DV,
                   BLOCK_N, PAGED, True, USE_WINDOW, USE_SOFTCAP, USE_CHUNK, UPCAST)
