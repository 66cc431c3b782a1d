"""Speculative batches for verification (sglang's ``eagle_utils``): :func:`random_tree` (parents first, <= ``topk``
children, <= ``num_steps`` deep), :func:`accept_path` (KV of the accepted path moved, the rest freed) and
:func:`next_branches` (draft branches sharing earlier slots)."""

from __future__ import annotations

from typing import Sequence

import torch

from pipeline.backends.memory import KVPool, PageAllocator


def random_tree(n: int, topk: int, num_steps: int, gen: torch.Generator) -> list[int]:
    """Parents of a random tree of ``n`` tokens (``-1`` for the root): each new token hangs under a random earlier
    one that is shallower than ``num_steps`` and has fewer than ``topk`` children. ``n`` up to
    ``1 + topk + ... + topk**num_steps`` (a chain when ``topk == 1``, at most ``num_steps + 1`` tokens)."""
    parents, depth, kids = [-1], [0], [0]
    for _ in range(1, n):
        open_ = [i for i in range(len(parents)) if depth[i] < num_steps and kids[i] < topk]
        if not open_:
            raise ValueError(f"a tree of {n} tokens does not fit top-k {topk} and {num_steps} steps")
        p = open_[int(torch.randint(len(open_), (1,), generator=gen))]
        parents.append(p)
        depth.append(depth[p] + 1)
        kids.append(0)
        kids[p] += 1
    return parents


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Tree indices from the root to ``node``, root first."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def random_path(parents: Sequence[int], gen: torch.Generator) -> list[int]:
    """The accepted tokens of a verified tree: the path from the root to a random node (the root alone when
    nothing is accepted)."""
    return path_to(parents, int(torch.randint(len(parents), (1,), generator=gen)))


def accept_path(allocator: PageAllocator, kv_pool: KVPool, row: int, prefix: int, path: Sequence[int]) -> None:
    """Keep ``path`` (root first) of the tree verified at ``prefix ..`` of request ``row``: its KV moves to consecutive
    positions (sglang's ``move_kv_cache``), the rest is cut."""
    r2t = allocator.req_pool.req_to_token[row].to(torch.int64)
    src = r2t[[prefix + i for i in path]].to(kv_pool.device)
    dst = r2t[prefix: prefix + len(path)].to(kv_pool.device)
    kv_pool.move_kv(src, dst)
    allocator.truncate(row, prefix + len(path))


def next_branches(prev: torch.Tensor | None, rows: Sequence[int], topk: int, allocator: PageAllocator,
                  gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step's ``(draft_slots [B, topk, s + 1], parent_branch [B, topk])``: each branch continues a random
    previous branch with a fresh slot."""
    b = len(rows)
    new = torch.stack([allocator.scratch(r, topk) for r in rows]).view(b, topk, 1)
    if prev is None:
        return new, torch.zeros((b, topk), dtype=torch.int64)
    parent = torch.randint(prev.shape[1], (b, topk), generator=gen)
    kept = torch.gather(prev.cpu(), 1, parent.view(b, topk, 1).expand(b, topk, prev.shape[2]))
    return torch.cat([kept, new], dim=2), parent
