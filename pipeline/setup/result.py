"""``AttentionBackends``: what the pipeline hands back to the engine (the seed's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.core.contracts import BuildPlan, DeviceFacts, Resolution, Skip


@dataclass
class AttentionBackends:
    """The built backends, with sglang's ModelRunner attribute names, plus what the run decided.

    ``attn_backend``: the top-level backend (a TBO or hybrid wrapper where the mode asks);
    ``decode_attn_backend``: PD-mux's first decode backend, else None;
    ``decode_attn_backend_group``: PD-mux's ``sm_group_num`` decode backends, else [];
    ``prefill_attention_backend_str`` / ``decode_attention_backend_str``: the resolved names.
    ``instances`` maps plan role → concrete backend; ``pools`` holds the KV pools the pipeline built
    (empty when the engine passed its own with ``pools=``: the engine keeps owning those).
    ``device_facts``: what device-init found (the instances were built for it).
    ``close()`` (or ``with``) releases every backend buffer, workspace and pool this run owns.
    """

    attn_backend: Any
    decode_attn_backend: Any
    decode_attn_backend_group: list[Any]
    prefill_attention_backend_str: str
    decode_attention_backend_str: str
    run_id: str = ""
    resolution: Optional[Resolution] = None
    plan: Optional[BuildPlan] = None
    skips: list[Skip] = field(default_factory=list)
    instances: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, Any] = field(default_factory=dict)
    workspace_pool: Any = None
    events: list[Any] = field(default_factory=list)
    torch_device: str = "cpu"
    device_facts: Optional[DeviceFacts] = None
    closed: bool = False

    def close(self) -> list[str]:
        """Release everything this run owns; returns what was released (idempotent)."""
        if self.closed:
            return []
        from pipeline.setup.build import release

        released = release(self.instances, self.workspace_pool, self.pools)
        self.attn_backend = self.decode_attn_backend = None
        self.decode_attn_backend_group = []
        self.closed = True
        return released

    def __enter__(self) -> "AttentionBackends":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
