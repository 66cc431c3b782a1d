"""One speculative attention step through a backend — eager or replayed from a CUDA graph — against float64.

:func:`check_verify`: a target verify of random EAGLE trees over cached prefixes; :func:`check_draft`: one draft-decode
step of ``topk`` branches per request. Both fill the pool with random K/V, compare every output row with
:func:`pipeline.runtime.reference.reference_attention` over the stored K/V and time the call with CUDA events; with
``graph=True`` the step is captured once and replayed for a new batch (a stale mask or table shows as an error). Used by
tests/gpu/test_speculative_gpu.py and benchmarks/speculative_trees.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from pipeline.backends.base import AttentionLayer
from pipeline.backends.memory import (KVPool, PageAllocator, ReqToTokenPool, dequantize_kv, layer_kv_scales,
                                      make_draft_batch, make_forward_batch)
from pipeline.backends.speculative import SpecInfo
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.runtime.spec_batches import path_to, random_tree


class StepResult(NamedTuple):
    """Worst ``max|out - ref| / max|ref|`` over the batch's requests (inf for NaN) and the median layer-call time
    (microseconds; 0 when not timed)."""

    max_rel_err: float
    us: float


class _Pools(NamedTuple):
    r2t: ReqToTokenPool
    kv: KVPool
    alloc: PageAllocator
    rows: list[int]


def make_pools(kind: LayerKind, prefix_lens: Sequence[int], extra: int, page_size: int, dtype: torch.dtype,
               device: str, scratch: int = 0) -> tuple[ReqToTokenPool, KVPool]:
    """``(req_to_token pool, KV pool)`` with rows ``1..B`` for ``prefix_lens`` plus ``extra`` tokens each in their rows
    and ``scratch`` slots each outside them (draft tokens); one layer of ``kind``. Build a backend over these
    (:func:`check_verify` / :func:`check_draft` take them as ``pools``)."""
    ctx = max(prefix_lens) + extra + scratch + page_size  # a draft branch runs step + 1 <= scratch tokens past its prefix
    per_req = -(-(max(prefix_lens) + extra) // page_size) + -(-scratch // page_size)
    slots = (per_req * len(prefix_lens) + 2 * len(prefix_lens) + 4) * page_size
    r2t = ReqToTokenPool(len(prefix_lens) + 1, ctx, device)
    kv = KVPool(slots, page_size, [(kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v)], dtype, device,
                mla_layers=[0] if kind.is_mla else ())
    return r2t, kv


def _pools(kind: LayerKind, prefix_lens: Sequence[int], extra: int, page_size: int, dtype: torch.dtype,
           device: str, seed: int, scratch: int = 0, given: Optional[tuple[ReqToTokenPool, KVPool]] = None) -> _Pools:
    """Pools (``given``, else :func:`make_pools`) holding ``prefix_lens`` cached tokens of random K/V per request in
    rows ``1..B``."""
    r2t, kv = given if given is not None else make_pools(kind, prefix_lens, extra, page_size, dtype, device, scratch)
    g = torch.Generator(device=device).manual_seed(seed)
    kv.k_buffer[0].copy_(torch.randn(kv.k_buffer[0].shape, generator=g, device=device).to(dtype))
    if not kind.is_mla:
        kv.v_buffer[0].copy_(torch.randn(kv.v_buffer[0].shape, generator=g, device=device).to(dtype))
    alloc = PageAllocator(r2t, kv.size, kv.page_size, seed=seed)
    rows = list(range(1, len(prefix_lens) + 1))
    for r, p in zip(rows, prefix_lens):
        if p:
            alloc.extend(r, p)
    return _Pools(r2t, kv, alloc, rows)


def _layer(kind: LayerKind, device: str, seed: int) -> AttentionLayer:
    sinks = None
    if kind.has_sinks:
        sinks = (torch.randn(kind.num_heads, generator=torch.Generator().manual_seed(seed)) + 1.0).to(device)
    return AttentionLayer(layer_id=0, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                          head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                          sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=sinks,
                          is_mla=kind.is_mla, attention_chunk_size=kind.attention_chunk_size)


def _qkv(kind: LayerKind, n: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(n, kind.num_heads, kind.head_dim_qk, generator=gen).to(device, dtype)
    k = torch.randn(n, kind.num_kv_heads, kind.head_dim_qk, generator=gen).to(device, dtype)
    v = k[..., : kind.head_dim_v].clone() if kind.is_mla else \
        torch.randn(n, kind.num_kv_heads, kind.head_dim_v, generator=gen).to(device, dtype)
    return q, k, v


def _pool_kv(kv: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ks, vs = layer_kv_scales(kv, 0)
    s = slots.to(kv.device, torch.int64)
    return dequantize_kv(kv.k_buffer[0][s], ks, torch.float64), dequantize_kv(kv.v_buffer[0][s], vs, torch.float64)


def _ref(layer: AttentionLayer, q, kk, vv, q_pos, k_pos=None, mask=None) -> torch.Tensor:
    return reference_attention(q, kk, vv, q_positions=q_pos, scale=layer.scaling, window=layer.sliding_window,
                               softcap=layer.logit_softcap, sinks=layer.sinks, chunk=layer.attention_chunk_size,
                               k_positions=k_pos, mask=mask)


def _verify_errors(fb: Any, pools: _Pools, layer: AttentionLayer, q: torch.Tensor, out: torch.Tensor) -> float:
    """Each request's tree tokens against float64 over the pool's prefix and tree K/V, the tree mask from paths."""
    worst, start = 0.0, 0
    r2t = pools.r2t.req_to_token
    for b, (row, prefix, n) in enumerate(zip(pools.rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        parents = fb.spec_info.parents[b]
        kk, vv = _pool_kv(pools.kv, r2t[row, : prefix + n])
        depth = torch.tensor([len(path_to(parents, i)) - 1 for i in range(n)], device=kk.device)
        mask = torch.zeros((n, prefix + n), dtype=torch.bool, device=kk.device)
        mask[:, :prefix] = True
        for i in range(n):
            mask[i, [prefix + j for j in path_to(parents, i)]] = True
        q_pos = prefix + depth
        k_pos = torch.cat([torch.arange(prefix, device=kk.device), q_pos])
        ref = _ref(layer, q[start: start + n], kk, vv, q_pos, k_pos, mask)
        e = rel_err(out[start: start + n], ref)
        worst = e if not e <= worst else worst
        start += n
    return worst


def _draft_errors(fb: Any, pools: _Pools, layer: AttentionLayer, q: torch.Tensor, out: torch.Tensor) -> float:
    """Each branch against float64 over its request's prefix and its own draft tokens (a chain of positions)."""
    worst, r2t = 0.0, pools.r2t.req_to_token
    slots = fb.spec_info.draft_slots
    b_, topk, s1 = slots.shape
    for b, (row, prefix) in enumerate(zip(pools.rows, fb.seq_lens_cpu)):
        for j in range(topk):
            kk, vv = _pool_kv(pools.kv, torch.cat([r2t[row, :prefix].to(torch.int64), slots[b, j].to(r2t.device)]))
            r = b * topk + j
            ref = _ref(layer, q[r: r + 1], kk, vv, torch.tensor([prefix + s1 - 1], device=kk.device))
            e = rel_err(out[r: r + 1], ref)
            worst = e if not e <= worst else worst
    return worst


def _timed(fn: Any, iters: int) -> float:
    """Median microseconds of ``fn()`` over ``iters`` runs (CUDA events; 0 on a CPU)."""
    if iters <= 0 or not torch.cuda.is_available():
        return 0.0
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def _run(backend: Any, layer: AttentionLayer, fb: Any, q, k, v, mode: ForwardMode, graph: bool, iters: int,
         renew: Any) -> tuple[torch.Tensor, Any, float]:
    """Eager: plan and call once (timed: the layer call). Graph: capture with this batch, then replay a new one
    (``renew()`` -> (fb, q, k, v), copied into the captured tensors) after the replay metadata."""
    if not graph:
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb)
        return out, fb, _timed(lambda: backend.forward(q, k, v, layer, fb), iters)
    from pipeline.platforms.cuda import capture_graph

    bs = fb.batch_size
    backend.init_cuda_graph_state(bs, fb.num_tokens)
    backend.init_forward_metadata_capture_cuda_graph(bs, fb.num_tokens, fb.req_pool_indices, fb.seq_lens, None, mode,
                                                     fb.spec_info)
    g, out = capture_graph(lambda: backend.forward(q, k, v, layer, fb))
    fb2, q2, k2, v2 = renew()
    for dst, src in ((q, q2), (k, k2), (v, v2), (fb.out_cache_loc, fb2.out_cache_loc), (fb.positions, fb2.positions)):
        dst.copy_(src)
    backend.init_forward_metadata_replay_cuda_graph(bs, fb2.req_pool_indices, fb2.seq_lens, sum(fb2.seq_lens_cpu),
                                                    None, mode, fb2.spec_info,
                                                    torch.tensor(fb2.seq_lens_cpu, dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    return out.clone(), fb2, _timed(g.replay, iters)


def draft_scratch(topk: int, step: int) -> int:
    """Draft slots :func:`check_draft` takes per request: two batches' branches (the captured and the replayed)."""
    return 2 * topk * (step + 1)


def check_verify(backend: Any, kind: LayerKind, *, prefix_lens: Sequence[int], spec: Any, page_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cuda", graph: bool = False, iters: int = 0,
                 seed: int = 0, pools: Optional[tuple[ReqToTokenPool, KVPool]] = None) -> StepResult:
    """A target verify of random trees (``spec.num_draft_tokens`` per request) over ``prefix_lens``; see the module
    docstring. ``pools``: the ones ``backend`` was built over (:func:`make_pools`; default new ones)."""
    n, gen = spec.num_draft_tokens, torch.Generator().manual_seed(seed)
    pools = _pools(kind, prefix_lens, n, page_size, dtype, device, seed, given=pools)
    layer = _layer(kind, device, seed)

    def batch() -> tuple[Any, ...]:
        info = SpecInfo(topk=spec.topk, num_draft_tokens=n,
                        parents=[random_tree(n, spec.topk, spec.num_steps, gen) for _ in pools.rows])
        for r, p in zip(pools.rows, prefix_lens):
            pools.alloc.truncate(r, p)
        fb = make_forward_batch(ForwardMode.TARGET_VERIFY, pools.rows, [n] * len(pools.rows), pools.alloc, pools.kv,
                                spec_info=info)
        return (fb, *_qkv(kind, fb.num_tokens, dtype, device, gen))

    fb, q, k, v = batch()  # a replay copies the new batch's q/k/v into these (the captured inputs)
    out, fb, us = _run(backend, layer, fb, q, k, v, ForwardMode.TARGET_VERIFY, graph, iters, batch)
    out = out.view(fb.num_tokens, kind.num_heads, kind.head_dim_v)
    return StepResult(_verify_errors(fb, pools, layer, q, out), us)


def check_draft(backend: Any, kind: LayerKind, *, prefix_lens: Sequence[int], topk: int, step: int,
                page_size: int = 1, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", graph: bool = False,
                iters: int = 0, seed: int = 0, pools: Optional[tuple[ReqToTokenPool, KVPool]] = None) -> StepResult:
    """Draft-decode step ``step`` (``step + 1`` draft tokens per branch, the earlier ones random K/V in fresh slots)
    of ``topk`` branches per request over ``prefix_lens``; see the module docstring. ``pools``: the ones ``backend``
    was built over (:func:`make_pools` with ``scratch=draft_scratch(topk, step)``; default new ones)."""
    gen = torch.Generator().manual_seed(seed)
    pools = _pools(kind, prefix_lens, 0, page_size, dtype, device, seed, scratch=draft_scratch(topk, step),
                   given=pools)
    layer = _layer(kind, device, seed)
    b = len(pools.rows)
    held = torch.stack([pools.alloc.scratch(r, draft_scratch(topk, step)) for r in pools.rows]).view(b, 2, topk,
                                                                                                 step + 1)
    made = []  # the first batch takes the first set of draft slots, a replayed one the second

    def batch() -> tuple[Any, ...]:
        fb = make_draft_batch(pools.rows, held[:, len(made) % 2], pools.alloc, pools.kv)
        made.append(fb)
        return (fb, *_qkv(kind, fb.num_tokens, dtype, device, gen))

    fb, q, k, v = batch()
    out, fb, us = _run(backend, layer, fb, q, k, v, ForwardMode.DRAFT_DECODE, graph, iters, batch)
    out = out.view(fb.num_tokens, kind.num_heads, kind.head_dim_v)
    return StepResult(_draft_errors(fb, pools, layer, q, out), us)


def backend_over(name: str, kind: LayerKind, pools: tuple[ReqToTokenPool, KVPool], *, device: str = "cuda",
                 workspace_bytes: int = 512 << 20, dtype: Optional[str] = None) -> Any:
    """The registered backend ``name`` built by its factory over ``pools`` for one layer of ``kind``, as the setup
    builds it (workspace of ``workspace_bytes`` when needed; ``dtype`` default the pool's, bf16 over fp8); the caller
    closes it."""
    from pipeline.backends.memory import is_fp8

    from pipeline.backends import registry
    from pipeline.backends.workspace import WorkspacePool
    from pipeline.core.contracts import AttentionArgs, DeviceFacts, ModelSpec, WorkspacePlan

    r2t, kv = pools
    on_gpu = torch.device(device).type == "cuda"
    facts = DeviceFacts(type="cuda", compute_capability=torch.cuda.get_device_capability(device),
                        sm_count=torch.cuda.get_device_properties(device).multi_processor_count) if on_gpu \
        else DeviceFacts(type="cpu")
    entry = registry.get(name)
    ws = None
    if entry.capability.workspace_bytes:
        ws = WorkspacePool(device).allocate(WorkspacePlan(id="ws", owner="primary", bytes=workspace_bytes,
                                                          shared_by=["primary"]))
    model = ModelSpec(model_type="probe", hidden_size=kind.num_heads * kind.head_dim_qk, num_hidden_layers=1,
                      num_attention_heads=kind.num_heads, num_key_value_heads=kind.num_kv_heads,
                      head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                      layer_types=["full"])
    ctx = registry.BackendContext(name=name, role="primary", device=facts, torch_device=device, model=model,
                                  layer_kinds=[kind], args=AttentionArgs(page_size=kv.page_size),
                                  req_to_token_pool=r2t, kv_pool=kv, workspace=ws,
                                  dtype=dtype or ("bfloat16" if is_fp8(kv.dtype) else str(kv.dtype)[6:]))
    return entry.load_factory()(ctx)
