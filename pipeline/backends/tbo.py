"""Two-batch overlap (TBO) wrapper: one primary and two children built by the same factory (sglang's
``TboAttnBackend``).

The first ``ceil(B/2)`` requests go to child 0, the rest to child 1 (B = 1: child 0 only), each with its own sliced
:class:`ForwardBatch`; outputs are concatenated in batch order. The split is computed once per batch from host data.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch
from pipeline.core.errors import BuildError

__all__ = ["TboAttnBackend", "split_batch", "split_point"]


def split_point(batch_size: int) -> int:
    """Requests given to child 0: ``ceil(B / 2)`` (so B = 1 → all to child 0)."""
    return (batch_size + 1) // 2


def _token_counts(fb: ForwardBatch) -> list[int]:
    if fb.is_decode():
        return [1] * fb.batch_size
    if fb.is_draft_decode():  # one row per branch
        return [fb.spec_info.topk] * fb.batch_size
    return list(fb.extend_seq_lens_cpu) or [int(x) for x in fb.extend_seq_lens.tolist()]


def _sub_spec(spec: Any, r0: int, r1: int) -> Any:
    """A speculative batch's SpecInfo for requests ``[r0, r1)`` (their trees, their branches' slots)."""
    if spec is None:
        return None
    return replace(spec, parents=None if spec.parents is None else spec.parents[r0:r1],
                   draft_slots=None if spec.draft_slots is None else spec.draft_slots[r0:r1], _cache={})


def _sub_batch(fb: ForwardBatch, r0: int, r1: int, t0: int, t1: int) -> ForwardBatch:
    """Requests ``[r0, r1)`` whose new tokens are ``[t0, t1)`` of the batch, as a ForwardBatch."""
    def cut(x):
        return None if x is None else x[r0:r1]

    return replace(
        fb, batch_size=r1 - r0, req_pool_indices=fb.req_pool_indices[r0:r1], seq_lens=fb.seq_lens[r0:r1],
        out_cache_loc=fb.out_cache_loc[t0:t1], positions=fb.positions[t0:t1],
        seq_lens_cpu=list(fb.seq_lens_cpu[r0:r1]), extend_prefix_lens=cut(fb.extend_prefix_lens),
        extend_seq_lens=cut(fb.extend_seq_lens), extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu[r0:r1]),
        extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu[r0:r1]), spec_info=_sub_spec(fb.spec_info, r0, r1))


def split_batch(fb: ForwardBatch) -> list[tuple[ForwardBatch, int, int]]:
    """``[(sub_batch, token_start, token_end), …]``: child 0 the first ``ceil(B/2)`` requests, child 1 the rest (none
    when B = 1); token ranges index ``q``/``k``/``v`` rows."""
    counts = _token_counts(fb)
    cut_r = split_point(fb.batch_size)
    cut_t = sum(counts[:cut_r])
    total = sum(counts)
    parts = [(_sub_batch(fb, 0, cut_r, 0, cut_t), 0, cut_t)]
    if cut_r < fb.batch_size:
        parts.append((_sub_batch(fb, cut_r, fb.batch_size, cut_t, total), cut_t, total))
    return parts


class TboAttnBackend(AttentionBackend):
    """TBO wrapper over ``primary`` and ``children = [child0, child1]`` (three distinct instances). Metadata: primary on
    the whole batch, each child on its half; ``forward`` returns [T, H*Dv] in batch order. CUDA-graph hooks go to the
    primary (as sglang)."""

    name = "tbo"

    def __init__(self, primary: AttentionBackend, children: Sequence[AttentionBackend]) -> None:
        if len(children) != 2:
            raise BuildError(f"TBO needs exactly 2 children, got {len(children)}", code="tbo_children",
                             flags=[("children", len(children))], allowed=["2"],
                             remedy="build three instances with the same factory: primary + 2 children")
        self.primary = primary
        self.children = list(children)
        self._split: Optional[tuple[ForwardBatch, list[tuple[ForwardBatch, int, int]]]] = None
        self._graph_mode = False

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan the primary on the full batch and each child on its half."""
        self._graph_mode = False
        self.primary.init_forward_metadata(forward_batch)
        parts = split_batch(forward_batch)
        for i, (sub, _, _) in enumerate(parts):
            self.children[i].init_forward_metadata(sub)
        self._split = (forward_batch, parts)

    def _parts(self, fb: ForwardBatch) -> list[tuple[ForwardBatch, int, int]]:
        if self._split is None or self._split[0] is not fb:
            self.init_forward_metadata(fb)
        return self._split[1]

    def _run(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, save_kv_cache: bool):
        import torch

        if self._graph_mode:  # captured/replayed decode: the primary holds the graph metadata for the full batch
            return self.primary.forward(q, k, v, layer, fb, save_kv_cache=save_kv_cache)
        outs = []
        for i, (sub, t0, t1) in enumerate(self._parts(fb)):
            ks = None if k is None else k[t0:t1]
            vs = None if v is None else v[t0:t1]
            outs.append(self.children[i].forward(q[t0:t1], ks, vs, layer, sub, save_kv_cache=save_kv_cache))
        return torch.cat(outs, dim=0)

    def forward_extend(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Extend on both halves; q [T, H, D] → [T, H*Dv]."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Decode on both halves; q [B, H, D] → [B, H*Dv]."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Graph buffers for the primary (which captures the full batch)."""
        self.primary.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        """Graph capture plans the primary for the full batch; forward then runs the primary."""
        self.primary.init_forward_metadata_capture_cuda_graph(*args, **kwargs)
        self._graph_mode = True

    def init_forward_metadata_replay_cuda_graph(self, *args: Any, **kwargs: Any) -> None:
        """Re-plan the primary before a replay (outside the graph)."""
        self.primary.init_forward_metadata_replay_cuda_graph(*args, **kwargs)
        self._graph_mode = True

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.primary.get_cuda_graph_seq_len_fill_value()

    def _members(self) -> list[AttentionBackend]:
        seen: list[AttentionBackend] = []
        for b in [self.primary, *self.children]:
            if not any(b is s for s in seen):
                seen.append(b)
        return seen

    def owned_buffers(self) -> list[Any]:
        """Buffers of the primary and both children."""
        return [buf for b in self._members() for buf in b.owned_buffers()]

    def close(self) -> None:
        """Close the primary and both children (each object once)."""
        for b in self._members():
            b.close()
        self._split = None
