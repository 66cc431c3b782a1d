"""build-mode: which instances to build and on which workspace (the plan; the setup table builds it).

Modes, checked in sglang's order: PD-mux (``enable_pdmux``) → one prefill backend on a *private*
workspace plus ``sm_group_num`` decode backends on the one *shared* workspace
(``decode_attn_backend`` = the group's first); TBO (``enable_two_batch_overlap`` and not a draft
worker) → a wrapper with one primary and two children built by the same factory (3 instances,
all on the shared workspace); else one backend. A draft worker's TBO is skipped and recorded.
When prefill ≠ decode every instance is a hybrid of a prefill and a decode backend (sglang calls
it experimental), and both halves are instances of the plan (roles ``….prefill``/``….decode``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pipeline.core.contracts import (
    AttentionArgs, BuildPlan, InstancePlan, Mode, ResolvedAttentionBackendStr, Skip, WorkspacePlan,
)


def decide_mode(args: AttentionArgs, is_draft_worker: bool) -> tuple[Mode, list[Skip]]:
    """The build mode and any skip (PD-mux + TBO together are refused earlier, in resolve)."""
    if args.enable_pdmux:
        return Mode.PDMUX, []
    if args.enable_two_batch_overlap:
        if is_draft_worker:
            return Mode.NORMAL, [Skip(what="two_batch_overlap",
                                      reason="draft worker: TBO applies to the target worker only (as sglang)",
                                      avoid={"enable_two_batch_overlap": False})]
        return Mode.TBO, []
    return Mode.NORMAL, []


def _tops(mode: Mode, sm_group_num: int) -> list[tuple[str, bool]]:
    """(role, private workspace?) of each top-level instance slot."""
    if mode is Mode.PDMUX:
        return [("pdmux.prefill", True)] + [(f"pdmux.decode{i}", False) for i in range(sm_group_num)]
    if mode is Mode.TBO:
        return [("tbo.primary", False), ("tbo.child0", False), ("tbo.child1", False)]
    return [("primary", False)]


def decide(args: AttentionArgs, pair: ResolvedAttentionBackendStr, *, is_draft_worker: bool,
           workspace_bytes: Callable[[str], int]) -> BuildPlan:
    """The plan: instances ``[{role, backend, workspace}]`` and workspaces ``[{id, owner, bytes, shared_by}]``.

    ``workspace_bytes(backend)`` gives the bytes one backend needs (0 = none; a 0-byte workspace
    is still planned so the sharing rule is visible for every backend).
    """
    mode, skips = decide_mode(args, is_draft_worker)
    hybrid = pair.prefill != pair.decode
    instances: list[InstancePlan] = []
    shared: Optional[dict[str, Any]] = None
    privates: list[WorkspacePlan] = []
    for top, private in _tops(mode, args.sm_group_num):
        halves = [(f"{top}.prefill", pair.prefill), (f"{top}.decode", pair.decode)] if hybrid else [(top, pair.prefill)]
        need = max(workspace_bytes(b) for _, b in halves)
        if private:
            ws_id = f"ws-private-{top}"
            privates.append(WorkspacePlan(id=ws_id, owner=top, bytes=need, shared_by=[r for r, _ in halves]))
        else:
            if shared is None:
                shared = dict(id="ws-shared", owner=halves[0][0], bytes=need, shared_by=[])
            shared["bytes"] = max(shared["bytes"], need)
            shared["shared_by"] += [r for r, _ in halves]
            ws_id = "ws-shared"
        instances += [InstancePlan(role=r, backend=b, workspace=ws_id) for r, b in halves]
    workspaces = privates + ([WorkspacePlan(**shared)] if shared else [])
    return BuildPlan(mode=mode, hybrid=hybrid, instances=instances, workspaces=workspaces, skips=skips)
