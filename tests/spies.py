"""Test spies: observe what a wrapper (TBO, hybrid) hands to its inner backends.

The shipped wrappers keep no per-call record (the per-layer path must not sync or grow); tests wrap
the inner backends instead. A :class:`Spy` forwards every call to the backend it wraps and appends a
:class:`Call` to a shared journal — reading the request rows on the host, which only a test may do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pipeline.backends.base import AttentionBackend


@dataclass(frozen=True)
class Call:
    """One call an inner backend received: its ``role``, ``method`` (``init_forward_metadata`` or
    ``forward``), the batch's ``forward_mode`` value, its ``req_to_token`` ``rows`` and, for
    ``forward``, the ``layer_id``."""

    role: str
    method: str
    forward_mode: str
    rows: tuple[int, ...]
    layer_id: Optional[int] = None


class Spy(AttentionBackend):
    """Forwards everything to ``inner`` and journals planning and layer calls under ``role``."""

    def __init__(self, inner: AttentionBackend, role: str, journal: list[Call]) -> None:
        self.inner, self.role, self.journal = inner, role, journal
        self.name = inner.name

    def _note(self, method: str, fb: Any, layer_id: Optional[int] = None) -> None:
        rows = tuple(int(r) for r in fb.req_pool_indices.tolist())
        self.journal.append(Call(self.role, method, fb.forward_mode.value, rows, layer_id))

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self._note("init_forward_metadata", forward_batch)
        self.inner.init_forward_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._note("forward", forward_batch, layer.layer_id)
        return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def init_cuda_graph_state(self, *a: Any) -> None:
        self.inner.init_cuda_graph_state(*a)

    def init_forward_metadata_capture_cuda_graph(self, *a: Any, **kw: Any) -> None:
        self.inner.init_forward_metadata_capture_cuda_graph(*a, **kw)

    def init_forward_metadata_replay_cuda_graph(self, *a: Any, **kw: Any) -> None:
        self.inner.init_forward_metadata_replay_cuda_graph(*a, **kw)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def owned_buffers(self) -> list[Any]:
        return self.inner.owned_buffers()

    def close(self) -> None:
        self.inner.close()


def spy_tbo(tbo: Any) -> list[Call]:
    """Wrap a TboAttnBackend's primary and children (roles ``primary``, ``tbo_child_0``/``_1``); returns the journal."""
    journal: list[Call] = []
    tbo.primary = Spy(tbo.primary, "primary", journal)
    tbo.children = [Spy(c, f"tbo_child_{i}", journal) for i, c in enumerate(tbo.children)]
    return journal


def spy_hybrid(hybrid: Any) -> list[Call]:
    """Wrap a HybridAttnBackend's halves (roles ``prefill`` and ``decode``); returns the journal."""
    journal: list[Call] = []
    hybrid.prefill_backend = Spy(hybrid.prefill_backend, "prefill", journal)
    hybrid.decode_backend = Spy(hybrid.decode_backend, "decode", journal)
    return journal
