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
    What the run decided, typed, for the caller to act on (a runner reads these, never the log):
    ``resolution`` and ``plan``; ``graphs`` (:class:`states.graphs.GraphDecision`: decode CUDA graphs captured,
    or why not); ``lazy_mem`` (:class:`states.npu_lazy_mem.LazyMemDecision`: NPU zbal memory initialised, or
    why not); ``agreement`` (:class:`pipeline.setup.context.Agreement`: how the ranks agreed on the
    resolution); ``settings`` (the :class:`~pipeline.core.settings.Setting` of each sized buffer).
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
    graphs: Any = None
    lazy_mem: Any = None
    agreement: Any = None
    settings: list[Any] = field(default_factory=list)
    closed: bool = False

    def close(self) -> list[str]:
        """Release everything this run owns; returns what was released (idempotent)."""
        if self.closed:
            return []
        released = release(self.instances, self.workspace_pool, self.pools)
        self.attn_backend = self.decode_attn_backend = None
        self.decode_attn_backend_group = []
        self.closed = True
        return released

    def __enter__(self) -> "AttentionBackends":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def release(instances: dict[str, Any], workspace_pool: Any, pools: dict[str, Any]) -> list[str]:
    """Close every backend, drop every workspace and pool; returns what was released."""
    released = []
    for role, b in list(instances.items()):
        close = getattr(b, "close", None)
        if close is not None:
            close()
        released.append(f"backend:{role}")
    instances.clear()
    if workspace_pool is not None:
        released += [f"workspace:{w}" for w in workspace_pool.release_all()]
    for name in list(pools):
        released.append(f"pool:{name}")
        pools.pop(name)
    return released
