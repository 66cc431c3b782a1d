"""One layer kind under verification: its layer, random inputs, the un-paged K/V history and the reference check.

:class:`_Case` holds the representative layer of a kind (with random sinks where the kind has them, and a q gain
that makes scaled scores reach a softcap) and each request's K/V as the pool stores and means it;
:func:`_check_case_step` runs that layer through a backend for one batch and returns each request's
``max|out - ref| / max|ref|`` against :func:`pipeline.runtime.reference.reference_attention` in float64.
:mod:`pipeline.runtime.verify` drives the cases through the steps of its batch.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pipeline.backends.base import AttentionBackend, AttentionLayer
from pipeline.backends.memory import KVPool, dequantize_kv, layer_kv_scales, quantize_kv
from pipeline.core.contracts import LayerKind
from pipeline.core.errors import BuildError
from pipeline.runtime.reference import reference_attention, rel_err


class _Case:
    """One layer kind under test: its layer, q gain and the un-paged K/V history per request."""

    def __init__(self, kind: LayerKind, kv_pool: KVPool, device: torch.device, gen: torch.Generator) -> None:
        lid = kind.layer_ids[0] if kind.layer_ids else 0
        want = (kind.num_kv_heads, kind.head_dim_qk), (kind.num_kv_heads, kind.head_dim_v)
        have = ((tuple(kv_pool.k_buffer[lid].shape[1:]), tuple(kv_pool.v_buffer[lid].shape[1:]))
                if lid < len(kv_pool.k_buffer) else None)
        if have != want:
            raise BuildError(f"KV pool layer {lid} has dims {have}, the model's {kind.kind} layers need {want}",
                             code="verify_pool_mismatch", flags=[("layer_id", lid)],
                             remedy="build the KV pool from the model's layer kinds")
        sinks = None
        if kind.has_sinks:
            sinks = (torch.randn(kind.num_heads, generator=gen) + 2.0).to(device)
        self.kind = kind
        self.layer = AttentionLayer(layer_id=lid, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                                    head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                                    sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=sinks,
                                    is_mla=kind.is_mla, attention_chunk_size=kind.attention_chunk_size)
        self.q_gain = 1.0
        if kind.logit_softcap is not None:
            self.q_gain = kind.logit_softcap / (math.sqrt(kind.head_dim_qk) * kind.scaling)
        self.k_hist: dict[int, list[torch.Tensor]] = {}
        self.v_hist: dict[int, list[torch.Tensor]] = {}

    def notes(self) -> list[str]:
        k, out = self.kind, []
        if k.logit_softcap is not None:
            out.append(f"softcap {k.logit_softcap}: q x{self.q_gain:.3g} so scores reach the cap")
        return out


def _inputs(case: _Case, n: int, dtype: torch.dtype, device: torch.device,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [n, H, D], k [n, Hkv, D], v [n, Hkv, Dv] (MLA: v = the latent part of k)."""
    L = case.layer
    q = (torch.randn(n, L.num_heads, L.head_dim, generator=gen) * case.q_gain).to(dtype)
    k = torch.randn(n, L.num_kv_heads, L.head_dim, generator=gen).to(dtype)
    if L.is_mla:
        v = k[..., : L.v_head_dim].clone()
    else:
        v = torch.randn(n, L.num_kv_heads, L.v_head_dim, generator=gen).to(dtype)
    return q.to(device), k.to(device), v.to(device)


def _check_case_step(case: _Case, backend: AttentionBackend, fb, rows: Sequence[int], new: Sequence[int],
                     dtype: torch.dtype, gen: torch.Generator) -> list[float]:
    """Run one layer of one step; returns the per-request relative errors."""
    pool, dev = fb.token_to_kv_pool, fb.token_to_kv_pool.device
    q, k, v = _inputs(case, sum(new), dtype, dev, gen)
    out = backend.forward(q, k, v, case.layer, fb, save_kv_cache=True)
    L = case.layer
    out = out.reshape(sum(new), L.num_heads, L.v_head_dim)
    ks, vs = layer_kv_scales(pool, L.layer_id)
    f64 = torch.float64
    errs, start = [], 0
    for row, n in zip(rows, new):
        sl = slice(start, start + n)
        case.k_hist.setdefault(row, []).append(dequantize_kv(quantize_kv(k[sl], pool.dtype, ks), ks, f64).cpu())
        case.v_hist.setdefault(row, []).append(dequantize_kv(quantize_kv(v[sl], pool.dtype, vs), vs, f64).cpu())
        kk, vv = torch.cat(case.k_hist[row]), torch.cat(case.v_hist[row])
        pos = torch.arange(kk.shape[0] - n, kk.shape[0])
        ref = reference_attention(q[sl].cpu(), kk, vv, q_positions=pos, scale=L.scaling, window=L.sliding_window,
                                  softcap=L.logit_softcap, sinks=None if L.sinks is None else L.sinks.cpu(),
                                  chunk=L.attention_chunk_size)
        errs.append(rel_err(out[sl].cpu(), ref))
        start += n
    return errs
