"""A CPU stand-in for the FlashInfer 0.6.13 wrapper API, to test the backend's glue on CPU.

It implements the documented semantics of ``plan()``/``run()`` (indptr / indices /
last_page_len page tables, NHD paged layout, bottom-right causal mask, ``window_left``,
``logits_soft_cap``, sinks as extra positional run args) with plain fp32 loops. It is a test
double for the *interface*: the real kernels are checked on the H200
(tests/gpu/test_flashinfer_gpu.py). Install with ``monkeypatch.setitem(sys.modules, "flashinfer", fake)``.
"""

from __future__ import annotations

import math
import types

import torch


class _Base:
    def __init__(self, ws, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, backend="auto", **kw):
        assert ws.dtype == torch.uint8 and kv_layout == "NHD"
        self.backend, self.use_cuda_graph, self.tc, self.bufs = backend, use_cuda_graph, use_tensor_cores, kw
        self.plans = 0

    def _store(self, qo, indptr, indices, last, kw):
        self.plans += 1
        self.qo, self.indptr, self.last = qo.cpu().long(), indptr.cpu().long(), last.cpu().long()
        assert self.indptr.device.type == "cpu"
        self.indices = indices.long()
        self.kw = kw
        if self.use_cuda_graph:
            buf = self.bufs.get("paged_kv_indices_buffer", self.bufs.get("paged_kv_indices_buf"))
            buf[: len(indices)].copy_(indices)

    def _attend(self, q, k, v, kv_len, causal):
        kw = self.kw
        g = q.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        s = torch.einsum("nhd,mhd->hnm", q.float(), k) * kw["sm_scale"]
        if kw.get("logits_soft_cap"):
            c = kw["logits_soft_cap"]
            s = c * torch.tanh(s / c)
        n = q.shape[0]
        pos = (kv_len - n + torch.arange(n))[:, None] if causal else torch.full((n, 1), kv_len - 1)
        j = torch.arange(kv_len)[None, :]
        ok = j <= pos
        if kw.get("window_left", -1) >= 0:
            ok &= j >= pos - kw["window_left"]
        s = s.masked_fill(~ok, -math.inf)
        if self.sinks is not None:
            s = torch.cat([s, self.sinks.float()[:, None, None].expand(s.shape[0], n, 1)], -1)
            return torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1)[..., :-1], v)
        return torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v)

    def _paged(self, q, kv, causal, *args):
        self.sinks = args[0] if args else None
        kc, vc = kv
        ps = kc.shape[1]
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype)
        for b in range(len(self.indptr) - 1):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]].cpu()
            kv_len = (len(pages) - 1) * ps + int(self.last[b])
            k = kc[pages].reshape(-1, *kc.shape[2:])[:kv_len]
            v = vc[pages].reshape(-1, *vc.shape[2:])[:kv_len]
            a, e = int(self.qo[b]), int(self.qo[b + 1])
            out[a:e] = self._attend(q[a:e], k, v, kv_len, causal).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Base):
    def plan(self, *, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        if not self.tc and num_qo_heads // num_kv_heads not in (1, 2, 3, 4, 8):  # FlashInfer's DISPATCH_GQA_GROUP_SIZE
            raise RuntimeError(f"Unsupported group_size: {num_qo_heads // num_kv_heads}")
        self._store(torch.arange(len(last_page_len) + 1), indptr, indices, last_page_len, kw)

    def run(self, q, kv, *args, enable_pdl=None):
        assert enable_pdl is None or isinstance(enable_pdl, bool), enable_pdl
        return self._paged(q, kv, False, *args)


class BatchPrefillWithPagedKVCacheWrapper(_Base):
    def plan(self, *, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, causal=False, **kw):
        self.causal = causal
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kw)

    def run(self, q, kv, *args):
        return self._paged(q, kv, self.causal, *args)


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    def __init__(self, ws, kv_layout="NHD", *, window_left=-1, q_data_type=None, kv_data_type=None,
                 head_dim_qk=None, head_dim_vo=None, **kw):
        super().__init__(ws, kv_layout, **kw)


class BatchPrefillWithRaggedKVCacheWrapper(_Base):
    def plan(self, *, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             causal=False, **kw):
        self.plans += 1
        self.qo, self.kvp, self.causal, self.kw, self.sinks = qo_indptr.long(), kv_indptr.long(), causal, kw, None

    def run(self, q, k, v):
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
        for b in range(len(self.qo) - 1):
            a, e = int(self.qo[b]), int(self.qo[b + 1])
            ka, ke = int(self.kvp[b]), int(self.kvp[b + 1])
            out[a:e] = self._attend(q[a:e], k[ka:ke], v[ka:ke], ke - ka, self.causal).to(q.dtype)
        return out


def module() -> types.ModuleType:
    """A module object exposing the four wrapper classes under FlashInfer's names."""
    m = types.ModuleType("flashinfer")
    for c in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
              BatchAttentionWithAttentionSinkWrapper, BatchPrefillWithRaggedKVCacheWrapper):
        setattr(m, c.__name__, c)
    m.__version__ = "fake"
    return m
