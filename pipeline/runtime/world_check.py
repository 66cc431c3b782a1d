"""World check: the TP ranks of a pipeline stage together compute the whole model's attention.

Every rank draws the same whole-model q/k/v (all heads; seeded by the stage), keeps its own heads (its query heads,
and its kv heads as sglang's ``QKVParallelLinear`` places them: divided, or one replicated head), runs its built
backend on one extend batch of the stage's first attention layer, and the outputs are gathered over the process group
(gloo on CPU). Concatenated in attention-TP rank order they must equal a float64 reference over all heads
(:func:`pipeline.runtime.reference.reference_attention`) within the verification tolerance.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pipeline.backends.base import AttentionLayer
from pipeline.backends.memory import (KVPool, PageAllocator, ReqToTokenPool, dequantize_kv, layer_kv_scales,
                                      make_forward_batch, quantize_kv, torch_dtype)
from pipeline.core.contracts import ForwardMode, SetupRequest
from pipeline.core.shard import layout_of
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.core.dtypes import norm_dtype
from pipeline.runtime.verify import VerifyResult, tolerance

NEW_TOKENS = (5, 3)  # two requests, no cached prefix: an extend batch


def _all_gather(payload: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, payload, group=group)
    return out


def _whole_inputs(k: Any, lay: Any, qdt: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Whole-model q [n, H, D], k/v [n, Hkv, D/Dv] (MLA: one latent head, v its first Dv dims) and sinks [H] or
    None: the same draw on every TP rank of a stage."""
    gen = torch.Generator().manual_seed(seed * 1009 + lay.pp_rank)
    n, whole_kv = sum(NEW_TOKENS), 1 if k.is_mla else lay.total_kv_heads
    q = torch.randn(n, lay.total_heads, k.head_dim_qk, generator=gen).to(qdt)
    kk = torch.randn(n, whole_kv, k.head_dim_qk, generator=gen).to(qdt)
    vv = kk[..., :k.head_dim_v].clone() if k.is_mla else torch.randn(n, whole_kv, k.head_dim_v, generator=gen).to(qdt)
    sinks = (torch.randn(lay.total_heads, generator=gen) + 2.0) if k.has_sinks else None
    return q, kk, vv, sinks


def _run_shard(backend: Any, k: Any, lay: Any, inputs: tuple, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
               dev: torch.device, seed: int) -> torch.Tensor:
    """This rank's heads of ``inputs`` through ``backend`` (one extend batch, rows 0-1, zeroed after): [n, h, Dv]."""
    q, kk, vv, sinks = inputs
    kv0 = 0 if k.is_mla else lay.kv_head_start
    hs, ks = slice(lay.head_start, lay.head_start + k.num_heads), slice(kv0, kv0 + k.num_kv_heads)
    layer = AttentionLayer(layer_id=k.layer_ids[0], num_heads=k.num_heads, num_kv_heads=k.num_kv_heads,
                           head_dim=k.head_dim_qk, v_head_dim=k.head_dim_v, scaling=k.scaling,
                           sliding_window=k.sliding_window, logit_softcap=k.logit_softcap,
                           sinks=None if sinks is None else sinks[hs].to(dev), is_mla=k.is_mla,
                           attention_chunk_size=k.attention_chunk_size)
    rows = list(range(len(NEW_TOKENS)))
    alloc = PageAllocator(req_to_token_pool, kv_pool.size, kv_pool.page_size, seed=seed)
    try:
        fb = make_forward_batch(ForwardMode.EXTEND, rows, list(NEW_TOKENS), alloc, kv_pool)
        backend.init_forward_metadata(fb)
        out = backend.forward(q[:, hs].contiguous().to(dev), kk[:, ks].contiguous().to(dev),
                              vv[:, ks].contiguous().to(dev), layer, fb, save_kv_cache=True)
    finally:
        for r in rows:
            alloc.free(r)
            req_to_token_pool.req_to_token[r].zero_()
    return out.reshape(q.shape[0], k.num_heads, k.head_dim_v).float().cpu()


def _worst_error(whole: torch.Tensor, k: Any, inputs: tuple, kv_pool: KVPool) -> float:
    """max rel err of the gathered [n, H, Dv] against float64 attention over the stored (kv-dtype) K/V."""
    q, kk, vv, sinks = inputs
    kscale, vscale = layer_kv_scales(kv_pool, k.layer_ids[0])
    k64 = dequantize_kv(quantize_kv(kk, kv_pool.dtype, kscale), kscale, torch.float64)
    v64 = dequantize_kv(quantize_kv(vv, kv_pool.dtype, vscale), vscale, torch.float64)
    worst, start = 0.0, 0
    for m in NEW_TOKENS:
        sl = slice(start, start + m)
        ref = reference_attention(q[sl], k64[sl], v64[sl], q_positions=torch.arange(m), scale=k.scaling,
                                  window=k.sliding_window, softcap=k.logit_softcap, sinks=sinks,
                                  chunk=k.attention_chunk_size)
        err = rel_err(whole[sl], ref)
        worst = max(worst, err) if err == err else float("inf")
        start += m
    return worst


def world_check(backend: Any, request: SetupRequest, *, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool,
                torch_device: str, dtype: Any, name: str = "", group: Any = None, seed: int = 0,
                gather: Optional[Callable[[Any, Any], list[Any]]] = None) -> Optional[VerifyResult]:
    """Run this rank's share of the world check and compare the gathered stage with the whole model.

    ``backend``: the rank's built backend over ``kv_pool`` / ``req_to_token_pool`` (rows 0-1 used, zeroed after);
    ``dtype``: q/k/v dtype; ``group``: the process group to gather over (every rank of the launch calls this);
    ``gather``: ``(payload, group) -> [payload of every rank]`` (default ``torch.distributed.all_gather_object``).
    Returns a :class:`VerifyResult` with role ``world.tp`` (``max_rel_err`` of the whole stage's output, all heads),
    None when the stage has no attention layer. Raises what the backend raises, and RuntimeError when the gathered
    ranks do not make up the stage's attention-TP ranks."""
    served, lay = request.served_model, layout_of(request)
    kinds = served.layer_kinds()
    if not kinds:
        return None
    k = kinds[0]
    qdt = dtype if isinstance(dtype, torch.dtype) else torch_dtype(norm_dtype(str(dtype)))
    inputs = _whole_inputs(k, lay, qdt, seed)
    mine = _run_shard(backend, k, lay, inputs, kv_pool, req_to_token_pool, torch.device(torch_device), seed)
    dp_group = lay.tp_rank // lay.attn_tp_size
    got = (gather or _all_gather)((lay.pp_rank, dp_group, lay.attn_tp_rank, mine), group)
    parts = sorted((r, t) for p, d, r, t in got if (p, d) == (lay.pp_rank, dp_group))
    if [r for r, _ in parts] != list(range(lay.attn_tp_size)):
        raise RuntimeError(f"world check gathered attention-TP ranks {[r for r, _ in parts]} for stage {lay.pp_rank}, "
                           f"expected 0..{lay.attn_tp_size - 1}")
    worst = _worst_error(torch.cat([t for _, t in parts], dim=1), k, inputs, kv_pool)
    tol = tolerance(dtype, kv_pool.dtype)
    return VerifyResult(role="world.tp", backend=name, max_rel_err=worst, passed=worst <= tol, tol=tol,
                        detail=f"stage {lay.pp_rank}: {lay.attn_tp_size} TP ranks x {k.num_heads} heads gathered = "
                               f"{lay.total_heads} heads of {k.kind} layer {lay.layer_range[0] + k.layer_ids[0]} vs "
                               f"float64 of the whole model")
