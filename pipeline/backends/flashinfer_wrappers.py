"""The FlashInfer objects one backend instance holds per layer kind — :class:`KindWrappers` (paged / ragged prefill,
CUDA-core and tensor-core decode, or the attention-sink wrapper) and :class:`MLAWrappers` (the one MLA wrapper) —,
the import that names the missing package, and the checks that refuse, before anything is allocated, a context
FlashInfer cannot serve. The backend itself is :mod:`pipeline.backends.flashinfer` (import from there).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.backends import flashinfer_sizing as sizing
from pipeline.backends.memory import is_fp8
from pipeline.backends.packages import install_hint
from pipeline.core.contracts import LayerKind
from pipeline.core.errors import BackendUnavailable, CapabilityMismatch, ConfigError

_Backend = Any  # the FlashInferBackend (pipeline.backends.flashinfer) that builds these; not imported: it imports us


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
    """The MLA wrapper of one absorbed-MLA layer kind (decode and extend; see the module docstring).

    ``kind.head_dim_v`` is ``kv_lora_rank`` (``head_dim_ckv``); ``head_dim_qk - head_dim_v`` the
    rope dims (``head_dim_kpe``). ``mla_backend``: FlashInfer's MLA backend, ``fa3`` or ``fa2``.
    """

    mla = True
    sinks = False

    def __init__(self, fi: Any, kind: LayerKind, backend: "_Backend") -> None:
        self.kind = kind
        self.mla_backend = sizing.mla_backend(backend.ctx.device.arch or "")
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
             kv_lens: torch.Tensor, causal: bool) -> None:
        """``plan()`` an MLA wrapper: indptrs and kv lengths [B] int32 on the host, page ids on the device.

        FlashInfer 0.7.2's canonical form (keywords only, ``metadata=MLAPlanMetadata.csr(...)``): the flat and
        positional forms are deprecated there. The layouts are declared ``"split"`` — ``run()`` gets q as
        (latent, rope) views and the cache as (``c_kv``, ``k_rope``) views of the one latent buffer, the tensors
        0.6.13's ``run(q_nope, q_pe, ckv, kpe)`` took — where the canonical form would default to ``"packed"``.
        """
        wrapper.plan(metadata=self.csr(qo_indptr, kv_indptr, kv_indices, kv_lens), causal=causal, **self.plan_kw)
        self.active, self.mode = wrapper, "mla"


class KindWrappers:
    """The wrappers and compile-time switches of one (non-MLA) layer kind."""

    mla = False

    def __init__(self, fi: Any, kind: LayerKind, backend: "_Backend") -> None:
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
        if self.decode_cc is None or sizing.use_tensor_core_decode(g, batch_size, kv_dtype):
            return self.decode_tc, "decode"
        return self.decode_cc, "decode"


def _check_ctx(ctx: Any, prefill_backend: str) -> None:
    """Refuse, before allocating, what the backend cannot serve (device, arch, layout, a missing workspace).

    The workspace's size is checked once, in build-mode, through the registry entry
    (:mod:`pipeline.backends.flashinfer_rules`), before anything is allocated.
    """
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
