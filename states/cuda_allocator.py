"""A model of PyTorch's CUDA caching allocator for one private pool, torch-free (split out of
:mod:`states.graph_memory`, which replays a decode forward through it).

The constants and block policy are those of ``c10/cuda/CUDACachingAllocator.cpp`` (rounding to 512 bytes, 2 MiB
small segments, 20 MiB large segments under 10 MiB, best fit, splitting and merging; the rules are listed in
:mod:`states.graph_memory`'s docstring); :func:`blas_workspace_bytes` sizes the cuBLAS workspace PyTorch keeps per
(handle, stream), as ``CublasHandlePool.cpp`` does.
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Mapping, Optional

__all__ = ["PoolModel", "blas_workspace_bytes", "MiB"]

MiB = 1 << 20
K_MIN_BLOCK = 512             # kMinBlockSize: every request rounded up to a multiple of this
K_SMALL_SIZE = 1 * MiB        # kSmallSize: the largest "small" request
K_SMALL_BUFFER = 2 * MiB      # kSmallBuffer: a small-pool segment
K_LARGE_BUFFER = 20 * MiB     # kLargeBuffer: the segment a request between 1 and 10 MiB gets
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here on a segment is the request rounded to kRoundLarge
K_ROUND_LARGE = 2 * MiB       # kRoundLarge

# PyTorch's default cuBLAS workspace (CublasHandlePool.cpp, parseChosenWorkspaceSize): ":4096:8" (32 MiB) on
# Hopper, ":4096:2:16:8" (8 MiB + 128 KiB) elsewhere; CUBLAS_WORKSPACE_CONFIG overrides both.
BLAS_WORKSPACE_32MIB_ARCHS = ("sm90",)


def blas_workspace_bytes(arch: str, env: Mapping[str, str] = os.environ) -> int:
    """Bytes of the cuBLAS workspace PyTorch allocates per (handle, stream) on ``arch`` (``"sm90"`` …).

    ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs, summed, as PyTorch parses it) when set and readable,
    else 32 MiB on :data:`BLAS_WORKSPACE_32MIB_ARCHS` and 4096 KiB x 2 + 16 KiB x 8 elsewhere.
    """
    text = env.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":([0-9]+):([0-9]+)", text)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 1024 * 8 if arch in BLAS_WORKSPACE_32MIB_ARCHS else 4096 * 1024 * 2 + 16 * 1024 * 8


class PoolModel:
    """One private memory pool of PyTorch's CUDA caching allocator (one stream), as its rules are documented.

    :meth:`malloc` returns a block handle, :meth:`free` returns it; :attr:`reserved` is the bytes of every segment
    created (what ``torch.cuda.memory_snapshot()`` reports for the pool). Pure Python, no device.
    """

    def __init__(self) -> None:
        self.reserved = 0
        self._next_seg = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> (size, seg, off)
        self._blocks: dict[tuple[int, int], tuple[int, bool, bool]] = {}  # (seg, off) -> (size, small, free)
        self._free_ends: dict[tuple[int, int], int] = {}  # (seg, end) -> off of the free block ending there

    @staticmethod
    def round_size(nbytes: int) -> int:
        """The request rounded up to a multiple of 512 bytes (at least 512)."""
        return max(K_MIN_BLOCK, -(-int(nbytes) // K_MIN_BLOCK) * K_MIN_BLOCK)

    @staticmethod
    def segment_size(rounded: int) -> int:
        """The segment a request of ``rounded`` bytes gets when no free block fits."""
        if rounded <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if rounded < K_MIN_LARGE_ALLOC:
            return K_LARGE_BUFFER
        return -(-rounded // K_ROUND_LARGE) * K_ROUND_LARGE

    def malloc(self, nbytes: int) -> tuple[int, int]:
        """Take a block for ``nbytes`` (best fit, else a new segment), split it per the allocator's rule."""
        size = self.round_size(nbytes)
        small = size <= K_SMALL_SIZE
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1, -1))
        if i < len(free):
            bsize, seg, off = free.pop(i)
            del self._free_ends[(seg, off + bsize)]
        else:
            bsize, seg, off = self.segment_size(size), self._next_seg, 0
            self._next_seg += 1
            self.reserved += bsize
        rest = bsize - size
        if (rest >= K_MIN_BLOCK) if small else (rest > K_SMALL_SIZE):
            self._blocks[(seg, off + size)] = (rest, small, True)
            self._free_ends[(seg, off + bsize)] = off + size
            bisect.insort(free, (rest, seg, off + size))
            bsize = size
        self._blocks[(seg, off)] = (bsize, small, False)
        return seg, off

    def free(self, block: tuple[int, int]) -> None:
        """Return ``block``; it merges with a free block right after and right before it in its segment."""
        seg, off = block
        size, small, _ = self._blocks.pop(block)
        nxt = self._blocks.get((seg, off + size))
        if nxt is not None and nxt[2]:
            self._take_free(seg, off + size)
            size += nxt[0]
        prev = self._free_ends.get((seg, off))   # a free block ending where this one starts
        if prev is not None:
            psize = self._blocks[(seg, prev)][0]
            self._take_free(seg, prev)
            off, size = prev, size + psize
        self._blocks[(seg, off)] = (size, small, True)
        self._free_ends[(seg, off + size)] = off
        bisect.insort(self._free[small], (size, seg, off))

    def _take_free(self, seg: int, off: int) -> None:
        size, small, _ = self._blocks.pop((seg, off))
        del self._free_ends[(seg, off + size)]
        free, key = self._free[small], (size, seg, off)
        del free[bisect.bisect_left(free, key)]  # the list is sorted: a search, not list.remove's scan


class _Trace:
    """Allocations and frees of one forward, replayed into a :class:`PoolModel`."""

    def __init__(self, pool: PoolModel) -> None:
        self.pool = pool

    def a(self, nbytes: int) -> Optional[tuple[int, int]]:
        return self.pool.malloc(nbytes) if nbytes > 0 else None

    def f(self, *blocks: Optional[tuple[int, int]]) -> None:
        for b in blocks:
            if b is not None:
                self.pool.free(b)
