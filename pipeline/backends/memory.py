"""Paged KV memory: ``req_to_token``, per-layer K/V buffers and a page allocator.

Layout (sglang's):

- ``ReqToTokenPool.req_to_token``: [max_reqs, max_context_len] int32 — token ``t`` of the request
  in row ``r`` lives in KV slot ``req_to_token[r, t]``.
- ``KVPool.k_buffer[layer]``: [num_token_slots, Hkv, D]; ``v_buffer[layer]``: [num_token_slots, Hkv, Dv].
- Pages: slots are handed out in whole pages of ``page_size`` tokens, so
  ``req_to_token[r, t] == page(r, t // page_size) * page_size + t % page_size``.
  Slot 0's page is reserved (sglang keeps slot 0 as the padding slot for CUDA graphs).

This module imports torch; it is only imported by backends and by verification.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipeline.backends.base import ForwardBatch
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import BuildError


_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a normalised dtype name (``bfloat16``, ``fp8_e4m3`` …)."""
    return _TORCH_DTYPES[name]


class ReqToTokenPool:
    """``req_to_token`` [max_reqs, max_context_len] int32 on ``device``."""

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device) -> None:
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=device)
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len


class KVPool:
    """Per-layer K/V buffers, one pair per attention layer.

    ``layer_dims[i] = (Hkv, D, Dv)`` for layer i. ``dtype`` is the storage dtype (bf16, fp16,
    fp32; fp8 KV is stored as ``torch.float8_e4m3fn`` / ``float8_e5m2`` and de-quantised by the
    backends with ``k_scale``/``v_scale`` = 1).
    """

    def __init__(self, num_token_slots: int, page_size: int, layer_dims: Sequence[tuple[int, int, int]],
                 dtype: torch.dtype, device: str | torch.device) -> None:
        self.size = num_token_slots
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_buffer = [torch.zeros((num_token_slots, h, d), dtype=dtype, device=device) for h, d, _ in layer_dims]
        self.v_buffer = [torch.zeros((num_token_slots, h, dv), dtype=dtype, device=device) for h, _, dv in layer_dims]

    @classmethod
    def for_layer_kinds(cls, kinds: Sequence[LayerKind], num_layers: int, num_token_slots: int, page_size: int,
                        dtype: torch.dtype, device: str | torch.device) -> "KVPool":
        """A pool with one buffer pair per layer id, dims taken from each layer's kind."""
        dims: list[tuple[int, int, int]] = [(0, 0, 0)] * num_layers
        for kind in kinds:
            for lid in kind.layer_ids:
                if lid < num_layers:
                    dims[lid] = (kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v)
        return cls(num_token_slots, page_size, dims, dtype, device)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K [T, Hkv, D] and V [T, Hkv, Dv] at slots ``loc`` [T] int64."""
        kb, vb = self.k_buffer[layer_id], self.v_buffer[layer_id]
        kb[loc] = k.reshape(-1, kb.shape[1], kb.shape[2]).to(kb.dtype)
        vb[loc] = v.reshape(-1, vb.shape[1], vb.shape[2]).to(vb.dtype)

    def nbytes(self) -> int:
        """Bytes held by all K/V buffers."""
        return sum(t.numel() * t.element_size() for t in self.k_buffer + self.v_buffer)


class PageAllocator:
    """Hands out whole pages of KV slots per request and fills ``req_to_token``.

    Pages are given out in a scrambled order so that tests exercise non-contiguous page tables.
    Raises :class:`BuildError` (``kv_pool_exhausted``) when no page is free.
    """

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
            if not self.free_pages:
                raise BuildError("the KV pool has no free page", code="kv_pool_exhausted", state="verify",
                                 flags=[("num_token_slots", self.num_pages * self.page_size),
                                        ("page_size", self.page_size)],
                                 remedy="give the pool more token slots (num_token_slots, mem_bytes or mem_fraction; "
                                        "each request needs whole pages) or lower decode_steps")
            pages.append(self.free_pages.pop())
        t = torch.arange(old, new, dtype=torch.int64)
        page_idx = torch.tensor(pages, dtype=torch.int64)[t // self.page_size]
        slots = page_idx * self.page_size + t % self.page_size
        self.req_pool.req_to_token[req, old:new] = slots.to(torch.int32).to(self.req_pool.req_to_token.device)
        self.req_lens[req] = new
        return slots

    def free(self, req: int) -> None:
        """Return a request's pages to the free list."""
        self.free_pages.extend(self.req_pages.pop(req, []))
        self.req_lens.pop(req, None)


def make_forward_batch(mode: ForwardMode, reqs: Sequence[int], new_tokens: Sequence[int], allocator: PageAllocator,
                       kv_pool: KVPool) -> ForwardBatch:
    """Allocate slots for ``new_tokens[i]`` more tokens of request row ``reqs[i]`` and build the batch.

    For ``DECODE`` every ``new_tokens[i]`` must be 1. Tensors live on the KV pool's device.
    """
    if mode is ForwardMode.DECODE and any(n != 1 for n in new_tokens):
        raise BuildError("a decode batch has exactly one new token per request", code="bad_batch")
    dev = kv_pool.device
    prefix = [allocator.req_lens.get(r, 0) for r in reqs]
    locs = [allocator.extend(r, n) for r, n in zip(reqs, new_tokens)]
    seq = [p + n for p, n in zip(prefix, new_tokens)]
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
    )
