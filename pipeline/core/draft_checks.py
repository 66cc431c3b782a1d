"""The draft worker's fields of a :class:`~pipeline.core.contracts.SetupRequest`, checked as the CLI checks its flags.

``draft_model`` and ``args.speculative_draft_attention_backend`` only mean something on a draft worker: a target
worker ignores both (sglang reads the draft backend only in its draft worker), so a request that sets either with
``is_draft_worker=False`` is refused (the CLI refuses ``--draft-model`` and ``--speculative-draft-attention-backend``
without ``--draft-worker`` the same way, before the request is built). One exception, for engines: a speculative
server (``speculative_algorithm`` set) hands its target and draft workers one set of args, as sglang's ServerArgs,
so there the target worker's request may carry the draft backend, which it ignores.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.errors import ConfigError


def check_draft_fields(r: Any) -> None:
    """Raise ConfigError when ``r`` sets a draft-only field without ``is_draft_worker``: ``invalid_value`` naming
    ``draft_model``; ``conflicting_options`` naming ``speculative_draft_attention_backend`` and ``is_draft_worker`` (unless
    ``speculative_algorithm`` is set: a speculative server's args, shared with its draft worker)."""
    if r.is_draft_worker:
        return
    if r.draft_model is not None:
        raise ConfigError(f"draft_model={r.draft_model.source or '<spec>'} is not allowed", code="invalid_value",
                          flags=[("draft_model", r.draft_model.source or "<spec>")],
                          allowed=["only with is_draft_worker=True"],
                          remedy="set is_draft_worker=True to initialize the draft worker, or drop draft_model")
    backend = r.args.speculative_draft_attention_backend
    if backend is not None and r.args.speculative_algorithm is None:
        raise ConfigError("speculative_draft_attention_backend is set but is_draft_worker is False: a target worker "
                          "ignores it (sglang reads it only in its draft worker)", code="conflicting_options",
                          flags=[("speculative_draft_attention_backend", backend), ("is_draft_worker", False)],
                          allowed=["speculative_draft_attention_backend only with is_draft_worker=True, or on a "
                                   "speculative server's target worker (speculative_algorithm set)"],
                          remedy="set is_draft_worker=True to initialize the draft worker, or drop "
                                 "speculative_draft_attention_backend")
