"""Paged-KV page tables for FlashInfer: ``kv_indptr`` / ``last_page_len`` on the host, page ids on the device.

FlashInfer's paged wrappers take, per forward batch of B requests,

- ``kv_indptr`` [B+1] int32 (host): request r owns pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``;
- ``kv_last_page_len`` [B] int32 (host): tokens used in each request's last page (1..page_size);
- ``kv_indices`` [kv_indptr[B]] int32 (device): the page ids, ``req_to_token[row_r, j * page_size] // page_size``
  for page j of request r (our pool allocates whole pages, so a page's first slot names it).

The page ids live in ``req_to_token`` on the device, so they are gathered there. sglang does this with
one Triton kernel over a device ``kv_indptr`` (``create_flashinfer_kv_indices_triton``); ours also
computes each request's start on the device (a masked prefix sum over ``seq_lens``), so the gather
needs no host-to-device copy of its own and no pinned staging buffer: one kernel launch per forward
batch. (FlashInfer's ``plan()`` still copies the host ``kv_indptr``/``last_page_len`` to the device,
and :meth:`FlashInferBackend.page_table` copies ``seq_lens`` when the caller has no device copy.)
Without Triton (or on a CPU without ``TRITON_INTERPRET=1``) the same gather runs as torch ops.
"""

from __future__ import annotations

import inspect
import os
from itertools import accumulate
from typing import Optional, Sequence

import torch

try:  # triton is optional: torch CUDA wheels ship it, the CPU CI installs it for the interpreter
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def host_page_meta(seq_lens: Sequence[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(kv_indptr [B+1] int32 CPU, last_page_len [B] int32 CPU, total pages) for ``seq_lens`` tokens.

    ``seq_lens`` are tokens per request after this step (each >= 1). Up to 64 requests: pure Python
    on ints and one tensor (cheaper than torch CPU ops where the host bounds a decode step); above,
    a few torch CPU ops (their cost does not grow with B). Page-locked copies were measured too: on
    the H200 host ``pin_memory()`` cost ~30 µs a step and GPU-bound steps gained nothing, so the
    tensors stay pageable.
    """
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
    # Pointer alignment and stride values are not specialized: slices at any offset (e.g. a TBO child's
    # half of the batch) reuse the kernel compiled at build instead of compiling in their first step.
    _NO_SPEC = ["req_pool_indices", "seq_lens", "out", "stride_row", "stride_rpi", "stride_sl", "total"]
    _jit_kw = {"do_not_specialize": _NO_SPEC}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        _jit_kw["do_not_specialize_on_alignment"] = ["req_pool_indices", "seq_lens", "out"]

    @triton.jit(**_jit_kw)
    def _kv_indices_kernel(req_to_token, stride_row, stride_col, req_pool_indices, stride_rpi, seq_lens, stride_sl,
                           out, total, page_size, BLOCK: tl.constexpr):
        # one program per request r; its first output position is the page count of requests 0..r-1,
        # summed in BLOCK-wide chunks (no batch-size constexpr, so one compiled kernel serves every B);
        # stores are masked to the host's page total, so device lengths that disagree cannot overrun out
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

    ``req_to_token`` [max_reqs, max_context_len] int32 (token slot ids), ``req_pool_indices`` [B]
    int (rows), ``seq_lens`` [B] int on the same device (tokens per request, >= 1), ``total_pages``
    = ``sum(ceil(seq_lens / page_size))`` (the host knows it). ``out`` (int32, >= total_pages
    elements, e.g. a CUDA-graph buffer) is written in place when given. ``impl``: ``"triton"``,
    ``"torch"`` or ``"auto"`` (Triton on CUDA or under ``TRITON_INTERPRET=1``, torch otherwise).

    Any strides are accepted. Preconditions (not checked on this per-step path, as in sglang): rows
    and lengths lie within ``req_to_token``; the kernel never writes past ``total_pages`` even if the
    device lengths disagree with it. Raises ValueError when ``out`` is too small or not a contiguous
    int32 tensor on the pool's device, when ``impl`` is unknown, or when ``impl="triton"`` cannot run here.
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
