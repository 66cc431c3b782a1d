"""Hybrid wrapper (sglang's ``HybridAttnBackend``): one backend for extend, another for decode.

Extend, target verify and draft extend go to the prefill backend, decode and draft decode to the decode backend;
CUDA-graph hooks to the captured mode's backend.
"""

from __future__ import annotations

from typing import Any, Optional

from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch

__all__ = ["HybridAttnBackend"]


class HybridAttnBackend(AttentionBackend):
    """Route extend → ``prefill_backend``, decode → ``decode_backend`` (may be one object): [T, H*Dv] in q's dtype;
    :meth:`close` closes each distinct object once."""

    name = "hybrid"

    def __init__(self, prefill_backend: AttentionBackend, decode_backend: AttentionBackend) -> None:
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self._graph_state: Optional[tuple[int, int]] = None
        self._graph_ready: list[AttentionBackend] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan the batch on the backend its forward mode routes to."""
        backend = self.decode_backend if forward_batch.forward_mode.is_decode_like else self.prefill_backend
        backend.init_forward_metadata(forward_batch)

    def forward_extend(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Extend on the prefill backend: q [T, H, D] → [T, H*Dv]."""
        return self.prefill_backend.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)

    def forward_decode(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch, save_kv_cache: bool = True):
        """Decode on the decode backend: q [B, H, D] → [B, H*Dv]."""
        return self.decode_backend.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Graph buffers of the decode backend (decode and draft decode graphs); the prefill backend makes its own at
        its first capture, when a speculative target worker captures target verify on it."""
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_state, self._graph_ready = (max_bs, max_num_tokens), [self.decode_backend]

    def _graph_backend(self, forward_mode: Any) -> AttentionBackend:
        backend = self.decode_backend if forward_mode.is_decode_like else self.prefill_backend
        if self._graph_state is not None and not any(b is backend for b in self._graph_ready):
            backend.init_cuda_graph_state(*self._graph_state)
            self._graph_ready.append(backend)
        return backend

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info) -> None:
        self._graph_backend(forward_mode).init_forward_metadata_capture_cuda_graph(
            bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu=None) -> None:
        self._graph_backend(forward_mode).init_forward_metadata_replay_cuda_graph(
            bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def _members(self) -> list[AttentionBackend]:
        if self.prefill_backend is self.decode_backend:
            return [self.prefill_backend]
        return [self.prefill_backend, self.decode_backend]

    def owned_buffers(self) -> list[Any]:
        """Buffers of both halves (a shared object counted once)."""
        return [buf for b in self._members() for buf in b.owned_buffers()]

    def close(self) -> None:
        """Close both halves, each distinct object once."""
        for b in self._members():
            b.close()
