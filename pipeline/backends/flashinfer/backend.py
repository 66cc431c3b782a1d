"""The ``flashinfer`` and ``fa3`` backends: FlashInfer wrappers over the paged KV cache (docs/internals.md)."""

from __future__ import annotations

import inspect
import os
from itertools import accumulate
from typing import Any, Optional, Sequence

import torch

from pipeline.backends.flashinfer import rules
from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch, PlannedLayers
from pipeline.backends.flashinfer.jit import ensure_compiled, mla_backend, Variant, variants_for
from pipeline.backends.memory import is_fp8, layer_kv_scales
from pipeline.backends.packages import install_hint
from pipeline.backends.speculative import check_draft_batch, check_verify_batch, draft_token_table, full_mask_rows
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import BackendUnavailable, CapabilityMismatch, ConfigError


try:  # triton is optional: torch CUDA wheels ship it, the CPU CI installs it for the interpreter
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def host_page_meta(seq_lens: Sequence[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_indptr [B+1] int32 CPU, last_page_len [B] int32 CPU, total pages) for ``seq_lens`` tokens (each >= 1); pure
    Python up to 64 requests, torch CPU ops above."""
    if page_size < 1:
        raise ValueError(f"page_size={page_size}: must be >= 1 (the KV pool's page size)")
    if seq_lens and min(seq_lens) < 1:
        raise ValueError(f"seq_lens has {min(seq_lens)}: every request holds >= 1 token after the step "
                         "(padded CUDA-graph slots use seq_len 1); fix the batch's seq_lens_cpu")
    ps, b = page_size, len(seq_lens)
    if b > 64:  # torch ops cost the same at any B; Python costs ~1 µs per request on a slow host
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        npages = (seq + (ps - 1)) // ps
        meta = torch.empty(2 * b + 1, dtype=torch.int32)
        meta[0] = 0
        torch.cumsum(npages, 0, out=meta[1: b + 1])
        torch.sub(seq, (npages - 1) * ps, out=meta[b + 1:])
        return meta[: b + 1], meta[b + 1:], int(meta[b])
    npages = [(s + ps - 1) // ps for s in seq_lens]
    indptr = [0, *accumulate(npages)]
    meta = torch.tensor(indptr + [s - (n - 1) * ps for s, n in zip(seq_lens, npages)], dtype=torch.int32)
    return meta[: b + 1], meta[b + 1:], indptr[-1]


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # triton.jit fixes its mode at decoration, as here

if triton is not None:
    # Alignment and strides not specialized: slices at any offset (a TBO child's half) reuse the build's kernel.
    _NO_SPEC = ["req_pool_indices", "seq_lens", "out", "stride_row", "stride_rpi", "stride_sl", "total"]
    _jit_kw = {"do_not_specialize": _NO_SPEC}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        _jit_kw["do_not_specialize_on_alignment"] = ["req_pool_indices", "seq_lens", "out"]

    @triton.jit(**_jit_kw)
    def _kv_indices_kernel(req_to_token, stride_row, stride_col, req_pool_indices, stride_rpi, seq_lens, stride_sl,
                           out, total, page_size, BLOCK: tl.constexpr):
        # one program per request r, writing from the page count of requests 0..r-1 (one kernel for every B); stores
        # masked to the host's page total
        r = tl.program_id(0)
        c = tl.program_id(1)  # this program's share of request r's pages: chunks c, c + nc, c + 2 nc, ...
        nc = tl.num_programs(1)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for i0 in range(0, r, BLOCK):
            i = i0 + offs
            lens = tl.load(seq_lens + i * stride_sl, mask=i < r, other=0).to(tl.int64)
            acc += (lens + page_size - 1) // page_size
        start = tl.sum(acc, axis=0)
        n = (tl.load(seq_lens + r * stride_sl).to(tl.int64) + page_size - 1) // page_size
        row = tl.load(req_pool_indices + r * stride_rpi).to(tl.int64)
        src = req_to_token + row * stride_row
        for p0 in range(c * BLOCK, n, nc * BLOCK):
            p = p0 + offs
            m = (p < n) & (start + p < total)
            slot = tl.load(src + p * page_size * stride_col, mask=m, other=0)
            tl.store(out + start + p, (slot // page_size).to(tl.int32), mask=m)


def _use_triton(device: torch.device) -> bool:
    """Triton where it runs: compiled on CUDA, interpreted on CPU under ``TRITON_INTERPRET=1`` (set before import)."""
    if triton is None:
        return False
    return (device.type == "cuda" and not _INTERPRETED) or (device.type == "cpu" and _INTERPRETED)


def gather_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      total_pages: int, page_size: int, out: Optional[torch.Tensor] = None,
                      impl: str = "auto") -> torch.Tensor:
    """Page ids of a batch, gathered from ``req_to_token`` on its device: [total_pages] int32.

    ``req_to_token`` [max_reqs, max_context_len] int32, ``req_pool_indices`` [B] int, ``seq_lens`` [B] int (>= 1, same
    device), ``total_pages`` = ``sum(ceil(seq_lens / page_size))``; ``out`` (int32, >= total_pages, e.g. a CUDA-graph
    buffer) is written in place. ``impl``: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton on CUDA or under
    ``TRITON_INTERPRET=1``). Rows and lengths are not checked (as in sglang); writes stop at ``total_pages``. Raises
    ValueError for a too small / non-contiguous / non-int32 ``out``, an unknown ``impl``, or Triton not runnable.
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r}: allowed 'auto', 'triton', 'torch'")
    dev = req_to_token.device
    if impl == "triton" and not _use_triton(dev):
        raise ValueError(f"impl='triton' cannot run on {dev.type}: " + (
            "triton is not installed; pip install triton" if triton is None else
            "Triton runs on CUDA, or on the CPU only when TRITON_INTERPRET=1 is set before triton is imported")
            + "; or use impl='auto' (torch ops where Triton cannot run)")
    exact = out is None
    if exact:
        out = torch.empty(total_pages, dtype=torch.int32, device=dev)
    elif out.numel() < total_pages:
        raise ValueError(f"out has {out.numel()} elements, the batch needs {total_pages} page ids")
    elif out.dtype != torch.int32 or out.device != dev or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 tensor on {dev} (FlashInfer's kv_indices), got "
                         f"{'a non-contiguous ' if not out.is_contiguous() else ''}{out.dtype} tensor on {out.device}; "
                         "pass a fresh torch.empty(n, dtype=torch.int32) or leave out=None")
    b = req_pool_indices.numel()
    if b == 0 or total_pages == 0:
        return out[:0]
    if impl == "triton" or (impl == "auto" and _use_triton(dev)):
        # spread long requests over several programs (the loads are latency-bound), at most 16 per request
        chunks = max(1, min(16, -(-total_pages // (b * 128))))
        _kv_indices_kernel[(b, chunks)](req_to_token, req_to_token.stride(0), req_to_token.stride(1), req_pool_indices,
                                 req_pool_indices.stride(0), seq_lens, seq_lens.stride(0), out, total_pages, page_size,
                                 BLOCK=128)
        return out if exact else out[:total_pages]
    lens = seq_lens.to(torch.int64)
    npages = (lens + page_size - 1) // page_size
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), npages, output_size=total_pages)
    starts = torch.cumsum(npages, 0) - npages
    col = torch.arange(total_pages, device=dev) - torch.repeat_interleave(starts, npages, output_size=total_pages)
    torch.floor_divide(req_to_token[rows, col * page_size], page_size, out=out[:total_pages])
    return out[:total_pages]


class GraphState:
    """Buffers for ``max_bs`` requests of up to ``max_context_len`` tokens, and wrappers per bs (all int32, pool's
    device).

    ``indptr`` [max_bs+1], ``indices`` [max_bs * ceil(max_context_len / page_size)], ``last_page_len`` [max_bs],
    ``qo_indptr`` [max_bs+1] (sink and MLA wrappers), ``kv_len`` [max_bs] (MLA). Speculative graphs add, per size:
    target verify — a paged prefill wrapper with its own ``qo_indptr``, ``custom_mask_buf`` and ``mask_indptr_buf``;
    draft decode — a token-level copy of the buffers for ``max_bs * topk`` rows (sglang's multi-step draft backend).
    """

    def __init__(self, backend: "FlashInferBackend", max_bs: int, max_num_tokens: int) -> None:
        self.backend = backend
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        pages = -(-backend.req_pool.max_context_len // backend.page_size)
        self.decode = self._buffers(max_bs, max_bs * pages)
        self.indptr, self.indices, self.last_page_len = (self.decode[k] for k in ("indptr", "indices", "last"))
        self.qo_indptr, self.kv_len = self.decode["qo"], self.decode["kv_len"]
        self.verify: dict[str, torch.Tensor] = {}
        self.draft: dict[str, torch.Tensor] = {}
        self._by_bs: dict[tuple[str, int], list[tuple[Any, Any, str]]] = {}

    def _buffers(self, rows: int, indices: int) -> dict[str, torch.Tensor]:
        i32 = dict(dtype=torch.int32, device=self.backend.kv_pool.device)
        return {"indptr": torch.zeros(rows + 1, **i32), "indices": torch.zeros(indices, **i32),
                "last": torch.ones(rows, **i32), "qo": torch.arange(rows + 1, **i32), "kv_len": torch.ones(rows, **i32)}

    def buffers(self) -> list[torch.Tensor]:
        """The fixed-address tensors this state owns."""
        return [*self.decode.values(), *self.verify.values(), *self.draft.values()]

    def wrappers(self, bs: int) -> list[tuple["KindWrappers", Any, str]]:
        """(kind, wrapper, class) per layer kind for batch size ``bs`` (made on first use); class as in
        :meth:`~pipeline.backends.flashinfer.backend.KindWrappers.decode_wrapper`."""
        self._check_bs(bs)
        if ("decode", bs) not in self._by_bs:
            self._by_bs[("decode", bs)] = [self._make(kw, bs, self.decode) for kw in self.backend.kinds]
        return self._by_bs[("decode", bs)]

    def _check_bs(self, bs: int) -> None:
        if bs > self.max_bs:
            raise ConfigError(f"graph batch size {bs} exceeds the {self.max_bs} buffers were sized for",
                              flags=[("cuda_graph_max_bs", self.max_bs), ("bs", bs)],
                              remedy="raise cuda_graph_max_bs or capture a smaller batch")

    def verify_wrappers(self, bs: int, n: int) -> list[Any]:
        """One ``use_cuda_graph`` paged prefill wrapper per kind for a target verify of ``bs`` requests of ``n``
        tokens, with FlashInfer's custom-mask buffers."""
        self._check_bs(bs)
        if not self.verify:
            b, dev = self.backend, self.backend.kv_pool.device
            mask_bytes = self.max_bs * (-(-n * b.req_pool.max_context_len // 8) + 1)
            self.verify = {"qo": (torch.arange(self.max_bs + 1, dtype=torch.int32) * n).to(dev),
                           "mask": torch.zeros(mask_bytes, dtype=torch.uint8, device=dev),
                           "mask_indptr": torch.zeros(self.max_bs + 1, dtype=torch.int32, device=dev)}
        if ("verify", bs) not in self._by_bs:
            b, v = self.backend, self.verify
            self._by_bs[("verify", bs)] = [b.fi.BatchPrefillWithPagedKVCacheWrapper(
                b.workspace, "NHD", backend=b.prefill_backend, use_cuda_graph=True, qo_indptr_buf=v["qo"][: bs + 1],
                paged_kv_indptr_buf=self.indptr[: bs + 1], paged_kv_indices_buf=self.indices,
                paged_kv_last_page_len_buf=self.last_page_len[:bs], custom_mask_buf=v["mask"],
                mask_indptr_buf=v["mask_indptr"][: bs + 1]) for _ in b.kinds]
        return self._by_bs[("verify", bs)]

    def draft_wrappers(self, rows: int, max_rows: int) -> list[tuple["KindWrappers", Any, str]]:
        """(kind, wrapper, class) per kind for a draft decode of ``rows`` branch rows over the token-level buffers
        (made for ``max_rows`` at the first capture)."""
        if not self.draft:
            self.draft = self._buffers(max_rows, max_rows * self.backend.req_pool.max_context_len)
        if rows > self.draft["last"].numel():
            raise ConfigError(f"a draft decode of {rows} branch rows exceeds the {self.draft['last'].numel()} the "
                              "graph buffers were sized for", flags=[("rows", rows)],
                              remedy="capture the largest batch first (its buffers serve every smaller one)")
        if ("draft", rows) not in self._by_bs:
            self._by_bs[("draft", rows)] = [self._make(kw, rows, self.draft) for kw in self.backend.kinds]
        return self._by_bs[("draft", rows)]

    def _make(self, kw: "KindWrappers", bs: int, buf: dict[str, torch.Tensor]) -> tuple["KindWrappers", Any, str]:
        b, fi = self.backend, self.backend.fi
        if kw.mla:
            w = b.mla_wrapper(kw.mla_backend, use_cuda_graph=True, qo_indptr=buf["qo"][: bs + 1],
                              kv_indptr=buf["indptr"][: bs + 1], kv_indices=buf["indices"], kv_len_arr=buf["kv_len"][:bs])
            return kw, w, "mla"
        bufs = dict(paged_kv_indptr_buf=buf["indptr"][: bs + 1], paged_kv_indices_buf=buf["indices"],
                    paged_kv_last_page_len_buf=buf["last"][:bs])
        if kw.sinks:
            w = b.sink_wrapper(kw.kind, kw.window_left, use_cuda_graph=True, qo_indptr_buf=buf["qo"][: bs + 1], **bufs)
            return kw, w, "prefill"
        _, cls = kw.decode_wrapper(bs, b.kv_dtype_name)
        tc = kw.decode_cc is None or kw.decode_wrapper(bs, b.kv_dtype_name)[0] is kw.decode_tc
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            b.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
            backend=b.prefill_backend if tc else "auto",
            paged_kv_indptr_buffer=bufs["paged_kv_indptr_buf"], paged_kv_indices_buffer=buf["indices"],
            paged_kv_last_page_len_buffer=bufs["paged_kv_last_page_len_buf"])
        return kw, w, cls


PACKAGE = "flashinfer-python"
MLA_DIMS = (576, 512)  # the absorbed (qk, v) dims FlashInfer's MLA kernels are instantiated for (512 + 64 rope)


def import_flashinfer(name: str = "flashinfer") -> Any:
    """Import FlashInfer or raise :class:`BackendUnavailable` naming the package and the extra."""
    try:
        import flashinfer
    except ImportError as e:
        raise BackendUnavailable(
            f"backend {name!r} needs the {PACKAGE} package, which is not installed ({e})",
            flags=[("attention_backend", name)], allowed=["torch_native", "triton"],
            remedy=f"{install_hint(PACKAGE)} (attn-setup's cuda extra), or choose another backend",
        ) from e
    return flashinfer


class MLAWrappers:
    """The MLA wrapper of one absorbed-MLA layer kind (decode and extend): ``kind.head_dim_v`` is ``kv_lora_rank``,
    ``head_dim_qk - head_dim_v`` the rope dims; ``mla_backend`` ``fa3``/``fa2``."""

    mla = True
    sinks = False

    def __init__(self, fi: Any, kind: LayerKind, backend: "FlashInferBackend") -> None:
        self.kind = kind
        self.mla_backend = mla_backend(backend.ctx.device.arch or "")
        self.wrapper = backend.mla_wrapper(self.mla_backend)
        self.active: Any = self.wrapper
        self.mode = "mla"
        self.csr = fi.mla.MLAPlanMetadata.csr
        self.plan_kw = dict(num_heads=kind.num_heads, head_dim_ckv=kind.head_dim_v,
                            head_dim_kpe=kind.head_dim_qk - kind.head_dim_v, page_size=backend.page_size,
                            sm_scale=kind.scaling, q_data_type=backend.q_dtype, kv_data_type=backend.kv_dtype,
                            query_layout="split", kv_cache_layout="split")

    def decode_wrapper(self, batch_size: int, kv_dtype: str) -> tuple[Any, str]:
        """(wrapper, ``"mla"``): the one MLA wrapper serves decode at every batch size."""
        return self.wrapper, "mla"

    def plan(self, wrapper: Any, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_lens: torch.Tensor, causal: bool, page_size: Optional[int] = None) -> None:
        """``plan()`` an MLA wrapper (indptrs and kv lengths [B] int32 host, page ids on the device) in FlashInfer
        0.7.2's keyword form (``MLAPlanMetadata.csr``) with ``"split"`` (latent, rope) layouts."""
        kw = self.plan_kw if page_size is None else {**self.plan_kw, "page_size": page_size}
        wrapper.plan(metadata=self.csr(qo_indptr, kv_indptr, kv_indices, kv_lens), causal=causal, **kw)
        self.active, self.mode = wrapper, "mla"


class KindWrappers:
    """The wrappers and compile-time switches of one (non-MLA) layer kind."""

    mla = False

    def __init__(self, fi: Any, kind: LayerKind, backend: "FlashInferBackend") -> None:
        self.kind = kind
        self.window_left = kind.sliding_window - 1 if kind.sliding_window else -1
        self.softcap = kind.logit_softcap or None
        self.sinks = kind.has_sinks
        ws, pb = backend.workspace, backend.prefill_backend
        if self.sinks:
            self.paged = backend.sink_wrapper(kind, self.window_left)
            self.ragged = None
        else:
            self.paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=pb)
            self.ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=pb)
        self.decode_cc = None if self.sinks or pb == "fa3" else fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        self.decode_tc = None if self.sinks else fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=True, backend=pb)
        self.active: Any = None
        self.mode = "decode"
        self.plan_kw = dict(num_qo_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads, window_left=self.window_left,
                            logits_soft_cap=self.softcap, sm_scale=kind.scaling, q_data_type=backend.q_dtype,
                            kv_data_type=backend.kv_dtype)
        self.decode_kw = dict(head_dim=kind.head_dim_qk, page_size=backend.page_size, **self.plan_kw)

    def decode_wrapper(self, batch_size: int, kv_dtype: str) -> tuple[Any, str]:
        """(wrapper, class) used for decode at ``batch_size`` requests; class ``"prefill"`` (sink kinds:
        the prefill-class sink wrapper) or ``"decode"`` (CUDA-core or tensor-core decode wrapper)."""
        if self.sinks:
            return self.paged, "prefill"
        g = self.kind.num_heads // self.kind.num_kv_heads
        if self.decode_cc is None or rules.use_tensor_core_decode(g, batch_size, kv_dtype):
            return self.decode_tc, "decode"
        return self.decode_cc, "decode"


def _check_ctx(ctx: Any, prefill_backend: str) -> None:
    """Refuse, before allocating, what the backend cannot serve (device, arch, layout, a missing workspace)."""
    if ctx.device.type != "cuda":
        raise CapabilityMismatch(f"{ctx.name} runs on CUDA devices only", flags=[("device", ctx.device.type)],
                                 allowed=["cuda"], remedy="use torch_native on this device")
    if prefill_backend == "fa3" and ctx.device.arch != "sm90":
        raise CapabilityMismatch("fa3 kernels need an sm90 (Hopper) GPU", flags=[("compute_capability", ctx.device.arch)],
                                 allowed=["sm90"], remedy="set attention_backend='flashinfer' on this GPU")
    fp8 = is_fp8(ctx.kv_pool.dtype)
    if fp8 and prefill_backend == "fa3":  # its record lists no fp8 KV dtype
        raise CapabilityMismatch("FlashInfer's fa3 kernels do not compile for a bf16/fp16 q with an fp8 KV cache",
                                 flags=[("kv_cache_dtype", str(ctx.kv_pool.dtype))], allowed=["bfloat16", "float16"],
                                 remedy="set attention_backend='flashinfer' (fa2 kernels serve fp8 KV)")
    for k in ctx.layer_kinds:
        if k.is_mla and ((k.head_dim_qk, k.head_dim_v) != MLA_DIMS or k.num_kv_heads != 1):
            raise CapabilityMismatch(
                f"FlashInfer's MLA wrapper serves absorbed dims {MLA_DIMS[0]}/{MLA_DIMS[1]} with one latent head, "
                f"not {k.head_dim_qk}/{k.head_dim_v} with {k.num_kv_heads}", flags=[("head_dim_qk", k.head_dim_qk),
                                                                                ("head_dim_v", k.head_dim_v)],
                allowed=[f"{MLA_DIMS[0]}/{MLA_DIMS[1]}"], remedy="set attention_backend='torch_native' for this model")
        if fp8 and (k.is_mla or k.has_sinks or k.sliding_window is not None or k.logit_softcap is not None):
            what = "MLA" if k.is_mla else "sinks" if k.has_sinks else "window" if k.sliding_window else "softcap"
            raise CapabilityMismatch(
                f"{ctx.name} serves an fp8 KV cache for plain MHA/GQA layers only, not {what} layers "
                f"(layers {k.layer_ids})", flags=[("kv_cache_dtype", str(ctx.kv_pool.dtype)), ("layer_kind", k.kind)],
                allowed=["bfloat16", "float16"],
                remedy="set kv_cache_dtype='auto' (the model dtype), or attention_backend='torch_native'")
        if k.attention_chunk_size is not None:  # its record does not claim chunked_local_attention
            raise CapabilityMismatch(
                f"{ctx.name} has no chunked local attention (chunk {k.attention_chunk_size}, layers {k.layer_ids})",
                flags=[("attention_chunk_size", k.attention_chunk_size)], allowed=["triton", "torch_native"],
                remedy="use --attention-backend triton (or torch_native) for this model")
        if k.has_sinks and k.logit_softcap:
            raise CapabilityMismatch("FlashInfer's attention-sink kernel has no logit softcap",
                                     flags=[("logit_softcap", k.logit_softcap), ("has_sinks", True)],
                                     allowed=["sinks or softcap"], remedy="use torch_native for this model")
    if ctx.workspace is None or ctx.workspace.buffer is None:
        raise ConfigError(f"{ctx.name} needs a workspace from the pool", code="workspace_missing",
                          flags=[("flashinfer_workspace_size", None)], remedy="plan a shared or private workspace")
    if ctx.kv_pool.size % ctx.kv_pool.page_size:
        raise ConfigError("num_token_slots must be a multiple of page_size for the paged view",
                          flags=[("pool.num_token_slots", ctx.kv_pool.size), ("page_size", ctx.kv_pool.page_size)],
                          remedy="round num_token_slots to whole pages")


def _check_tree_kind(name: str, kw: Any) -> None:
    """Refuse a tree (target verify with a custom mask) on a kind its record does not serve it for (``tree_features``:
    FlashInfer's window counts KV indices, not tree positions; the sink and MLA wrappers take no custom mask)."""
    k = kw.kind
    what = "MLA" if kw.mla else "attention-sink" if k.has_sinks else "sliding-window" if k.sliding_window else None
    if what is not None:
        raise CapabilityMismatch(f"{name} cannot verify an EAGLE tree over {what} layers (layers {k.layer_ids})",
                                 flags=[("layer_kind", k.kind), ("forward_mode", "target_verify")],
                                 allowed=["MHA/GQA layers with or without softcap"],
                                 remedy="use --attention-backend triton (or torch_native), or --speculative-eagle-topk 1")


def _host_ints(host: Any, device: torch.Tensor) -> list[int]:
    """Host lengths as a list: ours are lists, sglang's ``seq_lens_cpu`` is a CPU tensor; read the
    device tensor (a sync) only when the engine gave none."""
    if host is None or len(host) == 0:
        return device.tolist()
    return host.tolist() if isinstance(host, torch.Tensor) else list(host)


class FlashInferBackend(AttentionBackend):
    """FlashInfer attention over the pool's paged KV cache (docs/internals.md): ``ctx`` a
    :class:`~pipeline.backends.registry.BackendContext` with a uint8 CUDA workspace; ``prefill_backend`` ``"fa2"`` (name
    ``flashinfer``) or ``"fa3"`` (name ``fa3``); output ``[T, H * Dv]`` in q's dtype."""

    def __init__(self, ctx: Any, prefill_backend: str = "fa2", *, heartbeat_s: float = 10.0) -> None:
        self.fi = import_flashinfer(ctx.name)
        self.name = ctx.name
        self.prefill_backend = prefill_backend
        self.ctx = ctx
        self.workspace = ctx.workspace.buffer
        self.kv_pool, self.req_pool = ctx.kv_pool, ctx.req_to_token_pool
        self.page_size = self.kv_pool.page_size
        self.q_dtype = getattr(torch, ctx.dtype)
        self.kv_dtype = self.kv_pool.dtype
        self.kv_dtype_name = str(self.kv_dtype).replace("torch.", "")
        self.fp8 = is_fp8(self.kv_dtype)
        cc = ctx.device.compute_capability
        self.enable_pdl = bool(cc and cc[0] >= 9)  # flashinfer.utils.device_support_pdl
        self.jit_report = [ensure_compiled(v, heartbeat_s=heartbeat_s) for v in self.variants()]
        self.kinds = [(MLAWrappers if k.is_mla else KindWrappers)(self.fi, k, self) for k in ctx.layer_kinds]
        self.layer_kind = {lid: i for i, k in enumerate(ctx.layer_kinds) for lid in k.layer_ids}
        self.planned = PlannedLayers(ctx.layer_kinds, backend=self.name, role=ctx.role)
        self._paged_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layer_info: dict[int, tuple] = {}
        self._decode_sel: dict[int, list] = {}
        self.graph: Optional[GraphState] = None
        self.extend_ragged = False
        # compile (or load from Triton's cache) the page-table gather now, not in the first forward batch
        self.page_table(torch.zeros(1, dtype=torch.int64, device=self.kv_pool.device), [1],
                        torch.ones(1, dtype=torch.int32, device=self.kv_pool.device))

    def variants(self) -> list[Variant]:
        """The kernel variants this backend uses (each checked/compiled before first use)."""
        return variants_for(self.ctx.layer_kinds, self.prefill_backend, str(self.q_dtype)[6:], self.kv_dtype_name,
                            self.ctx.device.arch or "")

    def mla_wrapper(self, mla_backend: str, **graph_bufs: Any) -> Any:
        """A :class:`flashinfer.mla.BatchMLAPagedAttentionWrapper` on the pool's workspace (``graph_bufs``:
        ``use_cuda_graph=True`` and its qo_indptr / kv_indptr / kv_indices / kv_len_arr buffers)."""
        return self.fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=mla_backend, **graph_bufs)

    def sink_wrapper(self, kind: LayerKind, window_left: int, **graph_bufs: Any) -> Any:
        """A paged prefill wrapper with the attention-sink variant for ``kind``, named by
        :func:`pipeline.backends.flashinfer.jit.sink_uri` (FlashInfer's own name omits head dims and KV dtype)."""
        from pipeline.backends.flashinfer.jit import Variant, sink_jit_args, torch_dtype_name

        v = Variant(kind="sink", backend=self.prefill_backend, q_dtype=torch_dtype_name(self.q_dtype),
                    kv_dtype=torch_dtype_name(self.kv_dtype), head_dim_qk=kind.head_dim_qk,
                    head_dim_vo=kind.head_dim_v, sliding_window=window_left >= 0)
        args, kw = sink_jit_args(v, self.fi)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.prefill_backend, jit_args=args, jit_kwargs=kw, **graph_bufs)

    # ------------------------------------------------------------------ planning: once per batch, outside graphs
    def page_table(self, req_pool_indices: torch.Tensor, seq_lens: list[int],
                   seq_lens_dev: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """(kv_indptr [B+1] int32 CPU, kv_indices [P] int32 device, last_page_len [B] int32 CPU) from host ``seq_lens``;
        ``seq_lens_dev`` on the pool's device (copied when absent); ``out``: a CUDA-graph buffer for the page ids."""
        r2t = self.req_pool.req_to_token
        indptr, last, total = host_page_meta(seq_lens, self.page_size)
        if not isinstance(seq_lens_dev, torch.Tensor) or seq_lens_dev.device != r2t.device:
            seq_lens_dev = torch.tensor(seq_lens, dtype=torch.int32).to(r2t.device, non_blocking=True)
        rows = req_pool_indices if req_pool_indices.device == r2t.device else req_pool_indices.to(r2t.device)
        indices = gather_kv_indices(r2t, rows, seq_lens_dev, total, self.page_size, out=out)
        return indptr, indices, last

    def plan_decode(self, kinds_wrappers: list[tuple[Any, Any, str]], req_pool_indices: torch.Tensor,
                    seq_lens: list[int], seq_lens_dev: Optional[torch.Tensor] = None,
                    indices_out: Optional[torch.Tensor] = None) -> None:
        """Plan every kind's decode wrapper for one batch, outside graphs; ``kinds_wrappers``: (kind wrappers, wrapper,
        class ``"decode"`` / ``"prefill"`` / ``"mla"``)."""
        indptr, indices, last = self.page_table(req_pool_indices, seq_lens, seq_lens_dev, indices_out)
        self.plan_decode_tables(kinds_wrappers, indptr, indices, last, seq_lens, self.page_size, "decode")

    def plan_decode_tables(self, kinds_wrappers: list[tuple[Any, Any, str]], indptr: torch.Tensor,
                           indices: torch.Tensor, last: torch.Tensor, kv_lens: list[int], page_size: int,
                           mode: str) -> None:
        """Plan the decode wrappers over a page table (``indptr`` [R+1] / ``last`` [R] int32 host, ``indices`` device);
        ``mode`` ``"decode"`` or ``"draft"`` (page-size-1 view, :meth:`token_kv`)."""
        qo = kv_lens_t = None
        for kw, w, cls in kinds_wrappers:
            k = kw.kind
            if cls == "decode":
                w.plan(indptr=indptr, indices=indices, last_page_len=last, **{**kw.decode_kw, "page_size": page_size})
                kw.active, kw.mode = w, mode
                continue
            qo = torch.arange(len(kv_lens) + 1, dtype=torch.int32) if qo is None else qo
            if cls == "mla":
                kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32) if kv_lens_t is None else kv_lens_t
                kw.plan(w, qo, indptr, indices, kv_lens_t, causal=False, page_size=page_size)
                if mode == "draft":  # read through the page-size-1 view
                    kw.mode = mode
                continue
            w.plan(qo_indptr=qo, paged_kv_indptr=indptr, paged_kv_indices=indices, paged_kv_last_page_len=last,
                   head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v, page_size=page_size, causal=False,
                   **kw.plan_kw)
            kw.active, kw.mode = w, mode

    def draft_tables(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_host: list[int],
                     spec_info: Any, indices_out: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """A draft decode's token-level page table (indptr [R+1], indices int32 on the device, last [R] all 1, kv lens),
        R = B * topk rows, page size 1 (:func:`draft_token_table`); ``seq_lens`` / ``seq_host``: committed prefixes."""
        slots = spec_info.draft_slots
        r2t = self.req_pool.req_to_token
        topk, s1 = slots.shape[1], slots.shape[2]
        lens = [s + s1 for s in seq_host for _ in range(topk)]
        if max(lens, default=0) > r2t.shape[1]:
            raise ConfigError(f"a draft branch reaches {max(lens)} tokens, req_to_token holds {r2t.shape[1]}",
                              code="invalid_value", flags=[("max_context_len", r2t.shape[1])],
                              remedy="size max_context_len for the prefix and the draft tokens")
        table, lens_dev = draft_token_table(r2t, req_pool_indices, seq_lens, slots, r2t.shape[1])
        rows = len(lens)
        indptr = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
        indices = gather_kv_indices(table, torch.arange(rows, device=table.device), lens_dev, int(indptr[-1]), 1,
                                    out=indices_out)
        return indptr, indices, torch.ones(rows, dtype=torch.int32), lens

    def plan_draft_decode(self, fb: ForwardBatch) -> None:
        """Plan a draft decode (B * topk branch rows) on each kind's decode wrapper for that many rows."""
        check_draft_batch(fb.spec_info, fb.batch_size, fb.num_tokens)
        indptr, indices, last, lens = self.draft_tables(fb.req_pool_indices, fb.seq_lens,
                                                        _host_ints(fb.seq_lens_cpu, fb.seq_lens), fb.spec_info)
        sel = [(kw, *kw.decode_wrapper(len(lens), self.kv_dtype_name)) for kw in self.kinds]
        self.plan_decode_tables(sel, indptr, indices, last, lens, 1, "draft")

    def plan_verify(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, prefix: list[int],
                    new: list[int], spec_info: Any, wrappers: Optional[list[Any]] = None,
                    indices_out: Optional[torch.Tensor] = None) -> None:
        """Plan a target verify of EAGLE trees (``new[b]`` tokens after ``prefix[b]``) with FlashInfer's custom mask,
        per request ``[n, prefix + n]`` bits (sglang's ``FULL_MASK``)."""
        spec = check_verify_batch(spec_info, prefix, new)
        dev = self.kv_pool.device
        indptr, indices, last = self.page_table(req_pool_indices, [p + e for p, e in zip(prefix, new)], seq_lens,
                                                indices_out)
        qo = torch.tensor([0, *accumulate(new)], dtype=torch.int32)
        mask = full_mask_rows(spec, prefix).to(dev)
        for i, kw in enumerate(self.kinds):
            _check_tree_kind(self.name, kw)
            w = kw.paged if wrappers is None else wrappers[i]
            w.plan(qo_indptr=qo.to(dev), paged_kv_indptr=indptr.to(dev), paged_kv_indices=indices,
                   paged_kv_last_page_len=last.to(dev), page_size=self.page_size, head_dim_qk=kw.kind.head_dim_qk,
                   head_dim_vo=kw.kind.head_dim_v, causal=False, custom_mask=mask, **kw.plan_kw)
            kw.active, kw.mode = w, "paged"

    def plan_extend(self, fb: ForwardBatch) -> None:
        """Plan every kind for an extend batch (ragged if no request has a cached prefix)."""
        ext = _host_ints(fb.extend_seq_lens_cpu, fb.extend_seq_lens)
        pre = _host_ints(fb.extend_prefix_lens_cpu, fb.extend_prefix_lens)
        qo = torch.zeros(len(ext) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(ext, dtype=torch.int32), 0, out=qo[1:])
        # an fp8 cache is read back as stored (paged) for the new tokens too, never from the ragged k/v
        self.extend_ragged = not any(pre) and not self.fp8
        paged_args = None
        seq = [p + e for p, e in zip(pre, ext)]
        for kw in self.kinds:
            k = kw.kind
            if not kw.mla and self.extend_ragged and kw.ragged is not None:
                kw.ragged.plan(qo_indptr=qo, kv_indptr=qo, head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v,
                               causal=True, **kw.plan_kw)
                kw.active, kw.mode = kw.ragged, "ragged"
                continue
            if paged_args is None:
                paged_args = self.page_table(fb.req_pool_indices, seq, fb.seq_lens)
            indptr, indices, last = paged_args
            if kw.mla:
                kw.plan(kw.wrapper, qo, indptr, indices, torch.tensor(seq, dtype=torch.int32), causal=True)
                continue
            dims = dict(head_dim_qk=k.head_dim_qk, head_dim_vo=k.head_dim_v, causal=True, **kw.plan_kw)
            kw.paged.plan(qo_indptr=qo, paged_kv_indptr=indptr, paged_kv_indices=indices,
                          paged_kv_last_page_len=last, page_size=self.page_size, **dims)
            kw.active, kw.mode = kw.paged, "paged"

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan the batch once (host metadata + page ids); the layers then only ``run()``. Target verify of a tree:
        :meth:`plan_verify` (a chain is planned as the causal extend it is); draft decode: :meth:`plan_draft_decode`."""
        fb = forward_batch
        pre = _host_ints(fb.extend_prefix_lens_cpu, fb.extend_prefix_lens) if fb.is_target_verify() else []
        new = _host_ints(fb.extend_seq_lens_cpu, fb.extend_seq_lens) if fb.is_target_verify() else []
        if fb.is_draft_decode():
            self.plan_draft_decode(fb)
        elif fb.is_target_verify() and not check_verify_batch(fb.spec_info, pre, new).is_chain():
            self.plan_verify(fb.req_pool_indices, fb.seq_lens, pre, new, fb.spec_info)
        elif fb.is_decode():
            seq = _host_ints(fb.seq_lens_cpu, fb.seq_lens)
            sel = self._decode_sel.get(len(seq))
            if sel is None:  # the wrapper choice depends on the batch size only
                sel = self._decode_sel[len(seq)] = [(kw, *kw.decode_wrapper(len(seq), self.kv_dtype_name))
                                                    for kw in self.kinds]
            self.plan_decode(sel, fb.req_pool_indices, seq, fb.seq_lens)
        else:
            self.plan_extend(fb)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the fixed indptr / indices / last-page-len buffers for ``max_bs`` requests."""
        self.graph = GraphState(self, max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        """Build (once per ``bs``) the ``use_cuda_graph=True`` wrappers and plan them for capture."""
        self._graph_plan(bs, req_pool_indices, seq_lens, seq_lens[:bs].tolist(), forward_mode, spec_info)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu=None) -> None:
        """Re-plan the ``bs`` graph wrappers for the new lengths (outside the graph) before replay."""
        seq = (seq_lens_cpu[:bs] if seq_lens_cpu is not None else seq_lens[:bs]).tolist()
        self._graph_plan(bs, req_pool_indices, seq_lens, seq, forward_mode, spec_info)

    def _graph_plan(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq: list[int],
                    forward_mode: ForwardMode, spec_info: Any) -> None:
        """Plan the ``bs`` graph wrappers of ``forward_mode``: decode; target verify of ``num_draft_tokens`` (n) per
        request (prefix ``seq - n``; always with a custom mask: a wrapper made with ``custom_mask_buf`` reads it at
        every run, as sglang notes); draft decode of ``bs * topk`` rows over the token-level buffers."""
        self._require_graph(forward_mode)
        rpi, lens = req_pool_indices[:bs], seq_lens[:bs]
        if forward_mode is ForwardMode.TARGET_VERIFY:
            n = spec_info.num_draft_tokens
            self.plan_verify(rpi, lens, [s - n for s in seq], [n] * bs, spec_info,
                             self.graph.verify_wrappers(bs, n), self.graph.indices)
        elif forward_mode is ForwardMode.DRAFT_DECODE:
            rows = bs * spec_info.topk
            wrappers = self.graph.draft_wrappers(rows, self.graph.max_bs * spec_info.topk)
            indptr, indices, last, kv = self.draft_tables(rpi, lens, seq, spec_info, self.graph.draft["indices"])
            self.plan_decode_tables(wrappers, indptr, indices, last, kv, 1, "draft")
        else:
            self.plan_decode(self.graph.wrappers(bs), rpi, seq, lens, self.graph.indices)

    def _require_graph(self, forward_mode: ForwardMode) -> None:
        if self.graph is None:
            raise ConfigError("init_cuda_graph_state was not called before capture/replay", code="out_of_order",
                              remedy="call init_cuda_graph_state(max_bs, max_num_tokens) first")
        if forward_mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE):
            raise CapabilityMismatch(f"{self.name} captures decode, target-verify and draft-decode batches only",
                                     flags=[("forward_mode", forward_mode.value)],
                                     allowed=["decode", "target_verify", "draft_decode"],
                                     remedy="run extend batches eagerly")

    # ------------------------------------------------------------------ forward
    def paged_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K/V buffers viewed as ``[num_pages, page_size, Hkv, D]`` (no copy)."""
        if layer_id not in self._paged_views:
            kb, vb = self.kv_pool.get_key_buffer(layer_id), self.kv_pool.get_value_buffer(layer_id)
            ps = self.page_size
            self._paged_views[layer_id] = (kb.view(-1, ps, *kb.shape[1:]), vb.view(-1, ps, *vb.shape[1:]))
        return self._paged_views[layer_id]

    def token_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K/V as pages of one token (``[num_token_slots, 1, Hkv, D]``; MLA: its ``c_kv`` and
        ``k_rope`` slices, ``[num_token_slots, 1, *]``): what a draft decode's token-level page table indexes."""
        key = ("token", layer_id)
        if key not in self._paged_views:
            kb, vb = self.kv_pool.get_key_buffer(layer_id), self.kv_pool.get_value_buffer(layer_id)
            kind = self.kinds[self.layer_kind[layer_id]]
            if kind.mla:
                lat, dv = kb.view(-1, 1, kb.shape[-1]), kind.kind.head_dim_v
                self._paged_views[key] = (lat[..., :dv], lat[..., dv:])
            else:
                self._paged_views[key] = (kb.view(-1, 1, *kb.shape[1:]), vb.view(-1, 1, *vb.shape[1:]))
        return self._paged_views[key]

    def mla_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An MLA layer's ``c_kv`` [num_pages, page_size, Dv] and ``k_rope`` [num_pages, page_size, D - Dv]:
        two strided slices (no copy) of its one latent buffer [num_token_slots, 1, D]."""
        if layer_id not in self._paged_views:
            kb = self.kv_pool.get_key_buffer(layer_id)
            lat = kb.view(-1, self.page_size, kb.shape[-1])
            dv = self.kinds[self.layer_kind[layer_id]].kind.head_dim_v
            self._paged_views[layer_id] = (lat[..., :dv], lat[..., dv:])
        return self._paged_views[layer_id]

    def _layer(self, layer: AttentionLayer) -> tuple:
        """(layer, kind wrappers, paged K/V, H, D, H*Dv, run kwargs, Dv) of ``layer``, checked against the plan on first
        use. Raises ``LayerMismatch`` (:class:`PlannedLayers`) for an unplanned layer or other geometry; run kwargs
        carry ``k_scale``/``v_scale`` of an fp8 cache whose scales are not 1."""
        self.planned.check(layer)
        kw = self.kinds[self.layer_kind[layer.layer_id]]
        kv = self.mla_kv(layer.layer_id) if kw.mla else self.paged_kv(layer.layer_id)
        ks, vs = layer_kv_scales(self.kv_pool, layer.layer_id) if self.fp8 else (1.0, 1.0)
        run_kw = {"k_scale": ks, "v_scale": vs} if (ks, vs) != (1.0, 1.0) else {}
        info = (layer, kw, kv, layer.num_heads, layer.head_dim, layer.num_heads * layer.v_head_dim, run_kw,
                layer.v_head_dim)
        self._layer_info[layer.layer_id] = info
        return info

    def _run(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        info = self._layer_info.get(layer.layer_id)
        if info is None or info[0] is not layer:
            info = self._layer(layer)
        _, kw, kv, h, d, hdv, run_kw, dv = info
        if save_kv_cache and k is not None:
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        if kw.mode == "draft":
            kv = self.token_kv(layer.layer_id)
        q3 = q if q.dim() == 3 else q.reshape(-1, h, d)
        if kw.mla:
            return self._run_mla(kw, q3, kv, h, dv).view(-1, hdv)
        if kw.mode == "ragged":
            o = kw.active.run(q3, k.reshape(-1, layer.num_kv_heads, d), v.reshape(-1, layer.num_kv_heads, layer.v_head_dim))
        elif kw.sinks:
            o = kw.active.run(q3, kv, layer.sinks.float(), layer.scaling)
        else:
            o = kw.active.run(q3, kv, **run_kw)
        return o.view(-1, hdv)

    @staticmethod
    def _run_mla(kw: MLAWrappers, q3: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], h: int,
                 dv: int) -> torch.Tensor:
        """One MLA layer: q [T, H, D] split into latent (Dv) and rope views → out [T, H, Dv], in 0.7.2's
        ``query=``/``kv_cache=`` form."""
        out = torch.empty((q3.shape[0], h, dv), dtype=q3.dtype, device=q3.device)
        kw.active.run(query=(q3[..., :dv], q3[..., dv:]), kv_cache=kv, out=out)
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Extend: causal attention of the new tokens over prefix + new (planned wrapper)."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Decode: one token per request over its (windowed) cached context; the common case is one dict lookup and
        ``run``."""
        info = self._layer_info.get(layer.layer_id)
        if info is None or info[0] is not layer:  # first call with this layer object: checked against the plan
            info = self._layer(layer)
        _, kw, kv, h, d, hdv, run_kw, dv = info
        if save_kv_cache and k is not None:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if kw.mode == "draft":
            return self._run(q, None, None, layer, forward_batch, False)
        if kw.mla:
            return self._run_mla(kw, q if q.dim() == 3 else q.view(-1, h, d), kv, h, dv).view(-1, hdv)
        if kw.sinks:
            return self._run(q, None, None, layer, forward_batch, False)
        return kw.active.run(q if q.dim() == 3 else q.view(-1, h, d), kv, enable_pdl=self.enable_pdl,
                             **run_kw).view(-1, hdv)

    def owned_buffers(self) -> list[Any]:
        return self.graph.buffers() if self.graph is not None else []

    def close(self) -> None:
        """Drop wrappers, graph state and every reference to the pool and workspace tensors (idempotent)."""
        self.kinds, self.graph, self._paged_views, self._layer_info, self._decode_sel = [], None, {}, {}, {}
        self.workspace = self.kv_pool = self.req_pool = self.ctx = None


def create(ctx: Any) -> FlashInferBackend:
    """Factory of the ``flashinfer`` backend (FA2 prefill, CUDA-core / tensor-core decode)."""
    import_flashinfer(ctx.name)
    _check_ctx(ctx, "fa2")
    return FlashInferBackend(ctx, "fa2")


def create_fa3(ctx: Any) -> FlashInferBackend:
    """Factory of the ``fa3`` backend (FlashInfer's sm90 fa3 kernels for extend and decode)."""
    import_flashinfer(ctx.name)
    _check_ctx(ctx, "fa3")
    return FlashInferBackend(ctx, "fa3")

