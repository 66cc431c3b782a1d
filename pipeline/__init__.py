"""attn-setup: initialize an inference engine's attention backends as an observable state machine.

Entry point: :func:`build_attention_backends`. Importing this package imports neither torch, nor
triton, nor flashinfer (backends are imported lazily by the registry when they are built).
"""

from __future__ import annotations

from pipeline.core import launch_clock as _launch_clock  # noqa: F401 (first: when this process began running ours)

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "build_attention_backends": ("pipeline.setup.build", "build_attention_backends"),
    "AttentionBackends": ("pipeline.setup.result", "AttentionBackends"),
    "AttentionArgs": ("pipeline.core.contracts", "AttentionArgs"),
    "SetupRequest": ("pipeline.core.contracts", "SetupRequest"),
    "ModelSpec": ("pipeline.core.contracts", "ModelSpec"),
    "DeviceFacts": ("pipeline.core.contracts", "DeviceFacts"),
    "PoolFacts": ("pipeline.core.contracts", "PoolFacts"),
    "ErrorInfo": ("pipeline.core.contracts", "ErrorInfo"),
    "ResolvedAttentionBackendStr": ("pipeline.core.contracts", "ResolvedAttentionBackendStr"),
    "load_model_spec": ("pipeline.core.model_spec", "load_model_spec"),
    "EventLog": ("pipeline.core.eventlog", "EventLog"),
    "replay": ("pipeline.observe.replay", "replay"),
    "read_trace": ("pipeline.observe.trace", "read_trace"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
