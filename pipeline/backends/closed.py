"""A closed backend refuses every call that would read its released buffers, at no cost to an open one.

:func:`mark_closed` moves a backend to the closed view of its class: the same class with every method of
:data:`GUARDED_METHODS` (sglang's forward, metadata and CUDA-graph methods) raising
:class:`pipeline.core.errors.BackendClosed`, naming the backend and the method; attributes and ``isinstance`` are
kept, and no forward call pays for a check. :class:`pipeline.backends.base.AttentionBackend` wraps every
subclass's ``close`` with :func:`_closing`, so closing any backend marks it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable


# The methods a closed backend refuses (sglang's backend contract: everything that reads its buffers).
GUARDED_METHODS = ("init_forward_metadata", "init_cuda_graph_state", "init_forward_metadata_capture_cuda_graph",
                   "init_forward_metadata_replay_cuda_graph", "forward", "forward_extend", "forward_decode")
_CLOSED_VIEWS: dict[type, type] = {}


def _refuse(method: str) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        from pipeline.core.errors import BackendClosed

        name = getattr(self, "name", type(self).__name__)
        raise BackendClosed(f"{type(self).__name__}.{method}() was called after close() released this backend",
                            code="backend_closed", state="closed", flags=[("backend", name), ("method", method)],
                            remedy="build new backends with build_attention_backends() (AttentionBackends.close() "
                                   "or a failed start released these); drop references to the old ones")
    refuse.__name__ = method
    return refuse


def mark_closed(backend: Any) -> None:
    """Move ``backend`` to the closed view of its class, whose :data:`GUARDED_METHODS` raise
    :class:`pipeline.core.errors.BackendClosed` (idempotent; attributes and ``isinstance`` are kept)."""
    cls = type(backend)
    if getattr(cls, "_closed_view", False):
        return
    view = _CLOSED_VIEWS.get(cls)
    if view is None:
        ns = {"_closed_view": True, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
              "__doc__": cls.__doc__, **{m: _refuse(m) for m in GUARDED_METHODS}}
        view = _CLOSED_VIEWS[cls] = type(cls)(cls.__name__, (cls,), ns)
    backend.__class__ = view


def _closing(close: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(close)
    def wrapper(self: Any) -> Any:
        out = close(self)
        mark_closed(self)
        return out

    wrapper._marks_closed = True  # type: ignore[attr-defined]
    return wrapper
