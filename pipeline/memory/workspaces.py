"""The planned backend workspaces against the need and the device's memory, before anything is allocated; torch-free.

:func:`check_workspaces`: build-mode's ``workspace_too_small`` check. :func:`check_workspaces_fit`:
``workspace_exceeds_memory`` above :data:`~pipeline.memory.pools.POOL_MEMORY_SHARE` of the profile's total (``plan``) or
free memory (preflight). Remedies are true: a size that fits beside pools and graphs, a smaller top, or no graphs.
"""

from __future__ import annotations

from typing import Any, Callable

from pipeline.backends import registry
from pipeline.backends.capability import WorkspaceQuery
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import POOL_MEMORY_SHARE, remedy_available


PLAN_TOTAL_NOTE = ("plan cannot know the free memory a run will find, at most this total, so it checks against the "
                   "total")


def need_at(request: Any, d: Any, facts: Any) -> Callable[[int], int]:
    """``need(bs)``: the bytes each planned workspace of ``d`` must hold (its users' largest need) with graphs up to
    ``bs`` (0: none)."""
    kinds, plan = request.served_model.layer_kinds(), d.plan
    users = {ws.id: sorted({i.backend for i in plan.instances if i.workspace == ws.id}) for ws in plan.workspaces}

    def need(bs: int) -> int:
        q = WorkspaceQuery(kinds=kinds, num_sms=facts.sm_count, max_reqs=request.pool.max_reqs, graph_max_bs=bs,
                           **graph_step(request))
        return max([registry.get(b).workspace_need(q) for b in sum(users.values(), [])] or [0])
    return need


def graph_step(request: Any) -> dict[str, Any]:
    """``graph_mode`` / ``graph_tokens`` of a :class:`WorkspaceQuery` for ``request``: the step its graphs capture
    (:func:`states.build_mode.graph_mode` of its settled speculative shape) and the rows per captured request."""
    from pipeline.core.speculative import settled
    from states.build_mode import graph_mode

    spec = settled(request)
    mode = graph_mode(spec, request.is_draft_worker)
    tokens = {"target_verify": getattr(spec, "num_draft_tokens", 1), "draft_decode": getattr(spec, "topk", 1)}
    return {"graph_mode": mode, "graph_tokens": tokens.get(mode, 1)}


def workspace_setting(d: Any) -> tuple[str, Any]:
    """``(name, value)`` of the setting that sized the workspaces (its environment variable when that set it), as
    :func:`pipeline.setup.instances.check_workspace_memory` names it; ``("workspace_bytes", None)`` without one."""
    s = max(d.settings, key=lambda s: s.value) if d.settings else None
    if s is None:
        return "workspace_bytes", None
    return (s.env_var if s.source == "env" and s.env_var else s.field), s.value


def check_workspaces(req: Any, d: Any, facts: Any, fits: Any = None) -> None:
    """Build-mode's check of each planned workspace of ``d`` against the largest batch its users plan
    (:meth:`~pipeline.backends.registry.BackendEntry.check_workspace`). Raises ConfigError ``workspace_too_small``
    naming the variable or field; the remedy stays within each one's memory share less the margin and, with ``fits(ws,
    bs)``, beside the KV pools."""
    kinds, max_bs = req.served_model.layer_kinds(), d.graph_max_bs(req, facts)
    from_env = {s.value: s.env_var for s in d.settings if s.source == "env" and s.env_var}
    from_field = {s.value for s in d.settings if s.source == "field"}
    total = facts.total_memory_bytes
    max_ws = int(remedy_available(total) * POOL_MEMORY_SHARE) // max(len(d.plan.workspaces), 1) if total > 0 else 0
    for ws in d.plan.workspaces:
        for backend in sorted({i.backend for i in d.plan.instances if i.workspace == ws.id}):
            registry.get(backend).check_workspace(ws.bytes, WorkspaceQuery(
                kinds=kinds, num_sms=facts.sm_count, max_reqs=req.pool.max_reqs, graph_max_bs=max_bs, **graph_step(req),
                graph_bs=tuple(req.args.cuda_graph_bs or ()), graph_bs_given=bool(req.args.cuda_graph_bs),
                max_bs_given=req.args.cuda_graph_max_bs is not None, env_var=from_env.get(ws.bytes, ""),
                field_given=ws.bytes in from_field, max_bytes=max_ws, fits=fits))


def check_workspaces_fit(request: Any, d: Any, facts: Any, memory_bytes: int, *, pool_bytes: int = 0,
                         graph_bytes: int = 0, total: bool = False, device: str = "") -> None:
    """Raise ConfigError ``workspace_exceeds_memory`` (state ``build-mode``) when the planned workspaces are above
    :data:`POOL_MEMORY_SHARE` of ``memory_bytes`` (0: no check). ``pool_bytes`` / ``graph_bytes`` must fit beside them.
    Remedy: each workspace at its share less the margin and those bytes (when >= the need); else the need at a smaller
    top (<= :data:`~pipeline.core.numbers.REMEDY_MAX_BS`); else ``disable_cuda_graph``; else a larger device."""
    from pipeline.core.numbers import REMEDY_MAX_BS, largest_fitting

    ws, n = d.plan.workspace_bytes, max(len(d.plan.workspaces), 1)
    share = int(memory_bytes * POOL_MEMORY_SHARE)
    if not ws or memory_bytes <= 0 or ws <= share:
        return
    name, value = workspace_setting(d)
    room = int(remedy_available(memory_bytes) * POOL_MEMORY_SHARE) - pool_bytes  # the workspaces' and graphs' bytes
    need, top = need_at(request, d, facts), d.graph_max_bs(request, facts)
    now, per = need(top), (room - graph_bytes) // n
    fixes = [f"set {name} to {per} or less (at least the {now} bytes the largest planned batch needs)"] \
        if now <= per else []
    if not fixes:
        bs = largest_fitting(range(1, min(top, request.pool.max_reqs, REMEDY_MAX_BS + 1)), lambda b: need(b) <= per)
        if bs is not None:
            sizes = (f"use only sizes up to {bs} in cuda_graph_bs" if request.args.cuda_graph_bs
                     else f"cuda_graph_max_bs={bs}")
            fixes.append(f"set {name}={need(bs)} and {sizes}")
        elif top and need(0) <= room // n:
            fixes.append(f"set {name}={need(0)} and disable_cuda_graph=True")
    where = f"{memory_bytes} bytes in all ({PLAN_TOTAL_NOTE})" if total else f"{memory_bytes} bytes free"
    raise ConfigError(f"the planned workspaces need {ws} bytes but {device or facts.type} has {where}; "
                      f"{POOL_MEMORY_SHARE:.0%} of it may be used", code="workspace_exceeds_memory",
                      state="build-mode",
                      flags=[(name, value), ("workspaces", n), ("needed_bytes", now),
                             ("total_memory_bytes" if total else "available_bytes", memory_bytes)],
                      allowed=[f"<= {share // n} bytes per workspace"],
                      remedy=", or ".join(fixes) if fixes else "use a device with more memory (not even the "
                                                                f"{now} bytes needed fit this one)")

