"""Paged KV memory: ``req_to_token``, per-layer K/V buffers and a page allocator (docs/internals.md)."""

from __future__ import annotations

import math
from typing import Any, Collection, Optional, Sequence

import torch

from pipeline.backends.base import ForwardBatch
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import BuildError, ConfigError


_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a normalised dtype name (``bfloat16``, ``fp8_e4m3`` …)."""
    return _TORCH_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the two fp8 KV storage dtypes (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: Any = 1.0) -> torch.Tensor:
    """What the pool stores for ``x``: ``round(clamp(x / scale))`` in fp8, else ``x`` cast to ``dtype`` (same shape).
    ``scale``: float or one-element tensor (not 1.0 only for fp8)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    y = x.to(torch.float32)
    if isinstance(scale, torch.Tensor) or scale != 1.0:  # x / 1.0 is x: skip the op for the common case
        y = y / scale
    return y.clamp(-fmax, fmax).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(stored) * scale`` in ``dtype`` (float32 by default): the value a stored K/V element means."""
    out = stored.to(dtype)
    return out * scale if scale != 1.0 else out


def _check_scales(name: str, scales: Optional[Sequence[float]], num_layers: int, dtype: torch.dtype) -> list[float]:
    if scales is None:
        return [1.0] * num_layers
    vals = list(scales)
    if len(vals) != num_layers:
        raise ConfigError(f"{name} has {len(vals)} entries for {num_layers} layers", code="invalid_value",
                          flags=[(name, len(vals))], allowed=[f"{num_layers} floats, one per layer"],
                          remedy=f"give one {name[:-1]} per layer (1.0 where the checkpoint has none)")
    for lid, s in enumerate(vals):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ConfigError(f"{name}[{lid}]={s!r} is not a finite positive number", code="invalid_value",
                              flags=[(f"{name}[{lid}]", repr(s))], allowed=["a finite float > 0"],
                              remedy=f"use the checkpoint's {name[:-1]} for layer {lid}, or 1.0")
        if float(s) != 1.0 and not is_fp8(dtype):
            raise ConfigError(f"{name}[{lid}]={s} on a {str(dtype).replace('torch.', '')} KV cache: scales apply to "
                              "fp8 KV caches only", code="invalid_value", flags=[(f"{name}[{lid}]", float(s))],
                              allowed=["1.0"], remedy="use kv_cache_dtype fp8_e4m3 or fp8_e5m2, or scales of 1.0")
    return [float(s) for s in vals]


class ReqToTokenPool:
    """``req_to_token`` [max_reqs, max_context_len] int32 on ``device``."""

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device) -> None:
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=device)
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len


class KVPool:
    """Per-layer K/V buffers and per-layer fp8 scales.

    ``num_token_slots`` per layer (a multiple of ``page_size`` >= 1); ``layer_dims[i] = (Hkv, D, Dv)`` (``(0, 0, 0)``
    holds no KV); ``dtype``: bf16, fp16, fp32, ``float8_e4m3fn`` or ``float8_e5m2``; ``mla_layers``: one latent buffer
    [S, 1, D] with ``v_buffer`` a view of its first Dv dims (``Hkv == 1``, ``Dv < D``, ``k_scale == v_scale``);
    ``k_scales``/``v_scales``: one float per layer (default 1.0, fixed for the pool's life). Attributes ``k_buffer``,
    ``v_buffer``, ``k_scales``, ``v_scales``, ``size``, ``page_size``, ``dtype``, ``device``, ``mla_layers``.

    Raises :class:`~pipeline.core.errors.ConfigError` (``invalid_value``) before allocating for a wrong-length,
    non-finite, non-positive or (non-fp8) non-unit scale, or a bad MLA layer.
    """

    def __init__(self, num_token_slots: int, page_size: int, layer_dims: Sequence[tuple[int, int, int]],
                 dtype: torch.dtype, device: str | torch.device, *, mla_layers: Collection[int] = (),
                 k_scales: Optional[Sequence[float]] = None, v_scales: Optional[Sequence[float]] = None) -> None:
        n = len(layer_dims)
        self.k_scales = _check_scales("k_scales", k_scales, n, dtype)
        self.v_scales = _check_scales("v_scales", v_scales, n, dtype)
        self.mla_layers = frozenset(mla_layers)
        for lid in sorted(self.mla_layers):
            h, d, dv = layer_dims[lid] if 0 <= lid < n else (None, None, None)
            if h != 1 or d is None or not 0 < dv < d:
                raise ConfigError(f"MLA layer {lid} has dims (Hkv, D, Dv)={(h, d, dv)}; an absorbed MLA layer is one "
                                  "latent head with Dv < D", code="invalid_value",
                                  flags=[(f"layer_dims[{lid}]", (h, d, dv))], allowed=["(1, D, Dv) with Dv < D"],
                                  remedy="pass the layer's absorbed dims, e.g. (1, 576, 512) for DeepSeek-V2/V3")
            if self.k_scales[lid] != self.v_scales[lid]:
                raise ConfigError(f"MLA layer {lid} has k_scale={self.k_scales[lid]} and v_scale="
                                  f"{self.v_scales[lid]}; its V is a view of the one latent buffer, stored with "
                                  "k_scale", code="invalid_value",
                                  flags=[(f"v_scales[{lid}]", self.v_scales[lid])], allowed=[str(self.k_scales[lid])],
                                  remedy="give an MLA layer one scale for its latent cache (v_scale = k_scale)")
        self.size = num_token_slots
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_buffer = [torch.zeros((num_token_slots, h, d), dtype=dtype, device=device) for h, d, _ in layer_dims]
        self.v_buffer = [self.k_buffer[lid][:, :, :dv] if lid in self.mla_layers else
                         torch.zeros((num_token_slots, h, dv), dtype=dtype, device=device)
                         for lid, (h, _, dv) in enumerate(layer_dims)]

    @classmethod
    def for_layer_kinds(cls, kinds: Sequence[LayerKind], num_layers: int, num_token_slots: int, page_size: int,
                        dtype: torch.dtype, device: str | torch.device, *,
                        k_scales: Optional[Sequence[float]] = None,
                        v_scales: Optional[Sequence[float]] = None) -> "KVPool":
        """A pool with one buffer pair per layer id, dims taken from each layer's kind (MLA kinds: one latent
        buffer, V a view of it)."""
        dims: list[tuple[int, int, int]] = [(0, 0, 0)] * num_layers
        mla: list[int] = []
        for kind in kinds:
            for lid in kind.layer_ids:
                if lid < num_layers:
                    dims[lid] = (kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v)
                    if kind.is_mla:
                        mla.append(lid)
        return cls(num_token_slots, page_size, dims, dtype, device, mla_layers=mla, k_scales=k_scales,
                   v_scales=v_scales)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K buffer [num_token_slots, Hkv, D] in the storage dtype."""
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s V buffer [num_token_slots, Hkv, Dv] (an MLA layer: a view into its K buffer)."""
        return self.v_buffer[layer_id]

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of layer ``layer_id``: ``real = float(stored) * scale``."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor]) -> None:
        """Write K [T, Hkv, D] and V [T, Hkv, Dv] at slots ``loc`` [T] int64, quantized; MLA layers write K only."""
        kb, vb = self.k_buffer[layer_id], self.v_buffer[layer_id]
        kb[loc] = quantize_kv(k.reshape(-1, kb.shape[1], kb.shape[2]), kb.dtype, self.k_scales[layer_id])
        if layer_id not in self.mla_layers:
            vb[loc] = quantize_kv(v.reshape(-1, vb.shape[1], vb.shape[2]), vb.dtype, self.v_scales[layer_id])

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's stored K/V at slots ``src`` [n] to ``dst`` [n] (int64), as sglang's ``move_kv_cache``
        after target verify."""
        for lid, (kb, vb) in enumerate(zip(self.k_buffer, self.v_buffer)):
            if kb.numel():
                kb[dst] = kb[src]
                if lid not in self.mla_layers:
                    vb[dst] = vb[src]

    def nbytes(self) -> int:
        """Bytes held by all K/V buffers (an MLA layer's V view is not counted twice)."""
        bufs = self.k_buffer + [v for lid, v in enumerate(self.v_buffer) if lid not in self.mla_layers]
        return sum(t.numel() * t.element_size() for t in bufs)


def layer_kv_scales(pool: Any, layer_id: int) -> tuple[float, float]:
    """``(k_scale, v_scale)`` of ``layer_id`` in ``pool`` as Python floats; (1.0, 1.0) for a pool without scales."""
    ks, vs = getattr(pool, "k_scales", None), getattr(pool, "v_scales", None)
    return (ks[layer_id] if ks is not None else 1.0, vs[layer_id] if vs is not None else 1.0)


class PageAllocator:
    """Hands out whole pages per request, in scrambled order, and fills ``req_to_token``; raises :class:`BuildError`
    (``kv_pool_exhausted``) when none is free."""

    def __init__(self, req_pool: ReqToTokenPool, num_token_slots: int, page_size: int, seed: int = 0) -> None:
        self.req_pool = req_pool
        self.page_size = page_size
        num_pages = num_token_slots // page_size
        self.num_pages = num_pages
        g = torch.Generator().manual_seed(seed)
        order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 reserved for padding
        self.free_pages: list[int] = order
        self.req_pages: dict[int, list[int]] = {}
        self.req_lens: dict[int, int] = {}
        self.scratch_pages: dict[int, list[int]] = {}  # pages of slots outside req_to_token (draft tokens)

    def extend(self, req: int, new_tokens: int) -> torch.Tensor:
        """Give request row ``req`` room for ``new_tokens`` more tokens; returns their slots [new] int64."""
        old = self.req_lens.get(req, 0)
        new = old + new_tokens
        if new > self.req_pool.max_context_len:
            raise BuildError(f"request {req} needs {new} tokens > max_context_len={self.req_pool.max_context_len}",
                             code="context_too_long", flags=[("pool.max_context_len", self.req_pool.max_context_len)],
                             remedy="use shorter verification batches or a larger max_context_len")
        pages = self.req_pages.setdefault(req, [])
        while len(pages) * self.page_size < new:
            pages.append(self._page())
        t = torch.arange(old, new, dtype=torch.int64)
        page_idx = torch.tensor(pages, dtype=torch.int64)[t // self.page_size]
        slots = page_idx * self.page_size + t % self.page_size
        self.req_pool.req_to_token[req, old:new] = slots.to(torch.int32).to(self.req_pool.req_to_token.device)
        self.req_lens[req] = new
        return slots

    def _page(self) -> int:
        if not self.free_pages:
            raise BuildError("the KV pool has no free page", code="kv_pool_exhausted", state="verify",
                             flags=[("num_token_slots", self.num_pages * self.page_size), ("page_size", self.page_size)],
                             remedy="give the pool more token slots (num_token_slots, mem_bytes or mem_fraction; "
                                    "each request needs whole pages) or lower decode_steps")
        return self.free_pages.pop()

    def scratch(self, req: int, n: int) -> torch.Tensor:
        """``n`` slots in fresh pages held for request row ``req`` but outside its ``req_to_token`` row (draft
        tokens: sglang keeps them in the draft's ``out_cache_loc`` until verify); freed with the request. [n] int64."""
        pages = [self._page() for _ in range(-(-n // self.page_size))]
        self.scratch_pages.setdefault(req, []).extend(pages)
        t = torch.arange(n, dtype=torch.int64)
        return torch.tensor(pages, dtype=torch.int64)[t // self.page_size] * self.page_size + t % self.page_size

    def truncate(self, req: int, length: int) -> None:
        """Keep the first ``length`` tokens of request ``req`` (e.g. the accepted ones after target verify); whole
        pages past them go back to the free list."""
        pages = self.req_pages.get(req, [])
        keep = -(-length // self.page_size)
        self.free_pages.extend(pages[keep:])
        del pages[keep:]
        self.req_lens[req] = length

    def free(self, req: int) -> None:
        """Return a request's pages (and its scratch pages) to the free list."""
        self.free_pages.extend(self.req_pages.pop(req, []))
        self.free_pages.extend(self.scratch_pages.pop(req, []))
        self.req_lens.pop(req, None)


def make_forward_batch(mode: ForwardMode, reqs: Sequence[int], new_tokens: Sequence[int], allocator: PageAllocator,
                       kv_pool: KVPool, spec_info: Any = None) -> ForwardBatch:
    """Allocate ``new_tokens[i]`` slots for request row ``reqs[i]`` and build the batch on the pool's device.
    ``DECODE``: each 1; ``TARGET_VERIFY``: ``spec_info`` holds each tree, at ``prefix + depth``; draft decode:
    :func:`make_draft_batch`."""
    if mode is ForwardMode.DECODE and any(n != 1 for n in new_tokens):
        raise BuildError("a decode batch has exactly one new token per request", code="bad_batch")
    dev = kv_pool.device
    prefix = [allocator.req_lens.get(r, 0) for r in reqs]
    locs = [allocator.extend(r, n) for r, n in zip(reqs, new_tokens)]
    seq = [p + n for p, n in zip(prefix, new_tokens)]
    if mode is ForwardMode.TARGET_VERIFY:
        from pipeline.backends.speculative import check_verify_batch, verify_positions

        positions = torch.tensor(verify_positions(check_verify_batch(spec_info, prefix, new_tokens), prefix),
                                 dtype=torch.int64)
    else:
        positions = torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix, seq)])
    i32 = dict(dtype=torch.int32, device=dev)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(reqs),
        req_pool_indices=torch.tensor(list(reqs), dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq, **i32),
        out_cache_loc=torch.cat(locs).to(dev),
        positions=positions.to(dev),
        req_to_token_pool=allocator.req_pool,
        token_to_kv_pool=kv_pool,
        seq_lens_cpu=seq,
        extend_prefix_lens=torch.tensor(prefix, **i32),
        extend_seq_lens=torch.tensor(list(new_tokens), **i32),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=list(new_tokens),
        spec_info=spec_info,
    )


def make_draft_batch(reqs: Sequence[int], draft_slots: torch.Tensor, allocator: PageAllocator,
                     kv_pool: KVPool) -> ForwardBatch:
    """A ``DRAFT_DECODE`` batch: request row ``reqs[b]`` with ``topk`` branches whose draft slots are ``draft_slots[b]``
    [topk, s + 1] (the last at ``prefix + s``)."""
    from pipeline.backends.speculative import SpecInfo

    dev = kv_pool.device
    b, topk, s1 = draft_slots.shape
    seq = [allocator.req_lens.get(r, 0) for r in reqs]
    positions = torch.tensor(seq, dtype=torch.int64).repeat_interleave(topk) + (s1 - 1)
    return ForwardBatch(
        forward_mode=ForwardMode.DRAFT_DECODE, batch_size=len(reqs),
        req_pool_indices=torch.tensor(list(reqs), dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
        out_cache_loc=draft_slots[:, :, -1].reshape(-1).to(dev, torch.int64), positions=positions.to(dev),
        req_to_token_pool=allocator.req_pool, token_to_kv_pool=kv_pool, seq_lens_cpu=seq,
        spec_info=SpecInfo(topk=topk, draft_slots=draft_slots.to(dev, torch.int64)))

