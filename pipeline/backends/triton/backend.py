"""``TritonAttnBackend``: sglang's AttentionBackend over our own Triton kernels and the paged KV cache
(docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch, PlannedLayers
from pipeline.backends.memory import quantize_kv
from pipeline.backends.speculative import (check_draft_batch, check_verify_batch, draft_token_table, tree_mask_rows,
                                          verify_positions)
from pipeline.backends.triton import launch, launch_mla
from pipeline.backends.triton.launch import MAX_HEAD_DIM
from pipeline.backends.triton.launch_mla import MLA_MAX_LATENT_DIM, MLA_MAX_ROPE_DIM
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import BuildError, CapabilityMismatch


def call_error(field: str, value: Any, allowed: str, remedy: str) -> BuildError:
    """The BuildError (``forward_input_invalid``, state ``forward``) for a call input that does not match."""
    return BuildError(f"triton backend: {field}={value!r} does not match the layer/batch", code="forward_input_invalid",
                      state="forward", flags=[(field, value)], allowed=[allowed], remedy=remedy)


def check_call(q: Any, layer: Any, fb: Any) -> None:
    """Refuse a forward call the kernels cannot run: a non-MLA layer with D != Dv, an MLA layer with a window, softcap
    or sinks, a layer id outside the pool, a KV buffer of other [Hkv, D] than the layer's, or q not
    [T, H, D] / [T, H*D] for the batch's T new tokens."""
    if not layer.is_mla and layer.head_dim != layer.v_head_dim:
        raise CapabilityMismatch("the triton backend serves D == Dv, or MLA layers",
                                 flags=[("layer.head_dim", layer.head_dim), ("layer.v_head_dim", layer.v_head_dim)],
                                 allowed=["D == Dv", "is_mla"], remedy="use torch_native for this layer")
    if layer.is_mla:
        for name in ("sliding_window", "logit_softcap", "sinks"):
            if getattr(layer, name) is not None:
                raise CapabilityMismatch(f"the triton MLA kernels have no {name}", flags=[(f"layer.{name}", "set")],
                                         allowed=["None"], remedy="use torch_native for this layer")
    pool = fb.token_to_kv_pool
    if not 0 <= layer.layer_id < len(pool.k_buffer):
        raise call_error("layer.layer_id", layer.layer_id, f"0..{len(pool.k_buffer) - 1}", "size the KV pool per layer")
    kb = pool.get_key_buffer(layer.layer_id)
    want = (layer.num_kv_heads, layer.head_dim)
    if tuple(kb.shape[1:]) != want:
        raise call_error("kv_pool.buffer_shape", tuple(kb.shape[1:]), str(want), "build the pool from the layer kinds")
    t, h, d = fb.num_tokens, layer.num_heads, layer.head_dim
    if q.numel() != t * h * d or q.shape[0] != t:
        raise call_error("q.shape", tuple(q.shape), f"[{t}, {h}, {d}] or [{t}, {h * d}]", "pass q for the new tokens")


def kernel_dims(kinds: Sequence[LayerKind]) -> list[tuple[int, int, int, int]]:
    """``(H, Hkv, D, Dv)`` per layer kind, after refusing a kind the kernels cannot serve (CapabilityMismatch)."""
    dims = []
    for kind in kinds:
        if kind.is_mla:
            dv, dr = kind.head_dim_v, kind.head_dim_qk - kind.head_dim_v
            if kind.num_kv_heads != 1 or not 1 <= dv <= MLA_MAX_LATENT_DIM or \
                    not 1 <= dr <= MLA_MAX_ROPE_DIM:
                raise CapabilityMismatch(
                    f"triton MLA kernels cannot serve kv_lora_rank={dv}, rope dims={dr}, kv heads={kind.num_kv_heads}",
                    flags=[("model.kv_lora_rank", dv), ("model.qk_rope_head_dim", dr)],
                    allowed=[f"1 latent head, kv_lora_rank <= {MLA_MAX_LATENT_DIM}, "
                             f"rope dims 1..{MLA_MAX_ROPE_DIM}"],
                    remedy="use flashinfer or torch_native for this model")
        elif kind.head_dim_qk != kind.head_dim_v or kind.head_dim_qk > MAX_HEAD_DIM:
            raise CapabilityMismatch(
                f"triton cannot serve a layer kind with D={kind.head_dim_qk}, Dv={kind.head_dim_v}, mla={kind.is_mla}",
                flags=[("model.head_dim", kind.head_dim_qk), ("model.v_head_dim", kind.head_dim_v)],
                allowed=["D == Dv <= 256, no MLA"], remedy="use flashinfer or torch_native for this model")
        dims.append((kind.num_heads, kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v))
    return dims


@dataclass
class _DecodeMeta:
    """A decode-shaped batch: ``bs`` query rows, each reading ``req_to_token[req_pool_indices[i], :seq_lens[i]]``;
    ``table``: a draft decode's per-branch token table standing in for ``req_to_token`` (None: the pool's)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    bs: int
    scratch: Optional[torch.Tensor] = None
    table: Optional[torch.Tensor] = None


@dataclass
class _ExtendMeta:
    """An extend-shaped batch; ``tree``: a target verify's (mask, indptr, positions) for the kernel's tree mask
    (None: causal — an extend, a draft extend, or a verified chain)."""

    req_pool_indices: torch.Tensor
    qo_indptr: torch.Tensor
    prefix_lens: torch.Tensor
    max_extend_len: int
    tree: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None


def _tree_args(tree: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """:func:`launch.extend_attention`'s tree keywords for a target verify's (mask, indptr, positions), or none."""
    if tree is None:
        return {}
    return {"tree_mask": tree[0], "tree_indptr": tree[1], "positions": tree[2]}


def _host_lens(fb: ForwardBatch) -> list[int]:
    """The batch's ``seq_lens`` on the host (the engine's copy when it gave one; else a device read)."""
    host = fb.seq_lens_cpu
    if host is not None and len(host):
        return host.tolist() if isinstance(host, torch.Tensor) else list(host)
    return fb.seq_lens.tolist()


def kv_scales(layer: AttentionLayer, pool: Any) -> tuple[Any, Any]:
    """``(k_scale, v_scale)`` of ``layer``'s KV cache (real = stored * scale): the pool's ``kv_scales(layer_id)``, else
    the layer's attributes, else 1.0; floats or one-element tensors."""
    get = getattr(pool, "kv_scales", None)
    if callable(get):
        return get(layer.layer_id)
    ks, vs = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
    return (1.0 if ks is None else ks), (1.0 if vs is None else vs)


def stored_kv(x: torch.Tensor, buf_dtype: torch.dtype, scale: Any) -> torch.Tensor:
    """``x`` in a KV buffer's stored format (:func:`pipeline.backends.memory.quantize_kv`); returned as is when already
    ``buf_dtype``."""
    return x if x.dtype == buf_dtype else quantize_kv(x, buf_dtype, scale)


class TritonAttnBackend(AttentionBackend):
    """Paged decode/extend attention through this package's Triton kernels. ``torch_device``: the pools' device
    (``"cpu"`` only under ``TRITON_INTERPRET=1``); ``layer_dims``: ``(H, Hkv, D, Dv)`` per kind (sizes graph scratch);
    ``num_sms``: sets the decode split cap; ``role``; ``layer_kinds``: checked per layer object (``LayerMismatch``;
    None: trust each call's layer); ``req_to_token_pool``: for draft-decode graphs."""

    name = "triton"

    def __init__(self, *, torch_device: str | torch.device, layer_dims: list[tuple[int, int, int, int]],
                 num_sms: int = 132, role: str = "primary", decode_config: Optional[launch.DecodeConfig] = None,
                 extend_config: Optional[launch.ExtendConfig] = None,
                 mla_decode_config: Optional[launch_mla.MLADecodeConfig] = None,
                 mla_extend_config: Optional[launch_mla.MLAExtendConfig] = None,
                 layer_kinds: Optional[Sequence[LayerKind]] = None, req_to_token_pool: Any = None) -> None:
        self.torch_device = torch.device(torch_device)
        self.req_to_token_pool = req_to_token_pool  # draft-decode graphs build their token table from it
        self.layer_dims = list(layer_dims)
        self.num_sms = int(num_sms)
        self.role = role
        self.planned = None if layer_kinds is None else PlannedLayers(layer_kinds, backend=self.name, role=role)
        self.decode_config = decode_config
        self.extend_config = extend_config
        self.mla_decode_config = mla_decode_config
        self.mla_extend_config = mla_extend_config
        self._decode: Optional[_DecodeMeta] = None
        self._extend: Optional[tuple[ForwardBatch, _ExtendMeta]] = None  # the planned extend batch and its metadata
        self._graph: dict[str, torch.Tensor] = {}
        self._graph_mode: Optional[ForwardMode] = None  # the mode captured / replayed last (its metadata is current)
        self.closed = False

    # ----------------------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Eager batch: point decode at the batch's own tensors (draft decode: at its per-branch token table), or
        build extend's ``qo_indptr`` (target verify: and the tree's mask rows and positions)."""
        fb = forward_batch
        self._graph_mode = None
        if fb.is_decode():
            self._decode = _DecodeMeta(fb.req_pool_indices, fb.seq_lens, fb.batch_size)
            return
        if fb.is_draft_decode():
            self._decode = self._draft_meta(fb)
            return
        self._extend = (fb, self._extend_meta(fb))

    def _draft_meta(self, fb: ForwardBatch, table: Optional[torch.Tensor] = None,
                    seq_lens: Optional[torch.Tensor] = None, scratch: Optional[torch.Tensor] = None) -> _DecodeMeta:
        """A draft decode as a decode of ``B * topk`` rows over :func:`draft_token_table` (written into ``table`` and
        ``seq_lens`` when given: CUDA-graph buffers)."""
        slots = check_draft_batch(fb.spec_info, fb.batch_size, fb.num_tokens)
        r2t = fb.req_to_token_pool.req_to_token
        width = r2t.shape[1] if table is None else table.shape[1]
        seq = _host_lens(fb)
        if max(seq, default=0) + slots.shape[2] > width:
            raise call_error("forward_batch.seq_lens", max(seq), f"prefix + draft tokens <= {width}",
                             "size req_to_token (max_context_len) for the prefix and the draft tokens")
        tab, lens = draft_token_table(r2t, fb.req_pool_indices, fb.seq_lens, slots, width, out=table)
        rows = tab.shape[0]
        if seq_lens is not None:
            seq_lens[:rows].copy_(lens)
            lens = seq_lens[:rows]
        return _DecodeMeta(torch.arange(rows, device=tab.device), lens, rows, scratch, tab)

    def _extend_meta(self, fb: ForwardBatch) -> _ExtendMeta:
        if fb.extend_seq_lens is None or fb.extend_prefix_lens is None:
            raise call_error("forward_batch.extend_seq_lens", None, "[B] int32 tensors", "fill extend_(prefix|seq)_lens")
        ext = fb.extend_seq_lens
        qo = torch.zeros(fb.batch_size + 1, dtype=torch.int32, device=ext.device)
        qo[1:] = torch.cumsum(ext, 0)
        max_ext = max(fb.extend_seq_lens_cpu) if fb.extend_seq_lens_cpu else int(ext.max().item())
        tree = None
        if fb.is_target_verify():
            pre = list(fb.extend_prefix_lens_cpu) or fb.extend_prefix_lens.tolist()
            spec = check_verify_batch(fb.spec_info, pre, list(fb.extend_seq_lens_cpu) or ext.tolist())
            if not spec.is_chain():  # a chain is the causal extend
                mask, indptr = tree_mask_rows(spec, ext.device)
                tree = (mask, indptr, torch.tensor(verify_positions(spec, pre), dtype=torch.int64, device=ext.device))
        return _ExtendMeta(fb.req_pool_indices, qo, fb.extend_prefix_lens, int(max_ext), tree)

    def _max_splits(self, bs: int, num_kv_heads: int) -> int:
        cfg = self.decode_config or launch.DecodeConfig()
        return launch.decode_max_splits(bs, num_kv_heads, self.num_sms, cfg)

    def _mla_cfg(self, num_heads: int) -> launch_mla.MLADecodeConfig:
        return self.mla_decode_config or launch_mla.default_mla_decode_config(num_heads, self.torch_device)

    def _mla_splits(self, bs: int, num_heads: int) -> int:
        return launch_mla.mla_decode_max_splits(bs, num_heads, self.num_sms, self._mla_cfg(num_heads))

    def _scratch_numel(self, bs: int, h: int, hkv: int, d: int, dv: int) -> int:
        if d != dv:  # an MLA layer (create() refuses D != Dv otherwise)
            return launch_mla.mla_decode_scratch_numel(bs, h, dv, self._mla_splits(bs, h))
        return launch.decode_scratch_numel(bs, h, dv, self._max_splits(bs, hkv))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate fixed-address decode buffers for up to ``max_bs`` requests: ``req_pool_indices`` [max_bs] int64 (0 =
        padding row), ``seq_lens`` [max_bs] int32, fp32 scratch for every size and kind."""
        if max_bs < 1:
            raise call_error("max_bs", max_bs, ">= 1", "capture at least one batch size")
        need = max(self._scratch_numel(bs, h, hkv, d, dv)
                   for bs in range(1, max_bs + 1) for h, hkv, d, dv in self.layer_dims)
        dev = self.torch_device
        self._graph = {
            "req_pool_indices": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "seq_lens": torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int32, device=dev),
            "scratch": torch.empty(need, dtype=torch.float32, device=dev),
        }

    def _graph_meta(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    forward_mode: ForwardMode) -> _DecodeMeta:
        if not self._graph:
            raise call_error("cuda_graph_state", None, "init_cuda_graph_state() called", "call init_cuda_graph_state first")
        if forward_mode is not ForwardMode.DECODE:
            raise CapabilityMismatch("the triton backend captures decode, target-verify and draft-decode batches only",
                                     flags=[("forward_mode", str(forward_mode.value))],
                                     allowed=["decode", "target_verify", "draft_decode"],
                                     remedy="run extend batches eagerly (as sglang does)")
        g_req, g_seq = self._graph["req_pool_indices"], self._graph["seq_lens"]
        if not 1 <= bs <= g_req.shape[0]:
            raise call_error("bs", bs, f"1..{g_req.shape[0]}", "raise max_bs in init_cuda_graph_state")
        g_req[:bs].copy_(req_pool_indices[:bs])
        g_seq[:bs].copy_(seq_lens[:bs])
        return _DecodeMeta(g_req[:bs], g_seq[:bs], bs, self._graph["scratch"])

    def _graph_buffer(self, name: str, numel: int, dtype: torch.dtype, fill: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
        """A fixed-address speculative graph buffer, made at the first (largest) capture of its mode, outside the
        graph (``fill``: its initial value). Later sizes take a prefix of it."""
        buf = self._graph.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._graph[name] = torch.zeros(numel, dtype=dtype, device=self.torch_device) if fill is None \
                else fill.to(self.torch_device, dtype)
        return buf

    def _verify_graph_meta(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, spec_info: Any,
                           seq_lens_cpu: Optional[list[int]]) -> _ExtendMeta:
        """Target verify in a graph: fixed buffers for rows, prefixes (``seq_lens - n``), ``qo_indptr``, [n, n] tree
        masks and positions, refreshed outside the graph."""
        n = spec_info.num_draft_tokens
        pre = [s - n for s in (seq_lens_cpu if seq_lens_cpu is not None else seq_lens[:bs].tolist())][:bs]
        spec = check_verify_batch(spec_info, pre, [n] * bs)
        mb = self._graph["req_pool_indices"].shape[0]
        g = {k: self._graph_buffer(f"verify.{k}", *a) for k, a in (
            ("req", (mb, torch.int64)), ("prefix", (mb, torch.int32)), ("pos", (mb * n, torch.int64)),
            ("mask", (mb * n * n, torch.uint8)),
            ("qo", (mb + 1, torch.int32, torch.arange(mb + 1) * n)),
            ("mask_indptr", (mb + 1, torch.int32, torch.arange(mb + 1) * n * n)))}
        g["req"][:bs].copy_(req_pool_indices[:bs])
        g["prefix"][:bs].copy_(torch.tensor(pre, dtype=torch.int32))
        mask, _ = tree_mask_rows(spec, "cpu")
        g["mask"][: mask.numel()].copy_(mask)
        g["pos"][: bs * n].copy_(torch.tensor(verify_positions(spec, pre), dtype=torch.int64))
        return _ExtendMeta(g["req"][:bs], g["qo"][: bs + 1], g["prefix"][:bs], n,
                           (g["mask"], g["mask_indptr"][: bs + 1], g["pos"][: bs * n]))

    def _draft_graph_meta(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, spec_info: Any,
                          seq_lens_cpu: Optional[list[int]]) -> _DecodeMeta:
        """Draft decode in a graph: ``bs * topk`` branch rows over a fixed token table [rows, max_context_len]
        (:func:`draft_token_table`), lengths and decode scratch sized for that many rows, refreshed outside the graph."""
        if self.req_to_token_pool is None:
            raise call_error("req_to_token_pool", None, "the pool the backend was built over",
                             "build the backend with its req_to_token_pool (the registry factory does)")
        r2t = self.req_to_token_pool.req_to_token
        topk, mb = spec_info.topk, self._graph["req_pool_indices"].shape[0]
        rows, max_rows = bs * topk, mb * topk
        table = self._graph_buffer("draft.table", max_rows * r2t.shape[1], torch.int32).view(max_rows, -1)
        lens = self._graph_buffer("draft.lens", max_rows, torch.int32)
        idx = self._graph_buffer("draft.rows", max_rows, torch.int64, torch.arange(max_rows))
        need = max(self._scratch_numel(r, h, hkv, d, dv)  # every row count up to max_rows (splits grow as rows shrink)
                   for r in range(1, max_rows + 1) for h, hkv, d, dv in self.layer_dims)
        scratch = self._graph_buffer("draft.scratch", need, torch.float32)
        slots = spec_info.draft_slots
        seq = seq_lens_cpu if seq_lens_cpu is not None else seq_lens[:bs].tolist()
        if max(seq[:bs], default=0) + slots.shape[2] > table.shape[1]:
            raise call_error("seq_lens", max(seq[:bs]), f"prefix + draft tokens <= {table.shape[1]}",
                             "size max_context_len for the prefix and the draft tokens")
        tab, l_dev = draft_token_table(r2t, req_pool_indices[:bs], seq_lens[:bs], slots, table.shape[1], out=table)
        lens[:rows].copy_(l_dev)
        return _DecodeMeta(idx[:rows], lens[:rows], rows, scratch, tab)

    def _spec_graph(self, bs: int, req_pool_indices, seq_lens, forward_mode: ForwardMode, spec_info: Any,
                    seq_lens_cpu: Any = None) -> None:
        """Point the next forward (capture) or replay at the graph buffers of ``forward_mode``."""
        if not self._graph:
            raise call_error("cuda_graph_state", None, "init_cuda_graph_state() called", "call init_cuda_graph_state first")
        seq = None if seq_lens_cpu is None else [int(x) for x in seq_lens_cpu]
        self._graph_mode = forward_mode
        if forward_mode is ForwardMode.TARGET_VERIFY:
            self._extend = (None, self._verify_graph_meta(bs, req_pool_indices, seq_lens, spec_info, seq))
        elif forward_mode is ForwardMode.DRAFT_DECODE:
            self._decode = self._draft_graph_meta(bs, req_pool_indices, seq_lens, spec_info, seq)
        else:
            self._decode = self._graph_meta(bs, req_pool_indices, seq_lens, forward_mode)

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        """Point decode (target verify, draft decode) at the graph buffers, filled with this batch, before capture
        at size ``bs``."""
        self._spec_graph(bs, req_pool_indices, seq_lens, forward_mode, spec_info)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu=None) -> None:
        """Copy the new batch's rows and lengths (target verify: its trees; draft decode: its token table) into the
        graph buffers (outside the graph)."""
        self._spec_graph(bs, req_pool_indices, seq_lens, forward_mode, spec_info, seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded graph rows get length 1 (row 0, slot 0: sglang's padding slot)."""
        return 1

    # ----------------------------------------------------------------------------- forward
    def _prepare(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], layer: AttentionLayer,
                 fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        """Check the layer against its plan, the kernels and the KV buffers (:func:`check_call`), write
        the new K/V when asked; returns q as [T, H, D]."""
        if self.planned is not None:
            self.planned.check(layer)
        check_call(q, layer, fb)
        t, h, d = fb.num_tokens, layer.num_heads, layer.head_dim
        if save_kv_cache:
            if k is None or v is None:
                raise call_error("k/v", None, "tensors when save_kv_cache", "pass the new K/V or save_kv_cache=False")
            fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        return q.reshape(t, h, d)

    def forward_decode(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Decode: q [B, H, D] (or [B, H*D]) → [B, H*Dv] in q's dtype; the new token is read from the pool."""
        fb = forward_batch
        q3 = self._prepare(q, k, v, layer, fb, save_kv_cache)
        meta = self._decode if self._decode is not None and self._decode.bs == fb.num_tokens else None
        if meta is None:
            meta = self._draft_meta(fb) if fb.is_draft_decode() else \
                _DecodeMeta(fb.req_pool_indices, fb.seq_lens, fb.batch_size)
        r2t = fb.req_to_token_pool.req_to_token if meta.table is None else meta.table
        pool = fb.token_to_kv_pool
        out = torch.empty((meta.bs, layer.num_heads, layer.v_head_dim), dtype=q.dtype, device=q.device)
        k_scale, v_scale = kv_scales(layer, pool)
        if layer.is_mla:
            cfg = self._mla_cfg(layer.num_heads)
            launch_mla.mla_decode_attention(
                q3, pool.get_key_buffer(layer.layer_id), r2t, meta.req_pool_indices,
                meta.seq_lens, out, sm_scale=layer.scaling, max_splits=self._mla_splits(meta.bs, layer.num_heads),
                scratch=meta.scratch, config=cfg)
            return out.view(meta.bs, layer.num_heads * layer.v_head_dim)
        launch.decode_attention(
            q3, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
            r2t, meta.req_pool_indices, meta.seq_lens, out,
            sm_scale=layer.scaling, max_splits=self._max_splits(meta.bs, layer.num_kv_heads), scratch=meta.scratch,
            sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap, sinks=layer.sinks,
            config=self.decode_config, attention_chunk_size=layer.attention_chunk_size, k_scale=k_scale,
            v_scale=v_scale)
        return out.view(meta.bs, layer.num_heads * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Extend: q [T, H, D] → [T, H*Dv]; prefix from the pool, new tokens from k/v (or the pool if None)."""
        fb = forward_batch
        q3 = self._prepare(q, k, v, layer, fb, save_kv_cache)
        if self._graph_mode is ForwardMode.TARGET_VERIFY:  # captured: the graph buffers, refreshed before each replay
            meta = self._extend[1]
        else:
            if self._extend is None or self._extend[0] is not fb:  # not planned: plan once (not per layer, never stale)
                self._extend = (fb, self._extend_meta(fb))
            meta = self._extend[1]
        pool = fb.token_to_kv_pool
        kb, vb = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        t, h = q3.shape[0], layer.num_heads
        if layer.is_mla:  # new latent rows from k (or the pool); the kernels never read v
            if meta.tree is not None:
                raise CapabilityMismatch("the triton MLA extend kernel has no tree mask (target verify of an EAGLE "
                                         "tree)", flags=[("layer.is_mla", True), ("forward_mode", "target_verify")],
                                         allowed=["a chain (speculative_eagle_topk=1)"],
                                         remedy="use torch_native for MLA trees, or speculative_eagle_topk=1")
            kv_new = (kb[fb.out_cache_loc] if k is None else k).reshape(t, 1, layer.head_dim).to(kb.dtype)
            out = torch.empty((t, h, layer.v_head_dim), dtype=q.dtype, device=q.device)
            launch_mla.mla_extend_attention(
                q3, kv_new, kb, fb.req_to_token_pool.req_to_token, meta.req_pool_indices, meta.qo_indptr,
                meta.prefix_lens, out, max_extend_len=meta.max_extend_len, sm_scale=layer.scaling,
                config=self.mla_extend_config)
            return out.view(t, h * layer.v_head_dim)
        k_scale, v_scale = kv_scales(layer, pool)
        if k is None or v is None or (save_kv_cache and kb.dtype in launch.FP8_KV_DTYPES):
            k, v = kb[fb.out_cache_loc], vb[fb.out_cache_loc]   # exactly what the pool stored
        k = stored_kv(k.reshape(t, layer.num_kv_heads, layer.head_dim), kb.dtype, k_scale)
        v = stored_kv(v.reshape(t, layer.num_kv_heads, layer.v_head_dim), vb.dtype, v_scale)
        out = torch.empty((t, h, layer.v_head_dim), dtype=q.dtype, device=q.device)
        launch.extend_attention(
            q3, k, v, kb, vb, fb.req_to_token_pool.req_to_token, meta.req_pool_indices, meta.qo_indptr,
            meta.prefix_lens, out, max_extend_len=meta.max_extend_len, sm_scale=layer.scaling,
            sliding_window=layer.sliding_window, logit_softcap=layer.logit_softcap, sinks=layer.sinks,
            config=self.extend_config, attention_chunk_size=layer.attention_chunk_size, k_scale=k_scale,
            v_scale=v_scale, **_tree_args(meta.tree))
        return out.view(t, h * layer.v_head_dim)

    # ----------------------------------------------------------------------------- ownership
    def owned_buffers(self) -> list[Any]:
        """The CUDA-graph metadata buffers and scratch (empty before init_cuda_graph_state)."""
        return list(self._graph.values())

    def close(self) -> None:
        """Drop graph buffers and batch metadata; idempotent."""
        self._graph = {}
        self._decode = None
        self._extend = None
        self.req_to_token_pool = None
        self.closed = True


def create(ctx: Any) -> TritonAttnBackend:
    """Registry factory ``create(ctx) -> TritonAttnBackend`` (no workspace). Raises CapabilityMismatch for D != Dv or D
    > 256 without MLA; MLA with > 1 KV head, kv_lora_rank > 512 or rope > 128."""
    dims = kernel_dims(ctx.layer_kinds)
    sms = getattr(ctx.device, "sm_count", 0) or 132
    return TritonAttnBackend(torch_device=ctx.torch_device, layer_dims=dims, num_sms=sms, role=ctx.role,
                             layer_kinds=ctx.layer_kinds, req_to_token_pool=getattr(ctx, "req_to_token_pool", None))

