"""Drop-in attributes for an engine's ModelRunner: what sglang's ModelRunner exposes after the seed PR.

An engine that keeps its own ``initialize()`` can replace its inline attention setup with::

    self._attn = ModelRunnerAttention(request, pools={"req_to_token_pool": ..., "kv_pool": ...})
    self._attn.init_attention_backends()
    self.attn_backend = self._attn.attn_backend                      # TBO / hybrid wrapper where asked
    self.decode_attn_backend = self._attn.decode_attn_backend        # PD-mux's first decode backend, else None
    self.decode_attn_backend_group = self._attn.decode_attn_backend_group   # PD-mux's decode backends, else []

``init_attention_backends()`` runs the six-state pipeline once (a second call raises
:class:`~pipeline.core.errors.OrderingError`); before it, the three attributes are None / None / []
as in sglang's ``__init__``. Nothing here imports torch until the call.
"""

from __future__ import annotations

from typing import Any, Optional

from pipeline.core.contracts import SetupRequest
from pipeline.core.errors import OrderingError


class ModelRunnerAttention:
    """sglang ModelRunner's attention attributes, filled by :meth:`init_attention_backends`.

    Parameters are those of :func:`pipeline.setup.build.build_attention_backends` (``pools``: the engine's
    own ``req_to_token_pool`` and ``kv_pool``, built before the backends as sglang does).
    """

    def __init__(self, request: SetupRequest, *, pools: Optional[dict[str, Any]] = None, platform: Any = None,
                 log_file: Optional[str] = None, cpu_group: Any = None, rank_group: Any = None,
                 installed: Optional[dict[str, bool]] = None) -> None:
        self.request = request
        self._kw = dict(pools=pools, platform=platform, log_file=log_file, cpu_group=cpu_group, rank_group=rank_group,
                        installed=installed)
        self.attn_backend: Any = None
        self.decode_attn_backend: Any = None
        self.decode_attn_backend_group: list[Any] = []
        self.prefill_attention_backend_str: Optional[str] = None
        self.decode_attention_backend_str: Optional[str] = None
        self.result: Any = None

    def init_attention_backends(self) -> None:
        """Run the pipeline and set the attributes; raises its typed errors unchanged.

        Raises OrderingError (``out_of_order``) when called twice on the same object.
        """
        if self.result is not None:
            raise OrderingError("init_attention_backends() already ran for this runner", state="done",
                                flags=[("attn_backend", type(self.attn_backend).__name__)],
                                remedy="call it once per model runner; close() and build a new one to re-initialise")
        from pipeline.setup.build import build_attention_backends

        out = build_attention_backends(self.request, **self._kw)
        self.result = out
        self.attn_backend = out.attn_backend
        self.decode_attn_backend = out.decode_attn_backend
        self.decode_attn_backend_group = out.decode_attn_backend_group
        self.prefill_attention_backend_str = out.prefill_attention_backend_str
        self.decode_attention_backend_str = out.decode_attention_backend_str

    def close(self) -> list[str]:
        """Release what the pipeline built (not the engine's pools); returns what was released. After it, reading
        the three backend attributes raises :class:`~pipeline.core.errors.BackendClosed` (as
        :class:`~pipeline.setup.result.AttentionBackends` does); before ``init_attention_backends()`` there was
        nothing to release and they stay None / None / []."""
        from pipeline.setup.result import BACKEND_ACCESSORS

        if self.result is None:
            return []
        released = self.result.close()
        for name in BACKEND_ACCESSORS:
            self.__dict__.pop(name, None)
        return released

    def __getattr__(self, name: str) -> Any:
        """Only called for an attribute that is not there: a backend attribute after :meth:`close`."""
        from pipeline.setup.result import BACKEND_ACCESSORS, closed_error

        result = self.__dict__.get("result")
        if name in BACKEND_ACCESSORS and result is not None and result.closed:
            raise closed_error(type(self).__name__, name, result.run_id)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
