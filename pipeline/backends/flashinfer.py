"""The ``flashinfer`` and ``fa3`` backends: FlashInfer wrappers over the paged KV cache.

One backend instance serves every layer kind of the model (full / sliding, with or without softcap
or sinks); each kind has its own wrappers because FlashInfer compiles window and softcap in. A call
whose layer differs from its planned kind (window, softcap, scale, sinks, heads, dims) or whose layer
id was not planned raises ``LayerMismatch`` on its first call
(:class:`~pipeline.backends.base.PlannedLayers`) instead of computing with the planned values.

- **extend**: :class:`flashinfer.BatchPrefillWithRaggedKVCacheWrapper` on the new K/V when no
  request has a cached prefix, else :class:`flashinfer.BatchPrefillWithPagedKVCacheWrapper` over
  prefix + new tokens; causal, bottom-right aligned (FlashInfer's convention).
- **decode**: :class:`flashinfer.BatchDecodeWithPagedKVCacheWrapper`, on CUDA cores or on the
  prefill (tensor-core) kernel per :func:`~pipeline.backends.flashinfer_sizing.use_tensor_core_decode`.
- **sinks**: FlashInfer's attention-sink variant, as :class:`flashinfer.BatchAttentionWithAttentionSinkWrapper`
  builds it (the only fa2/fa3 path that honours sinks in 0.7.2: the plain wrappers' ``run(sinks=)`` reaches the
  trtllm-gen and cuDNN kernels only), under our own module name (:meth:`FlashInferBackend.sink_wrapper`).
- **MLA** (absorbed; one latent head of ``kv_lora_rank + rope`` = 576 dims, v = the first 512):
  :class:`flashinfer.mla.BatchMLAPagedAttentionWrapper` for decode (``causal=False``, one query per
  request) *and* for every extend (``causal=True``, bottom-right aligned, over prefix + new tokens),
  with ``backend="fa3"`` on sm90 and ``"fa2"`` elsewhere (:func:`~pipeline.backends.flashinfer_sizing.mla_backend`).
  An extend without a cached prefix also uses the paged MLA wrapper, not the ragged prefill path:
  the backend receives the *absorbed* q and the latent K (sglang's contract for MLA backends), and
  the new tokens' latents are already in the pool when the layer runs, so the paged wrapper sees
  them; the ragged path would need the un-absorbed per-head K/V (192/128 dims), which this
  interface never receives (sglang's flashinfer_mla backend builds those in its model code). ``c_kv``
  and ``k_rope`` are passed as two strided slices of the one latent buffer, q as two slices of q.
- **fp8 KV** (``float8_e4m3fn`` / ``float8_e5m2``, bf16/fp16 q, plain MHA/GQA kinds): the pool
  stores ``fp8(x / scale)`` (:mod:`pipeline.backends.memory`); ``run()`` gets the layer's ``k_scale`` and
  ``v_scale`` (FlashInfer multiplies the softmax scale by ``k_scale`` and the output by ``v_scale``).
  Decode runs on CUDA cores or tensor cores per
  :data:`~pipeline.backends.flashinfer_sizing.FP8_DECODE_PATH` (measured); every extend runs the
  paged prefill wrapper, so that new tokens are read back as stored (fp8) like the prefix, never
  at full precision from the ragged path.
- ``fa3``: the same, with ``backend="fa3"`` (sm90 kernels) for extend *and* decode (no MLA, no fp8).

``plan()`` runs once per forward batch in :meth:`init_forward_metadata` (keyword arguments,
CPU-side indptr / last-page-len, page ids gathered on the device by one kernel, see
:mod:`pipeline.backends.kv_indices`); ``run()`` once per layer.
Paged layout: the pool's ``[num_token_slots, Hkv, D]`` buffer viewed as
``[num_pages, page_size, Hkv, D]`` is FlashInfer's ``NHD`` paged cache; the page ids of request r
are ``req_to_token[r, ::page_size] // page_size``. Sliding window W (key j visible from query i
iff ``0 <= i - j < W``) is FlashInfer's ``window_left = W - 1``. The float workspace is the
pool's (``ctx.workspace``); the backend never allocates its own.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch, PlannedLayers
from pipeline.backends.flashinfer_graph import GraphState
from pipeline.backends.flashinfer_plan import FlashInferPlanning, _host_ints
from pipeline.backends.flashinfer_wrappers import (  # noqa: F401 (re-exported: this module held them)
    MLA_DIMS, PACKAGE, KindWrappers, MLAWrappers, _check_ctx, import_flashinfer,
)
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.backends.kv_indices import gather_kv_indices, host_page_meta  # noqa: F401 (as before the split)
from pipeline.core.errors import BackendUnavailable, CapabilityMismatch, ConfigError  # noqa: F401
from pipeline.backends.flashinfer_jit import Variant, ensure_compiled, variants_for
from pipeline.backends.memory import is_fp8, layer_kv_scales


class FlashInferBackend(FlashInferPlanning, AttentionBackend):
    """FlashInfer attention over the pool's paged KV cache (see the module docstring).

    Parameters: ``ctx`` (:class:`~pipeline.backends.registry.BackendContext`; its workspace
    buffer must be a uint8 CUDA tensor of at least the bytes :func:`sizing.workspace_need` gives),
    ``prefill_backend`` ``"fa2"`` (name ``flashinfer``) or ``"fa3"`` (name ``fa3``).
    Forward shapes follow :mod:`pipeline.backends.base`; output ``[T, H * Dv]`` in q's dtype.
    """

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
        """A paged prefill wrapper running FlashInfer's attention-sink variant for ``kind``.

        Built as :class:`flashinfer.BatchAttentionWithAttentionSinkWrapper` builds it (the prefill wrapper with the
        ``AttentionSink`` variant's ``jit_args``), but under a module name that includes the head dims and the KV
        dtype (:func:`pipeline.backends.flashinfer_jit.sink_uri`): FlashInfer's own name (0.6.13, and 0.7.2) omits
        them, so two sink kinds of different head dims in one process or JIT cache would share one kernel and all but
        the first compute garbage.
        """
        from pipeline.backends.flashinfer_jit import Variant, sink_jit_args, torch_dtype_name

        v = Variant(kind="sink", backend=self.prefill_backend, q_dtype=torch_dtype_name(self.q_dtype),
                    kv_dtype=torch_dtype_name(self.kv_dtype), head_dim_qk=kind.head_dim_qk,
                    head_dim_vo=kind.head_dim_v, sliding_window=window_left >= 0)
        args, kw = sink_jit_args(v, self.fi)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.prefill_backend, jit_args=args, jit_kwargs=kw, **graph_bufs)

    # ------------------------------------------------------------------ planning (the rest: FlashInferPlanning)
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan the batch once (host metadata + page ids); the layers then only ``run()``."""
        fb = forward_batch
        if fb.is_decode():
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
        self._require_graph(forward_mode)
        self.plan_decode(self.graph.wrappers(bs), req_pool_indices[:bs], seq_lens[:bs].tolist(), seq_lens[:bs],
                         self.graph.indices)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu=None) -> None:
        """Re-plan the ``bs`` graph wrappers for the new lengths (outside the graph) before replay."""
        self._require_graph(forward_mode)
        seq = (seq_lens_cpu[:bs] if seq_lens_cpu is not None else seq_lens[:bs]).tolist()
        self.plan_decode(self.graph.wrappers(bs), req_pool_indices[:bs], seq, seq_lens[:bs], self.graph.indices)

    def _require_graph(self, forward_mode: ForwardMode) -> None:
        if self.graph is None:
            raise ConfigError("init_cuda_graph_state was not called before capture/replay", code="out_of_order",
                              remedy="call init_cuda_graph_state(max_bs, max_num_tokens) first")
        if forward_mode is not ForwardMode.DECODE:
            raise CapabilityMismatch(f"{self.name} captures decode batches only", flags=[("forward_mode", forward_mode.value)],
                                     allowed=["decode"], remedy="run extend batches eagerly")

    # ------------------------------------------------------------------ forward
    def paged_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K/V buffers viewed as ``[num_pages, page_size, Hkv, D]`` (no copy)."""
        if layer_id not in self._paged_views:
            kb, vb = self.kv_pool.get_key_buffer(layer_id), self.kv_pool.get_value_buffer(layer_id)
            ps = self.page_size
            self._paged_views[layer_id] = (kb.view(-1, ps, *kb.shape[1:]), vb.view(-1, ps, *vb.shape[1:]))
        return self._paged_views[layer_id]

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
        """(layer, kind wrappers, paged K/V, H, D, H*Dv, run kwargs, Dv) of ``layer``, made on the first call
        with this layer object after checking it against the plan (:class:`PlannedLayers`: ``LayerMismatch``
        for a window, softcap, scale, sinks, heads or dims other than the planned wrappers', or an unplanned
        layer id). The run kwargs carry the layer's ``k_scale``/``v_scale`` for an fp8 cache whose scales
        are not 1 (read once from the pool: they are fixed for its life)."""
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
        """One MLA layer: q [T, H, D] split into its latent (Dv) and rope parts (views) → out [T, H, Dv].

        FlashInfer 0.7.2's structural form (``query=``/``kv_cache=`` split pairs, as planned), not the deprecated
        separate ``q_nope, q_pe, ckv_cache, kpe_cache`` arguments."""
        out = torch.empty((q3.shape[0], h, dv), dtype=q3.dtype, device=q3.device)
        kw.active.run(query=(q3[..., :dv], q3[..., dv:]), kv_cache=kv, out=out)
        return out

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Extend: causal attention of the new tokens over prefix + new (planned wrapper)."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """Decode: one token per request over its whole (or windowed) cached context.

        The common case (no sinks, no MLA) is kept to one dict lookup (whose entry remembers the layer
        object checked against the plan on its first call), the q/o views and FlashInfer's
        ``run``: an eager small-batch decode step is bound by host time. ``enable_pdl`` is passed
        as decided at build (FlashInfer's own default, ``device_support_pdl``: sm90 and newer)
        instead of being recomputed from ``q.device`` in every call.
        """
        info = self._layer_info.get(layer.layer_id)
        if info is None or info[0] is not layer:  # first call with this layer object: checked against the plan
            info = self._layer(layer)
        _, kw, kv, h, d, hdv, run_kw, dv = info
        if save_kv_cache and k is not None:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
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
