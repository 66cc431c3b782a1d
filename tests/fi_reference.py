"""Independent dense attention reference and scenario builder for the FlashInfer backend tests.

``dense_reference`` computes one request's attention in float64 (or any dtype) from contiguous
K/V, with our conventions: query i (absolute position ``prefix + i``) sees key j iff
``j <= pos_i`` and, with a window W, ``pos_i - j < W``; softcap ``cap * tanh(s / cap)`` on scaled
scores; a sink adds ``exp(sink_h)`` to the softmax denominator only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pipeline.backends.base import AttentionLayer
from pipeline.backends.registry import BackendContext
from pipeline.core.contracts import DeviceFacts, ForwardMode, LayerKind, WorkspacePlan
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.backends.workspace import WorkspacePool


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix: int, scale: float,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q [n, H, D], k [m, Hkv, D], v [m, Hkv, Dv] (m = prefix + n) → [n, H, Dv] in ``dtype``."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos_q = prefix + torch.arange(q.shape[0], device=q.device)[:, None]
    pos_k = torch.arange(k.shape[0], device=q.device)[None, :]
    mask = pos_k <= pos_q
    if window:
        mask &= (pos_q - pos_k) < window
    s = s.masked_fill(~mask, -math.inf)
    if sinks is not None:
        col = sinks.to(dtype)[:, None, None].expand(s.shape[0], s.shape[1], 1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("hnm,mhd->nhd", p, v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` (the project's error metric)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def make_kind(h: int, hkv: int, d: int, *, window=None, softcap=None, sinks=False, layer_ids=(0,)) -> LayerKind:
    """A LayerKind with scaling ``d ** -0.5``."""
    return LayerKind(kind="sliding" if window else "full", num_heads=h, num_kv_heads=hkv, head_dim_qk=d,
                     head_dim_v=d, scaling=d ** -0.5, sliding_window=window, logit_softcap=softcap,
                     has_sinks=sinks, layer_ids=list(layer_ids))


def make_mla_kind(h: int, *, latent: int = 512, rope: int = 64, nope: int = 128, layer_ids=(0,),
                  scaling: Optional[float] = None) -> LayerKind:
    """An absorbed-MLA LayerKind (one latent head; qk ``latent + rope``, v ``latent``); scale ``scaling`` or
    ``(nope + rope) ** -0.5`` (the head dim before absorption, as FlashInfer's MLA docs say)."""
    return LayerKind(kind="full", num_heads=h, num_kv_heads=1, head_dim_qk=latent + rope, head_dim_v=latent,
                     scaling=scaling or (nope + rope) ** -0.5, is_mla=True, layer_ids=list(layer_ids))


def make_layer(kind: LayerKind, layer_id: int, sinks: Optional[torch.Tensor] = None) -> AttentionLayer:
    return AttentionLayer(layer_id=layer_id, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                          head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                          sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=sinks,
                          is_mla=kind.is_mla)


class Scenario:
    """Pools + allocator + context for one backend instance on ``device``.

    ``kinds`` are the layer kinds (their ``layer_ids`` index the KV pool); ``ws_bytes`` the
    workspace size; ``extra`` goes to ``BackendContext.extra`` (e.g. ``cuda_graph_max_bs``).
    ``dtype`` is q's (and the model's); ``kv_dtype`` the cache's (default ``dtype``; e.g.
    ``torch.float8_e4m3fn``) with per-layer ``k_scales`` / ``v_scales`` (default 1.0).
    """

    def __init__(self, kinds, *, device="cuda", dtype=torch.bfloat16, page_size=16, max_reqs=16,
                 max_context_len=4096, num_slots=None, ws_bytes=64 << 20, name="flashinfer", sm_count=132,
                 arch=(9, 0), extra=None, seed=0, facts_type=None, kv_dtype=None, k_scales=None,
                 v_scales=None) -> None:
        self.kinds, self.device, self.dtype, self.page_size = list(kinds), device, dtype, page_size
        nl = 1 + max(l for k in kinds for l in k.layer_ids)
        num_slots = num_slots or page_size * (max_reqs * (-(-max_context_len // page_size)) + 2)
        self.req_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        self.kv = KVPool.for_layer_kinds(kinds, nl, num_slots, page_size, kv_dtype or dtype, device,
                                         k_scales=k_scales, v_scales=v_scales)
        self.alloc = PageAllocator(self.req_pool, num_slots, page_size, seed=seed)
        self.ws_pool = WorkspacePool(device)
        ws = self.ws_pool.allocate(WorkspacePlan(id="ws-shared", owner="primary", bytes=ws_bytes, shared_by=["primary"]))
        facts = DeviceFacts(type=facts_type or ("cuda" if str(device).startswith("cuda") else "cpu"), compute_capability=arch,
                            sm_count=sm_count, source="test")
        from pipeline.core.contracts import AttentionArgs, ModelSpec

        model = ModelSpec(model_type="test", hidden_size=kinds[0].num_heads * kinds[0].head_dim_qk,
                          num_hidden_layers=nl, num_attention_heads=kinds[0].num_heads,
                          num_key_value_heads=kinds[0].num_kv_heads, head_dim=kinds[0].head_dim_qk,
                          v_head_dim=kinds[0].head_dim_v, scaling=kinds[0].scaling, layer_types=["full"] * nl)
        self.ctx = BackendContext(name=name, role="primary", device=facts, torch_device=str(device), model=model,
                                  layer_kinds=list(kinds), args=AttentionArgs(page_size=page_size),
                                  req_to_token_pool=self.req_pool, kv_pool=self.kv, workspace=ws,
                                  dtype=str(dtype).replace("torch.", ""), extra=dict(extra or {}))
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape, scale=1.0) -> torch.Tensor:
        """Standard normal values (times ``scale``) made on the device, in the pool dtype."""
        return (torch.randn(*shape, generator=self.gen, device=self.device) * scale).to(self.dtype)

    def fill_prefix(self, reqs, lens) -> None:
        """Give each request ``lens[i]`` cached tokens of random K/V in every layer."""
        for r, n in zip(reqs, lens):
            if n == 0:
                continue
            loc = self.alloc.extend(r, n).to(self.device)
            for kind in self.kinds:
                for lid in kind.layer_ids:
                    self.kv.set_kv_buffer(lid, loc, self.randn(n, kind.num_kv_heads, kind.head_dim_qk),
                                          self.randn(n, kind.num_kv_heads, kind.head_dim_v))

    def batch(self, mode: ForwardMode, reqs, new_tokens):
        return make_forward_batch(mode, reqs, new_tokens, self.alloc, self.kv)

    def request_kv(self, layer_id: int, req: int, length: int):
        """Contiguous K [length, Hkv, D] and V of one request (after the batch's KV was saved), as the
        cache means them: float64 ``stored * scale`` (the layer's k_scale / v_scale; 1 unless fp8)."""
        slots = self.req_pool.req_to_token[req, :length].long()
        ks, vs = self.kv.kv_scales(layer_id)
        return (self.kv.k_buffer[layer_id][slots].double() * ks, self.kv.v_buffer[layer_id][slots].double() * vs)
