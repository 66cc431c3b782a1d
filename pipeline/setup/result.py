"""``AttentionBackends``: what the pipeline hands back to the engine (the seed's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.core.contracts import BuildPlan, DeviceFacts, Resolution, Skip


@dataclass
class AttentionBackends:
    """The built backends with sglang's ModelRunner attribute names, plus what the run decided.

    ``attn_backend`` (top-level, maybe a wrapper), ``decode_attn_backend`` / ``decode_attn_backend_group`` (PD-mux; else
    None / []), ``prefill_attention_backend_str`` / ``decode_attention_backend_str``; ``instances``: role → backend;
    ``pools``: those built here (empty for engine pools); ``device_facts``; ``resolution``, ``plan``, ``graphs``,
    ``lazy_mem``, ``agreement``, ``settings``. ``close()`` (or ``with``) releases what this run owns; then the backend
    attributes raise :class:`pipeline.core.errors.BackendClosed`.
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
        for name in BACKEND_ACCESSORS:  # reading one now goes to __getattr__, which raises BackendClosed
            self.__dict__.pop(name, None)
        self.closed = True
        return released

    def __getattr__(self, name: str) -> Any:
        """Only called for an attribute that is not there: a backend accessor after :meth:`close`."""
        if name in BACKEND_ACCESSORS and self.__dict__.get("closed"):
            raise closed_error(type(self).__name__, name, self.__dict__.get("run_id", ""))
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"attn_backend={type(self.attn_backend).__name__}"
        return (f"AttentionBackends(run_id={self.run_id!r}, prefill={self.prefill_attention_backend_str!r}, "
                f"decode={self.decode_attention_backend_str!r}, {state})")

    def __enter__(self) -> "AttentionBackends":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


BACKEND_ACCESSORS = ("attn_backend", "decode_attn_backend", "decode_attn_backend_group")


def closed_error(owner: str, name: str, run_id: str = "") -> Exception:
    """The :class:`pipeline.core.errors.BackendClosed` for reading ``owner.name`` after ``close()``."""
    from pipeline.core.errors import BackendClosed

    return BackendClosed(f"{owner}.{name} was read after close() released the backends of this run",
                         code="backend_closed", state="closed", flags=[("attribute", name), ("run_id", run_id)],
                         remedy="build new backends with build_attention_backends() and read them from its result; "
                                "close() only when done with them")


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
