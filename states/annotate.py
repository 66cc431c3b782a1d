"""annotate: the resolved names on the top-level backend object (a wrapper included), as sglang does.

The setup table's annotate step (:mod:`pipeline.setup.table`) applies it and logs ``backends_annotated``.
"""

from __future__ import annotations

from typing import Any


def set_names(top: Any, pair: Any) -> None:
    """Set ``prefill_attention_backend_str`` / ``decode_attention_backend_str`` on ``top`` from the resolved
    ``pair`` (a :class:`~pipeline.core.contracts.ResolvedAttentionBackendStr`)."""
    top.prefill_attention_backend_str = pair.prefill
    top.decode_attention_backend_str = pair.decode
