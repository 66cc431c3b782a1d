"""A CPU stand-in for the FlashInfer 0.7.2 wrapper API, to test the backend's glue on CPU.

It implements the documented semantics of ``plan()``/``run()`` (indptr / indices /
last_page_len page tables, NHD paged layout, bottom-right causal mask, ``window_left``,
``logits_soft_cap``, sinks as extra positional run args; fp8 caches with ``k_scale`` multiplying the
softmax scale and ``v_scale`` the output, as FlashInfer's ``run()`` does; and the MLA wrapper
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` in its only non-deprecated form: ``plan(*,
metadata=MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr), num_heads, head_dim_ckv, head_dim_kpe,
page_size, causal, sm_scale, q_data_type, kv_data_type, query_layout, kv_cache_layout)``, ``run(*, query,
kv_cache, out=...)`` — a (q_nope, q_pe) / (ckv, kpe) pair where the plan said ``"split"``, one tensor where it said
``"packed"`` (the canonical default) — with ``scores = q_nope·ckv + q_pe·kpe`` and ``out = softmax · ckv``,
CUDA-graph buffers read at run time) with plain fp32 loops. The deprecated MLA forms (flat or positional plan
metadata, separate ``q_nope, q_pe, ckv_cache, kpe_cache`` run arguments) raise TypeError here, so a call FlashInfer
0.7.2 would only warn about fails the CPU tests. It checks what FlashInfer checks or would mis-compute silently: the
cache dtype against the planned ``kv_data_type``, q's dtype against ``q_data_type``, MLA page counts against
``kv_len_arr``, a customized prefill module's ``paged_kv_stride_mode`` (fa3 compiles ``"runtime"`` only). It is a
test double for the *interface*: the real kernels are checked on the H200 (tests/gpu/test_flashinfer_gpu.py,
tests/gpu/test_flashinfer_mla_fp8_gpu.py). Install with ``monkeypatch.setitem(sys.modules, "flashinfer", fake)``.
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

    def _check_dtypes(self, q, cache):
        kw = self.kw
        if kw.get("q_data_type") is not None:
            assert q.dtype == kw["q_data_type"], (q.dtype, kw["q_data_type"])
        if kw.get("kv_data_type") is not None:
            assert cache.dtype == kw["kv_data_type"], (cache.dtype, kw["kv_data_type"])
        if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert q.dtype in (torch.bfloat16, torch.float16) and self.backend != "fa3", "fp8 KV: fa2 / CUDA core only"

    def _attend(self, q, k, v, kv_len, causal, k_scale=None, v_scale=None, custom=None):
        kw = self.kw
        g = q.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
        sm = kw["sm_scale"] * (k_scale if k_scale is not None else 1.0)  # FlashInfer: sm_scale *= k_scale
        s = torch.einsum("nhd,mhd->hnm", q.float(), k) * sm
        if kw.get("logits_soft_cap"):
            c = kw["logits_soft_cap"]
            s = c * torch.tanh(s / c)
        n = q.shape[0]
        pos = (kv_len - n + torch.arange(n))[:, None] if causal else torch.full((n, 1), kv_len - 1)
        j = torch.arange(kv_len)[None, :]
        ok = j <= pos if custom is None else custom  # FlashInfer: a custom mask replaces the causal one
        if kw.get("window_left", -1) >= 0:
            ok &= j >= pos - kw["window_left"]
        s = s.masked_fill(~ok, -math.inf)
        if self.sinks is not None:
            s = torch.cat([s, self.sinks.float()[:, None, None].expand(s.shape[0], n, 1)], -1)
            o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1)[..., :-1], v)
        else:
            o = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v)
        return o * v_scale if v_scale is not None else o  # FlashInfer: out *= v_scale

    def _paged(self, q, kv, causal, *args, k_scale=None, v_scale=None):
        self.sinks = args[0] if args else None
        kc, vc = kv
        self._check_dtypes(q, kc)
        ps = kc.shape[1]
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype)
        for b in range(len(self.indptr) - 1):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]].cpu()
            kv_len = (len(pages) - 1) * ps + int(self.last[b])
            k = kc[pages].reshape(-1, *kc.shape[2:])[:kv_len]
            v = vc[pages].reshape(-1, *vc.shape[2:])[:kv_len]
            a, e = int(self.qo[b]), int(self.qo[b + 1])
            custom = self._custom(b, e - a, kv_len)
            out[a:e] = self._attend(q[a:e], k, v, kv_len, causal, k_scale, v_scale, custom).to(q.dtype)
        return out

    def _custom(self, b, qo_len, kv_len):
        """Request ``b``'s [qo_len, kv_len] custom mask, unpacked at run time from the packed bytes plan() stored
        (in CUDA-graph mode: from custom_mask_buf / mask_indptr_buf, as the kernel reads them); None without one."""
        packed, indptr = getattr(self, "packed_mask", None), getattr(self, "mask_indptr", None)
        if packed is None:
            return None
        seg = packed[int(indptr[b]): int(indptr[b + 1])].cpu()
        bits = ((seg.view(-1, 1).int() >> torch.arange(8)) & 1).reshape(-1)[: qo_len * kv_len]  # little bit order
        assert bits.numel() == qo_len * kv_len, "custom mask shorter than qo_len * kv_len"
        return bits.bool().view(qo_len, kv_len)


class BatchDecodeWithPagedKVCacheWrapper(_Base):
    def plan(self, *, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        if not self.tc and num_qo_heads // num_kv_heads not in (1, 2, 3, 4, 8):  # FlashInfer's DISPATCH_GQA_GROUP_SIZE
            raise RuntimeError(f"Unsupported group_size: {num_qo_heads // num_kv_heads}")
        self._store(torch.arange(len(last_page_len) + 1), indptr, indices, last_page_len, kw)

    def run(self, q, kv, *args, enable_pdl=None, k_scale=None, v_scale=None):
        assert enable_pdl is None or isinstance(enable_pdl, bool), enable_pdl
        return self._paged(q, kv, False, *args, k_scale=k_scale, v_scale=v_scale)


class BatchPrefillWithPagedKVCacheWrapper(_Base):
    def __init__(self, ws, kv_layout="NHD", *, jit_args=None, jit_kwargs=None, **kw):
        super().__init__(ws, kv_layout, **kw)
        self.module = _jit_module(jit_args) if jit_args else None
        if jit_args:  # flashinfer.jit.attention.modules._validate_batch_prefill_module_mode
            mode, surface = (jit_kwargs or {}).get("paged_kv_stride_mode", "runtime"), \
                (jit_kwargs or {}).get("module_surface", "full")
            assert mode in ("runtime", "equal", "independent") and surface in ("full", "paged"), (mode, surface)
            assert self.backend == "fa2" or (mode, surface) == ("runtime", "full"), (self.backend, mode, surface)

    def plan(self, *, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, causal=False, custom_mask=None, **kw):
        self.causal = causal
        self._store(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, kw)
        self.packed_mask = self.mask_indptr = None
        graph_buf = self.bufs.get("custom_mask_buf")
        if custom_mask is None:
            assert graph_buf is None, "a CUDA-graph wrapper built with custom_mask_buf always reads it: plan a mask"
            return
        # FlashInfer packs it with segment_packbits, whose indptr must be on the mask's device (0.6.13)
        assert qo_indptr.device == custom_mask.device == paged_kv_indptr.device, "segment_packbits device check"
        lens = (self.qo[1:] - self.qo[:-1]) * ((self.indptr[1:] - self.indptr[:-1] - 1) * page_size + self.last)
        segs = torch.split(custom_mask.cpu().bool(), lens.tolist())
        packed = [_packbits(x) for x in segs]
        mask_indptr = torch.tensor([0] + [len(x) for x in packed]).cumsum(0)
        flat = torch.cat(packed) if packed else torch.zeros(0, dtype=torch.uint8)
        if graph_buf is not None:
            graph_buf[: len(flat)].copy_(flat)
            self.bufs["mask_indptr_buf"].copy_(mask_indptr)
            self.packed_mask, self.mask_indptr = graph_buf, self.bufs["mask_indptr_buf"]
        else:
            self.packed_mask, self.mask_indptr = flat, mask_indptr

    def run(self, q, kv, *args, k_scale=None, v_scale=None):
        if self.module is not None:
            kc, vc = kv
            assert self.module == (q.shape[-1], vc.shape[-1], kc.dtype), (
                f"JIT module built for {self.module}, run with head dims {q.shape[-1]}/{vc.shape[-1]} and "
                f"KV {kc.dtype}: a module name that does not name every compile-time parameter")
        return self._paged(q, kv, self.causal, *args, k_scale=k_scale, v_scale=v_scale)


def _packbits(x: torch.Tensor) -> torch.Tensor:
    """numpy.packbits(x, bitorder="little") of a bool vector, as FlashInfer's segment_packbits packs each segment."""
    pad = torch.zeros((-len(x)) % 8, dtype=torch.bool)
    bits = torch.cat([x, pad]).view(-1, 8).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8)


# JIT modules by name, as FlashInfer's JIT cache keys them: the first build of a name wins, and a later wrapper
# asking for the same name with other compile-time parameters gets that first module (FlashInfer's sink wrapper,
# 0.6.13 and 0.7.2, names its module without head dims or KV dtype: this is how a d128 sink layer got the d64 kernel).
JIT_MODULES: dict = {}


def _jit_module(jit_args) -> tuple:
    """(head_dim_qk, head_dim_vo, kv dtype) the module named jit_args[0] was built for."""
    uri, _q, kv, _o, _idx, dqk, dvo = jit_args[:7]
    return JIT_MODULES.setdefault(uri, (dqk, dvo, kv))


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    def __init__(self, ws, kv_layout="NHD", *, window_left=-1, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, head_dim_qk=128, head_dim_vo=128, backend="fa2", **kw):
        short = {torch.bfloat16: "bf16", torch.float16: "f16"}[q_data_type]
        jit_args = [f"batch_prefill_attention_sink_{short}_swa_{window_left >= 0}_{backend}", q_data_type,
                    kv_data_type, q_data_type, torch.int32, head_dim_qk, head_dim_vo]
        jit_kwargs = {"paged_kv_stride_mode": "independent" if backend == "fa2" else "runtime",
                      "module_surface": "full"}
        super().__init__(ws, kv_layout, backend=backend, jit_args=jit_args, jit_kwargs=jit_kwargs, **kw)


class BatchPrefillWithRaggedKVCacheWrapper(_Base):
    def plan(self, *, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             causal=False, **kw):
        self.plans += 1
        self.qo, self.kvp, self.causal, self.kw, self.sinks = qo_indptr.long(), kv_indptr.long(), causal, kw, None

    def run(self, q, k, v):
        assert k.dtype == v.dtype == q.dtype, "the ragged wrapper takes k/v in q's dtype"
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
        for b in range(len(self.qo) - 1):
            a, e = int(self.qo[b]), int(self.qo[b + 1])
            ka, ke = int(self.kvp[b]), int(self.kvp[b + 1])
            out[a:e] = self._attend(q[a:e], k[ka:ke], v[ka:ke], ke - ka, self.causal).to(q.dtype)
        return out


class MLAPlanMetadata:
    """``flashinfer.mla.MLAPlanMetadata`` (0.7.2): the CSR form is the one the fa2/fa3 MLA backends consume."""

    def __init__(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr = qo_indptr, kv_indptr, kv_indices, kv_len_arr

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


def _mla_pair(value, layout: str, widths: tuple, name: str) -> tuple:
    """(nope, pe) of a structural MLA input as planned: a pair for ``"split"``, one tensor for ``"packed"``."""
    if layout == "split":
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(f"{name}: planned split, got {type(value).__name__}")
        return value
    if not isinstance(value, torch.Tensor) or value.shape[-1] != sum(widths):
        raise TypeError(f"{name}: planned packed [..., {sum(widths)}], got {getattr(value, 'shape', type(value))}")
    return value[..., :widths[0]], value[..., widths[0]:]


class BatchMLAPagedAttentionWrapper:
    """FlashInfer 0.7.2's MLA wrapper (absorbed form): one latent head, ``ckv`` / ``kpe`` paged caches."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        assert float_workspace_buffer.dtype in (torch.uint8, torch.int8)
        assert backend in ("fa2", "fa3"), backend  # the backend always names it (auto would pick by arch)
        self.backend, self.use_cuda_graph, self.plans = backend, use_cuda_graph, 0
        self.bufs = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 for b in self.bufs.values()), self.bufs

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, use_profiler=False, query_layout="packed", kv_cache_layout="packed", lse_mode="none"):
        assert isinstance(metadata, MLAPlanMetadata), type(metadata)
        assert query_layout in ("packed", "split") and kv_cache_layout in ("packed", "split")
        qo_indptr, kv_indptr, kv_indices, kv_len_arr = (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
                                                        metadata.kv_len_arr)
        self.plans += 1
        self.qo, self.kvp, self.lens = qo_indptr.cpu().long(), kv_indptr.cpu().long(), kv_len_arr.cpu().long()
        assert len(self.qo) == len(self.kvp) == len(self.lens) + 1
        for b in range(len(self.lens)):  # pages per request must cover exactly kv_len tokens
            pages = int(self.kvp[b + 1] - self.kvp[b])
            assert pages == -(-int(self.lens[b]) // page_size), (b, pages, int(self.lens[b]), page_size)
            assert int(self.qo[b + 1] - self.qo[b]) <= int(self.lens[b])
        self.indices = kv_indices.long()
        self.cfg = dict(num_heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe, page_size=page_size, causal=causal,
                        sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                        query_layout=query_layout, kv_cache_layout=kv_cache_layout)
        if self.use_cuda_graph:  # as FlashInfer: copied into the fixed buffers, which run() reads
            self.bufs["qo_indptr"].copy_(qo_indptr)
            self.bufs["kv_indptr"].copy_(kv_indptr)
            self.bufs["kv_indices"][: len(kv_indices)].copy_(kv_indices)
            self.bufs["kv_len_arr"].copy_(kv_len_arr)

    def run(self, *, query, kv_cache, out=None, lse=None, return_lse=False):
        c = self.cfg
        q_nope, q_pe = _mla_pair(query, c["query_layout"], (c["ckv"], c["kpe"]), "query")
        ckv_cache, kpe_cache = _mla_pair(kv_cache, c["kv_cache_layout"], (c["ckv"], c["kpe"]), "kv_cache")
        t, h = q_nope.shape[:2]
        assert q_nope.shape == (t, c["num_heads"], c["ckv"]) and q_pe.shape == (t, c["num_heads"], c["kpe"])
        assert q_nope.dtype == q_pe.dtype == c["q_data_type"], (q_nope.dtype, c["q_data_type"])
        assert ckv_cache.dtype == kpe_cache.dtype == c["kv_data_type"], (ckv_cache.dtype, c["kv_data_type"])
        assert ckv_cache.shape[1:] == (c["page_size"], c["ckv"]) and kpe_cache.shape[1:] == (c["page_size"], c["kpe"])
        indices = (self.bufs["kv_indices"] if self.use_cuda_graph else self.indices).cpu().long()
        out = torch.empty(t, h, c["ckv"], dtype=q_nope.dtype) if out is None else out
        assert out.shape == (t, h, c["ckv"]) and out.dtype == q_nope.dtype
        for b in range(len(self.lens)):
            a, e, n = int(self.qo[b]), int(self.qo[b + 1]), int(self.lens[b])
            pages = indices[int(self.kvp[b]):int(self.kvp[b + 1])]
            ck = ckv_cache[pages].reshape(-1, c["ckv"])[:n].float()
            kp = kpe_cache[pages].reshape(-1, c["kpe"])[:n].float()
            s = (torch.einsum("qhc,mc->hqm", q_nope[a:e].float(), ck)
                 + torch.einsum("qhr,mr->hqm", q_pe[a:e].float(), kp)) * c["sm_scale"]
            if c["causal"]:  # bottom-right aligned: query i of e - a sits at position n - (e - a) + i
                pos = n - (e - a) + torch.arange(e - a)
                s = s.masked_fill(torch.arange(n)[None, None, :] > pos[None, :, None], -math.inf)
            out[a:e] = torch.einsum("hqm,mc->qhc", torch.softmax(s, -1), ck).to(out.dtype)
        return out


def module() -> types.ModuleType:
    """A module exposing the wrapper classes under FlashInfer's names (the MLA one also as ``flashinfer.mla``)."""
    m = types.ModuleType("flashinfer")
    for c in (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
              BatchAttentionWithAttentionSinkWrapper, BatchPrefillWithRaggedKVCacheWrapper,
              BatchMLAPagedAttentionWrapper):
        setattr(m, c.__name__, c)
    m.mla = types.ModuleType("flashinfer.mla")
    m.mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    m.mla.MLAPlanMetadata = MLAPlanMetadata
    m.jit = types.SimpleNamespace(attention=types.SimpleNamespace(variants=types.SimpleNamespace(
        attention_sink_decl={"fa2": "/* fake fa2 sink decl */", "fa3": "/* fake fa3 sink decl */"})))
    m.__version__ = "0.7.2"
    return m
