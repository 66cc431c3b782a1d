"""annotate: set the resolved names on the top-level backend object (wrapper included), as sglang does."""

from __future__ import annotations

from typing import Any

from pipeline.core.contracts import ResolvedAttentionBackendStr


def apply(top_backend: Any, pair: ResolvedAttentionBackendStr) -> None:
    """Set ``prefill_attention_backend_str`` / ``decode_attention_backend_str`` on ``top_backend``."""
    top_backend.prefill_attention_backend_str = pair.prefill
    top_backend.decode_attention_backend_str = pair.decode
