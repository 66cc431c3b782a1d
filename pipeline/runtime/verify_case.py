"""One layer kind under verification: its layer, random inputs, the un-paged K/V history and the reference check.

:class:`_Case` holds the representative layer of a kind (with random sinks where the kind has them, and a q gain
that makes scaled scores reach a softcap) and each request's K/V as the pool stores and means it;
:func:`_check_case_step` runs that layer through a backend for one batch and returns each request's
``max|out - ref| / max|ref|`` against :func:`pipeline.runtime.reference.reference_attention` in float64.
:mod:`pipeline.runtime.verify` drives the cases through the steps of its batch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from pipeline.backends.base import AttentionBackend, AttentionLayer
from pipeline.backends.memory import KVPool, dequantize_kv, layer_kv_scales, quantize_kv
from pipeline.core.contracts import LayerKind
from pipeline.core.errors import BuildError
from pipeline.runtime.reference import reference_attention, rel_err
from pipeline.runtime.spec_batches import path_to


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
        self.draft: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # draft-token slot -> its stored (K, V)

    def accept(self, row: int, prefix: int, path: Sequence[int]) -> None:
        """After target verify: request ``row``'s history keeps its first ``prefix`` tokens and the tree tokens on
        ``path`` (root first), as the pool does (:func:`pipeline.runtime.spec_batches.accept_path`)."""
        for hist in (self.k_hist, self.v_hist):
            h = torch.cat(hist[row])
            hist[row] = [torch.cat([h[:prefix], h[[prefix + i for i in path]]])]

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


def _ancestors_mask(parents: Sequence[int], prefix: int) -> torch.Tensor:
    """[n, prefix + n] bool: every tree token sees the prefix, itself and its ancestors — from the paths to the root
    (:func:`pipeline.runtime.spec_batches.path_to`), not from the backends' mask builder."""
    n = len(parents)
    mask = torch.zeros((n, prefix + n), dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(n):
        mask[i, [prefix + j for j in path_to(parents, i)]] = True
    return mask


def _reference(case: _Case, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, q_pos: torch.Tensor,
               k_pos: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    L = case.layer
    return reference_attention(q.cpu(), kk, vv, q_positions=q_pos, scale=L.scaling, window=L.sliding_window,
                               softcap=L.logit_softcap, sinks=None if L.sinks is None else L.sinks.cpu(),
                               chunk=L.attention_chunk_size, k_positions=k_pos, mask=mask)


def _check_case_step(case: _Case, backend: AttentionBackend, fb, rows: Sequence[int], new: Sequence[int],
                     dtype: torch.dtype, gen: torch.Generator) -> list[float]:
    """Run one layer of one step; returns the per-request relative errors (draft decode: the worst branch of each
    request). A target-verify step appends the whole tree to each request's history (:meth:`_Case.accept` keeps the
    accepted path afterwards); a draft-decode step keeps its tokens apart, by slot."""
    pool, dev = fb.token_to_kv_pool, fb.token_to_kv_pool.device
    t = fb.num_tokens
    q, k, v = _inputs(case, t, dtype, dev, gen)
    out = backend.forward(q, k, v, case.layer, fb, save_kv_cache=True)
    L = case.layer
    out = out.reshape(t, L.num_heads, L.v_head_dim).cpu()
    ks, vs = layer_kv_scales(pool, L.layer_id)
    f64 = torch.float64
    k_st = dequantize_kv(quantize_kv(k, pool.dtype, ks), ks, f64).cpu()
    v_st = dequantize_kv(quantize_kv(v, pool.dtype, vs), vs, f64).cpu()
    if fb.is_draft_decode():
        return _check_draft(case, fb, rows, q, out, k_st, v_st)
    errs, start = [], 0
    for b, (row, n) in enumerate(zip(rows, new)):
        sl = slice(start, start + n)
        hist_k, hist_v = case.k_hist.setdefault(row, []), case.v_hist.setdefault(row, [])
        prefix = sum(x.shape[0] for x in hist_k)
        hist_k.append(k_st[sl])
        hist_v.append(v_st[sl])
        kk, vv = torch.cat(hist_k), torch.cat(hist_v)
        if fb.is_target_verify():
            parents = fb.spec_info.parents[b]
            q_pos = torch.tensor([prefix + len(path_to(parents, i)) - 1 for i in range(n)])
            ref = _reference(case, q[sl], kk, vv, q_pos, torch.cat([torch.arange(prefix), q_pos]),
                             _ancestors_mask(parents, prefix))
        else:
            ref = _reference(case, q[sl], kk, vv, torch.arange(prefix, prefix + n))
        errs.append(rel_err(out[sl], ref))
        start += n
    return errs


def _check_draft(case: _Case, fb, rows: Sequence[int], q: torch.Tensor, out: torch.Tensor, k_st: torch.Tensor,
                 v_st: torch.Tensor) -> list[float]:
    """Draft decode: branch ``(b, j)`` against the request's history and its own draft tokens (by slot)."""
    slots = fb.spec_info.draft_slots.cpu()
    topk = slots.shape[1]
    for i, slot in enumerate(slots[:, :, -1].reshape(-1).tolist()):
        case.draft[slot] = (k_st[i: i + 1], v_st[i: i + 1])
    errs = []
    for b, row in enumerate(rows):
        hist_k, hist_v = torch.cat(case.k_hist[row]), torch.cat(case.v_hist[row])
        worst = 0.0
        for j in range(topk):
            r = b * topk + j
            mine = [case.draft[int(x)] for x in slots[b, j]]
            kk = torch.cat([hist_k] + [m[0] for m in mine])
            vv = torch.cat([hist_v] + [m[1] for m in mine])
            ref = _reference(case, q[r: r + 1], kk, vv, torch.tensor([kk.shape[0] - 1]))
            e = rel_err(out[r: r + 1], ref)
            worst = e if not e <= worst else worst
        errs.append(worst)
    return errs
