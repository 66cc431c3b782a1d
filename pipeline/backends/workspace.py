"""Workspace buffers, handed out as "shared" or "private" and accounted in bytes.

Rule (sglang PD-mux): the prefill backend gets a private workspace, every decode-group member shares one; TBO children
and hybrid halves share the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pipeline.core.contracts import WorkspacePlan


@dataclass(eq=False)
class Workspace:
    """One workspace: ``buffer`` is a uint8 tensor of ``nbytes`` on the device (or None if 0 bytes)."""

    id: str
    owner: str
    nbytes: int
    buffer: Optional[Any] = None
    shared_by: list[str] = field(default_factory=list)

    def plan(self) -> WorkspacePlan:
        return WorkspacePlan(id=self.id, owner=self.owner, bytes=self.nbytes, shared_by=list(self.shared_by))


class WorkspacePool:
    """Allocates the planned workspaces (bytes) on ``torch_device``, one :class:`Workspace` per :class:`WorkspacePlan`
    (shared: the same object for every role), released by :meth:`release_all`."""

    def __init__(self, torch_device: str) -> None:
        self.torch_device = torch_device
        self._by_id: dict[str, Workspace] = {}

    def allocate(self, plan: WorkspacePlan) -> Workspace:
        """Allocate the buffer of ``plan`` (once; later calls return the same Workspace)."""
        if plan.id not in self._by_id:
            import torch

            buf = torch.empty(plan.bytes, dtype=torch.uint8, device=self.torch_device)
            self._by_id[plan.id] = Workspace(id=plan.id, owner=plan.owner, nbytes=plan.bytes, buffer=buf,
                                             shared_by=list(plan.shared_by))
        return self._by_id[plan.id]

    def get(self, ws_id: str) -> Workspace:
        return self._by_id[ws_id]

    @property
    def workspaces(self) -> list[Workspace]:
        return list(self._by_id.values())

    def total_bytes(self) -> int:
        return sum(w.nbytes for w in self._by_id.values())

    def release_all(self) -> list[str]:
        """Drop every buffer; returns the ids released."""
        ids = list(self._by_id)
        for w in self._by_id.values():
            w.buffer = None
        self._by_id.clear()
        return ids
