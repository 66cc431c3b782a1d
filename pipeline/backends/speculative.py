"""What a speculative-decoding batch adds to a :class:`~pipeline.backends.base.ForwardBatch`, and the masks and index
tables every backend builds from it (docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from pipeline.core.errors import BuildError


def _bad(field_: str, value: Any, allowed: str, remedy: str) -> BuildError:
    return BuildError(f"speculative batch: {field_}={value!r} is not valid", code="forward_input_invalid",
                      state="forward", flags=[(field_, value)], allowed=[allowed], remedy=remedy)


def check_parents(parents: Sequence[int], where: str = "spec_info.parents") -> list[int]:
    """``parents`` as a list of ints after checking it is a tree in sglang's order: ``parents[0] == -1`` (the
    root), ``0 <= parents[i] < i`` after it. Raises BuildError ``forward_input_invalid`` naming the entry."""
    ps = [int(p) for p in parents]
    if not ps or ps[0] != -1:
        raise _bad(f"{where}[0]", ps[0] if ps else None, "-1 (the root: the bonus token)",
                   "list the tree root first, with parent -1")
    for i, p in enumerate(ps[1:], 1):
        if not 0 <= p < i:
            raise _bad(f"{where}[{i}]", p, f"0..{i - 1} (a parent precedes its child)",
                       "order the draft tokens parents first (sglang sorts them by candidate index)")
    return ps


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each tree token (the root 0); ``parents`` as :func:`check_parents` accepts them."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool on the CPU: ``mask[i, j]`` is True iff token ``j`` is ``i`` or an ancestor of ``i`` (sglang's
    ``QLEN_ONLY`` tree mask)."""
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
    return mask


@dataclass
class SpecInfo:
    """The speculative part of a batch (the fields of sglang's ``EagleVerifyInput`` / ``EagleDraftInput`` attention
    reads). ``topk``; ``num_draft_tokens`` (fixed in graphs); ``parents``: target verify, per request; ``draft_slots``:
    draft decode, [B, topk, s + 1] int64 on the pool's device. Host-side derivations are cached per batch."""

    topk: int = 1
    num_draft_tokens: int = 0
    parents: Optional[list[list[int]]] = None
    draft_slots: Optional[torch.Tensor] = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def checked_parents(self) -> list[list[int]]:
        """``parents`` checked (:func:`check_parents`) once; BuildError when missing or not a tree."""
        if "parents" not in self._cache:
            if self.parents is None:
                raise _bad("spec_info.parents", None, "one parent list per request",
                           "give a target-verify batch its tree (SpecInfo.parents)")
            self._cache["parents"] = [check_parents(p, f"spec_info.parents[{b}]") for b, p in enumerate(self.parents)]
        return self._cache["parents"]

    def depths(self) -> list[list[int]]:
        """Per request, each tree token's depth."""
        if "depths" not in self._cache:
            self._cache["depths"] = [tree_depths(p) for p in self.checked_parents()]
        return self._cache["depths"]

    def masks(self) -> list[torch.Tensor]:
        """Per request, the [n, n] ancestor-or-self mask (:func:`tree_mask`), on the CPU."""
        if "masks" not in self._cache:
            self._cache["masks"] = [tree_mask(p) for p in self.checked_parents()]
        return self._cache["masks"]

    def is_chain(self) -> bool:
        """Every request's tree is a chain (parent ``i - 1``): the causal mask of an extend."""
        return all(p == list(range(-1, len(p) - 1)) for p in self.checked_parents())


def verify_positions(spec: SpecInfo, prefix_lens: Sequence[int]) -> list[int]:
    """Positions of a target-verify batch's tokens, request after request: ``prefix + depth``."""
    return [pre + d for pre, ds in zip(prefix_lens, spec.depths()) for d in ds]


def check_verify_batch(spec: Optional[SpecInfo], prefix_lens: Sequence[int], new_lens: Sequence[int]) -> SpecInfo:
    """The batch's SpecInfo after checking it describes a tree of ``new_lens[b]`` tokens per request."""
    if spec is None:
        raise _bad("forward_batch.spec_info", None, "a SpecInfo with the trees",
                   "set ForwardBatch.spec_info for a target-verify batch")
    parents = spec.checked_parents()
    if len(parents) != len(new_lens) or any(len(p) != n for p, n in zip(parents, new_lens)):
        raise _bad("spec_info.parents", [len(p) for p in parents], f"tree sizes {list(new_lens)} (extend_seq_lens)",
                   "give every request a tree of its extend_seq_lens tokens")
    return spec


def tree_mask_rows(spec: SpecInfo, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [sum n_b^2] uint8, indptr [B+1] int32) on ``device``: each request's [n, n] tree mask, row-major
    (sglang's ``QLEN_ONLY`` layout, one byte per bit), and where each starts."""
    masks = spec.masks()
    flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8)
    sizes = torch.tensor([0] + [m.numel() for m in masks], dtype=torch.int64)
    return flat.to(device), torch.cumsum(sizes, 0).to(torch.int32).to(device)


def full_mask_rows(spec: SpecInfo, prefix_lens: Sequence[int]) -> torch.Tensor:
    """Each request's [n, prefix + n] mask — prefix columns set, the tree mask after them — flattened row-major and
    concatenated, bool on the CPU: FlashInfer's ``custom_mask`` layout (sglang's ``TreeMaskMode.FULL_MASK``)."""
    rows = []
    for pre, m in zip(prefix_lens, spec.masks()):
        rows.append(torch.cat([torch.ones((m.shape[0], pre), dtype=torch.bool), m], dim=1).reshape(-1))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool)


def check_draft_batch(spec: Optional[SpecInfo], batch_size: int, num_tokens: int) -> torch.Tensor:
    """The batch's ``draft_slots`` [B, topk, s + 1] after checking it matches the batch (B requests, B * topk rows)."""
    slots = None if spec is None else spec.draft_slots
    if slots is None or slots.dim() != 3 or slots.shape[0] != batch_size or slots.shape[2] < 1:
        raise _bad("spec_info.draft_slots", None if slots is None else tuple(slots.shape),
                   f"[{batch_size}, topk, steps so far + 1] int64", "give a draft-decode batch its branches' slots")
    if slots.shape[1] * batch_size != num_tokens or slots.shape[1] != spec.topk:
        raise _bad("spec_info.draft_slots.shape[1]", slots.shape[1], f"topk={spec.topk} with {num_tokens} rows",
                   "one out_cache_loc entry per branch (B * topk)")
    return slots


def draft_token_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                      draft_slots: torch.Tensor, width: int, out: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table [B * topk, width] int32, kv_lens [B * topk] int32) of a draft-decode batch on the pool's device. Row ``b *
    topk + k``: request ``b``'s prefix slots then branch ``k``'s draft slots, 0 past its length; ``kv_lens = prefix + s
    + 1``. ``out`` [>= B * topk, width] int32 is written in place. No host sync (sglang's
    ``generate_draft_decode_kv_indices``)."""
    b, topk, s1 = draft_slots.shape
    rows = b * topk
    dev = req_to_token.device
    rep = lambda t: t.to(dev).repeat_interleave(topk)  # noqa: E731 (one request's value per branch)
    pre = rep(prefix_lens).to(torch.int64)
    col = torch.arange(width, device=dev).view(1, -1)
    prefix_part = req_to_token[rep(req_pool_indices).to(torch.int64)][:, :width].to(torch.int64)
    if prefix_part.shape[1] < width:
        prefix_part = torch.nn.functional.pad(prefix_part, (0, width - prefix_part.shape[1]))
    draft = draft_slots.reshape(rows, s1).to(dev, torch.int64)
    at = (col - pre.view(-1, 1)).clamp(0, s1 - 1)
    table = torch.where(col < pre.view(-1, 1), prefix_part, torch.gather(draft, 1, at))
    lens = pre + s1
    table = torch.where(col < lens.view(-1, 1), table, torch.zeros_like(table)).to(torch.int32)
    if out is not None:
        out[:rows].copy_(table)
        table = out[:rows]
    return table, lens.to(torch.int32)
