"""npu-lazy-mem: NPU zbal lazy device memory before graph capture (sglang's rule: ``npu``, zbal size > 0, not a draft
worker; world rank, size and CPU group). Otherwise skipped with the reason."""

from __future__ import annotations

import msgspec


class LazyMemDecision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``run``: whether to initialise; ``nbytes``: size in bytes; ``reason``: why skipped (if so)."""

    run: bool
    nbytes: int = 0
    reason: str = ""


def decide(device_type: str, nbytes: int, source: str, is_draft_worker: bool) -> LazyMemDecision:
    """Pure decision; ``source`` says where ``nbytes`` came from (field, env, default)."""
    if device_type != "npu":
        return LazyMemDecision(run=False, reason=f"device type is {device_type!r}, zbal lazy memory exists on npu only")
    if is_draft_worker:
        return LazyMemDecision(run=False, reason="draft worker: the target worker owns zbal lazy memory")
    if nbytes <= 0:
        return LazyMemDecision(run=False, reason=f"zbal_local_mem_size is 0 (from {source})")
    return LazyMemDecision(run=True, nbytes=nbytes)
