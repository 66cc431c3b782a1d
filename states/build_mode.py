"""build-mode: which instances to build, on which workspace, and building them.

Modes, checked in sglang's order: PD-mux (``enable_pdmux``) → one prefill backend on a *private*
workspace plus ``sm_group_num`` decode backends on the one *shared* workspace
(``decode_attn_backend`` = the group's first); TBO (``enable_two_batch_overlap`` and not a draft
worker) → a wrapper with one primary and two children built by the same factory (3 instances,
all on the shared workspace); else one backend. A draft worker's TBO is skipped and recorded.
When prefill ≠ decode every instance is a hybrid of a prefill and a decode backend (sglang calls
it experimental), and both halves are instances of the plan (roles ``….prefill``/``….decode``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pipeline.core.contracts import (
    AttentionArgs, BuildPlan, InstancePlan, LayerKind, Mode, ResolvedAttentionBackendStr, Skip, WorkspacePlan,
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


@dataclass
class Built:
    """What build-mode made: the top-level backend, the decode backend (group) and every instance."""

    plan: BuildPlan
    attn_backend: Any = None
    decode_attn_backend: Any = None
    decode_attn_backend_group: list[Any] = field(default_factory=list)
    instances: dict[str, Any] = field(default_factory=dict)

    def complete(self) -> bool:
        return self.attn_backend is not None and all(i.role in self.instances for i in self.plan.instances)


def _compose(plan: BuildPlan, instances: dict[str, Any], top: str) -> Any:
    if plan.hybrid:
        from pipeline.backends.hybrid import HybridAttnBackend

        return HybridAttnBackend(instances[f"{top}.prefill"], instances[f"{top}.decode"])
    return instances[top]


def apply(plan: BuildPlan, make_instance: Callable[[InstancePlan], Any], built: Built) -> Built:
    """Build every planned instance through ``make_instance`` and compose wrappers.

    Instances are added to ``built.instances`` as they are made, so a failure half-way leaves
    ``built`` listing exactly what must be released.
    """
    for inst in plan.instances:
        built.instances[inst.role] = make_instance(inst)
    if plan.mode is Mode.PDMUX:
        tops = sorted({r.role.split(".")[1] for r in plan.instances if r.role.startswith("pdmux.decode")},
                      key=lambda s: int(s[len("decode"):]))
        built.attn_backend = _compose(plan, built.instances, "pdmux.prefill")
        built.decode_attn_backend_group = [_compose(plan, built.instances, f"pdmux.{t}") for t in tops]
        built.decode_attn_backend = built.decode_attn_backend_group[0]
    elif plan.mode is Mode.TBO:
        from pipeline.backends.tbo import TboAttnBackend

        parts = [_compose(plan, built.instances, f"tbo.{t}") for t in ("primary", "child0", "child1")]
        built.attn_backend = TboAttnBackend(parts[0], children=parts[1:])
    else:
        built.attn_backend = _compose(plan, built.instances, "primary")
    return built
