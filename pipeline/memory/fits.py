"""``attn-setup plan``'s check of the whole plan against the device profile (KV pools, decode CUDA graphs, workspaces),
refusing what ``run`` certainly refuses, with remedies that pass the whole plan (docs/internals.md)."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, TYPE_CHECKING

import msgspec

from pipeline.backends import registry
from pipeline.core.steps import Decided
from pipeline.core.errors import ConfigError
from pipeline.core.numbers import largest_fitting, REMEDY_MAX_BS
from pipeline.core.validation import MAX_BYTES
from pipeline.memory.graphs import (estimate_for_decided, graph_trial, GraphMemoryEstimate, graphs_up_to,
    lower_bound_for_decided)
from pipeline.memory.pools import graph_fixes, POOL_MEMORY_SHARE, remedy_available
from pipeline.memory.workspaces import check_workspaces, check_workspaces_fit, need_at, workspace_setting

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import SetupRequest


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    """How ``run`` sizes its KV pool: ``mem_fraction`` (sglang's mem_fraction_static, of the device's total memory) or
    ``mem_bytes``; neither: ``pool.num_token_slots`` slots."""

    mem_fraction: Optional[float] = None
    mem_bytes: Optional[int] = None


def plan_pools(request: "SetupRequest", estimate: Optional[GraphMemoryEstimate], ws: int,
               budget: Optional[Budget] = None, total_bytes: int = 0) -> Any:
    """The :class:`~pipeline.memory.pools.PoolSizing` ``run`` makes for ``request``: ``pool.num_token_slots``, or
    ``budget`` (``mem_bytes``; ``mem_fraction`` of ``total_bytes`` less the graphs' estimate, as init-memory-pool), with
    graphs and ``ws`` workspace bytes beside. Raises ConfigError for a pool below two pages or the verification batches'
    floor, and ``invalid_value`` for ``--mem-fraction`` without the profile's memory."""
    from pipeline.core.dtypes import kv_dtype
    from pipeline.core.speculative import settled
    from pipeline.memory.pools import budget_from_fraction, check_needs, size_pools

    spec, p = request.served_model, request.pool
    kw: dict[str, Any] = dict(num_token_slots=p.num_token_slots)
    if budget is not None and (budget.mem_bytes is not None or budget.mem_fraction is not None):
        if budget.mem_bytes is not None:
            kw = dict(budget_bytes=budget.mem_bytes, source="bytes")
        elif not total_bytes:
            raise ConfigError("--mem-fraction is a share of the device's memory, and this device profile names none",
                              code="invalid_value", flags=[("mem_fraction", budget.mem_fraction)],
                              allowed=["a --device-profile with memory (e.g. h200)", "--mem-bytes"],
                              remedy="pass --device-profile NAME of the GPU to plan for, or --mem-bytes")
        else:
            kw = dict(budget_bytes=budget_from_fraction(budget.mem_fraction, total_bytes), source="mem_fraction",
                      mem_fraction=budget.mem_fraction, total_bytes=total_bytes)
        needs = check_needs(p.max_reqs, request.args.page_size, spec=settled(request), draft=request.is_draft_worker)
        kw.update(min_slots=needs.slots, min_slots_for="the verification batches of 'attn-setup run'",
                  min_context_len=needs.context)
    return size_pools(spec.layer_kinds(), spec.num_hidden_layers, kv_dtype(request.args, spec),
                      page_size=request.args.page_size, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
                      graph_reserve_bytes=0 if estimate is None else estimate.total_bytes, workspace_bytes=ws, **kw)


def check_plan_memory(request: "SetupRequest", decided: "Decided", estimate: Optional[GraphMemoryEstimate],
                      total_bytes: int, env: Mapping[str, str] = os.environ, budget: Optional[Budget] = None) -> None:
    """``plan``'s memory refusals against ``total_bytes`` (0: none), in order: workspaces alone above 90 %
    (``workspace_exceeds_memory``), the graphs (:func:`check_graphs_fit_device`), then pools (of ``budget``: a
    :class:`Budget`) + graphs + workspaces above 90 % (``pool_exceeds_memory``, state ``init-memory-pool``, with
    ``run``'s remedies)."""
    from pipeline.core.speculative import settled
    from pipeline.memory.pools import check_fits, check_needs

    if not total_bytes:
        return
    d, facts = decided["build-mode"], decided["device-init"].facts
    ws = d.plan.workspace_bytes
    s = plan_pools(request, estimate, ws, budget, total_bytes)
    pools, g = s.req_to_token_bytes + s.kv_bytes, s.graph_reserve_bytes
    check_workspaces_fit(request, d, facts, total_bytes, pool_bytes=pools, graph_bytes=g, total=True,
                         device=facts.name or facts.type)
    check_graphs_fit_device(request, decided, estimate, total_bytes, env, pool_bytes=pools)
    args = request.args
    try:
        check_fits(s, total_bytes, device=facts.name or facts.type, of_total=True, total_bytes=total_bytes,
                   mem_fraction=None if budget is None else budget.mem_fraction,
                   graph_top=args.cuda_graph_max_bs or max(args.cuda_graph_bs or [0]),
                   graphs=graph_trial(request, decided, estimate, env=env),
                   min_slots=check_needs(request.pool.max_reqs, args.page_size, spec=settled(request),
                                         draft=request.is_draft_worker).slots,
                   min_context_len=check_needs(request.pool.max_reqs, spec=settled(request),
                                               draft=request.is_draft_worker).context)
    except ConfigError as e:
        e.info = msgspec.structs.replace(e.info, state="init-memory-pool")
        raise


def refuse_early(request: "SetupRequest", decided: "Decided", bound: Optional[GraphMemoryEstimate],
                 total_bytes: int, env: Mapping[str, str] = os.environ, budget: Optional[Budget] = None) -> None:
    """:func:`check_plan_memory` with the graphs' lower ``bound`` when that alone decides a refusal (same code and
    remedy as the full estimate); returns otherwise."""
    if bound is None or not total_bytes:
        return
    share = int(total_bytes * POOL_MEMORY_SHARE)
    if bound.total_bytes <= share:
        ws = decided["build-mode"].plan.workspace_bytes
        s = plan_pools(request, None, ws, budget, total_bytes)
        rest = ws + s.req_to_token_bytes + s.kv_bytes
        if rest > share or bound.total_bytes + rest <= share:
            return
    check_plan_memory(request, decided, bound, total_bytes, env, budget)


def check_graphs_fit_device(request: "SetupRequest", decided: "Decided", estimate: Optional[GraphMemoryEstimate],
                            total_bytes: int, env: Mapping[str, str] = os.environ, pool_bytes: int = 0) -> None:
    """Raise ConfigError ``pool_exceeds_memory`` (state ``init-memory-pool``) when the graphs' ``estimate`` is above 90
    % of ``total_bytes``, or with workspaces and ``pool_bytes`` above it while those two fit; nothing without an
    estimate or memory reading.

    Remedies (:func:`pipeline.memory.pools.graph_fixes`): the largest top (<=
    :data:`~pipeline.core.numbers.REMEDY_MAX_BS`) fitting less :func:`~pipeline.memory.pools.remedy_margin`, by binary
    search, or ``disable_cuda_graph``.
    """
    if estimate is None or not total_bytes:
        return
    g, share = estimate.total_bytes, int(total_bytes * POOL_MEMORY_SHARE)
    ws = decided["build-mode"].plan.workspace_bytes
    if ws + pool_bytes > share or (g <= share and g + ws + pool_bytes <= share):
        return  # fits, or the pools are what is too large: check_plan_memory's pool refusal names them
    room = int(remedy_available(total_bytes) * POOL_MEMORY_SHARE) - ws - pool_bytes
    fixes = graph_fixes(graph_trial(request, decided, estimate, env=env), room, eager_fits=room >= 0)
    args, sizes = request.args, estimate.batch_sizes
    why = (f"above the {POOL_MEMORY_SHARE:.0%} of it ({share} bytes) that run lets the pools and graphs use"
           if g > share else f"which with the planned workspaces ({ws} bytes) and the KV pools ({pool_bytes} bytes) "
           f"is above the {POOL_MEMORY_SHARE:.0%} of it ({share} bytes) that run lets them use")
    raise ConfigError(
        f"the decode CUDA graphs for bs {sizes[0]}..{sizes[-1]} ({len(sizes)} sizes) are estimated at "
        f"{'least ' if estimate.lower_bound else ''}{g} bytes ({g / (1 << 30):.2f} GiB"
        f"{'; a lower bound, the largest size and each size kept' if estimate.lower_bound else ''}), but the device has {total_bytes} bytes in all, {why} (plan cannot know the "
        "free memory a run will find, at most this total, so it checks against the total)",
        code="pool_exceeds_memory", state="init-memory-pool",
        flags=[("cuda_graph_bs", args.cuda_graph_bs) if args.cuda_graph_bs else
               ("cuda_graph_max_bs", args.cuda_graph_max_bs), ("max_reqs", request.pool.max_reqs),
               ("graph_bytes_estimate", g), ("workspace_bytes", ws), ("pool_bytes", pool_bytes),
               ("total_memory_bytes", total_bytes)],
        allowed=[f"<= {max(share - ws - pool_bytes, 0)} bytes of decode CUDA graphs"],
        remedy=", or ".join(fixes) if fixes else "use a device with more memory (no graph size fits this one)")


def _room(stack: "SetupRequest", d: Any, total_bytes: int) -> tuple[int, int]:
    """``(bytes, n)``: what the ``n`` workspaces the workspace setting sizes (those a backend with a workspace check
    uses) and the decode graphs may take together beside the KV pools of ``stack`` (:func:`plan_pools`) and the other
    planned workspaces of build-mode's decision ``d``: 90 % of ``total_bytes`` less the remedy margin, less those."""
    sized = [w for w in d.plan.workspaces if any(registry.get(i.backend).rules.check_workspace is not None
                                                 for i in d.plan.instances if i.workspace == w.id)]
    s = plan_pools(stack, None, 0)
    fixed = d.plan.workspace_bytes - sum(w.bytes for w in sized)
    return (int(remedy_available(total_bytes) * POOL_MEMORY_SHARE) - s.req_to_token_bytes - s.kv_bytes - fixed,
            len(sized))


def _graph_bytes(r: "SetupRequest", dec: Decided, bound: bool, env: Mapping[str, str]) -> int:
    """The decode graphs' bytes for ``r``: their estimate, or with ``bound`` its lower bound (0 without graphs)."""
    est = (lower_bound_for_decided if bound else estimate_for_decided)(r, dec, env=env)
    return 0 if est is None else est.total_bytes


def fits_beside(stack: "SetupRequest", decided: Decided, total_bytes: int,
                env: Mapping[str, str] = os.environ) -> Callable[[int, int], bool]:
    """``fits(ws, bs)``: whether the workspaces the setting sizes at ``ws`` bytes, the other workspaces, graphs up to
    ``bs`` (0: none) and ``stack``'s KV pools fit 90 % of ``total_bytes`` less the remedy margin; monotone in ``ws`` and
    ``bs`` (for binary search). ``decided``: ``plan``'s walk (its refusal ignored)."""
    dec = _unrefused(decided)
    d = dec["build-mode"]
    now, (room, n) = d.graph_max_bs(stack, dec["device-init"].facts), _room(stack, d, total_bytes)
    memo: dict[tuple[int, bool], int] = {}
    listed = stack.args.cuda_graph_bs

    def graphs(bs: int, bound: bool) -> int:
        if bs <= 0 or (listed and bs < min(listed)):  # no graphs (a cut list would be empty)
            return 0
        if (bs, bound) not in memo:
            memo[bs, bound] = _graph_bytes(stack if bs == now else graphs_up_to(stack, bs), dec, bound, env)
        return memo[bs, bound]

    def fits(ws: int, bs: int) -> bool:
        left = room - n * ws
        return left >= 0 and left >= graphs(bs, True) and left >= graphs(bs, False)
    return fits


def _unrefused(decided: Decided) -> Decided:
    """``decided`` without its refusal (the estimates refuse to estimate for a refused walk)."""
    return Decided(table=decided.table, decisions=dict(decided.decisions), inputs=decided.inputs)


def rows_fix(request: "SetupRequest", stack: "SetupRequest", decided: Decided, total_bytes: int,
             env: Mapping[str, str] = os.environ) -> str:
    """The alternative lowering ``max_reqs`` (library wording): the largest R below the one asked (>= the largest
    ``cuda_graph_bs``) with which the whole plan fits (:func:`fits_beside`; graphs capped at R, workspaces resized, <=
    2**48). "" when not even one row fits. Binary search."""
    dec = _unrefused(decided)
    d, facts, args = dec["build-mode"], dec["device-init"].facts, request.args
    name, size = workspace_setting(d)
    size, top = size or 0, args.cuda_graph_max_bs

    def top_at(n: int) -> Optional[int]:  # a given top above n is lowered, then to at most REMEDY_MAX_BS
        return top if top is None or top <= n else min(n, REMEDY_MAX_BS)

    def rows(r: "SetupRequest", n: int) -> "SetupRequest":
        a = msgspec.structs.replace(r.args, cuda_graph_max_bs=top_at(n))
        return msgspec.structs.replace(r, args=a, pool=msgspec.structs.replace(r.pool, max_reqs=n))

    memo: dict[tuple[int, bool], int] = {}  # the graphs' bytes by their top: the sizes depend on R only through it

    def graphs(cut: "SetupRequest", bs: int, bound: bool) -> int:
        if (bs, bound) not in memo:
            memo[bs, bound] = _graph_bytes(cut, dec, bound, env)
        return memo[bs, bound]

    def plan_at(n: int) -> tuple[bool, int]:
        full, cut = rows(request, n), rows(stack, n)
        bs = d.graph_max_bs(full, facts)
        ws = max(size, need_at(full, d, facts)(bs))
        room, k = _room(cut, d, total_bytes)
        left = room - k * ws
        ok = ws <= MAX_BYTES and left >= 0 and all(left >= graphs(cut, bs, b) for b in (True, False))
        return ok, ws

    r = largest_fitting(range(max(args.cuda_graph_bs or [1]), request.pool.max_reqs), lambda n: plan_at(n)[0])
    if r is None:
        return ""
    ws = plan_at(r)[1]
    return (f"set max_reqs={r}" + (f" and {name}={ws}" if ws > size else "")
            + (f" and cuda_graph_max_bs={top_at(r)}" if top_at(r) != top else ""))


NO_ROOM = "lower max_context_len or num_token_slots (the KV pools leave the workspaces no room at any max_reqs)"


def retell_workspace_refusal(request: "SetupRequest", stack: "SetupRequest", decided: Decided, total_bytes: int,
                             env: Mapping[str, str] = os.environ) -> None:
    """Re-raise a build-mode ``workspace_too_small`` refusal in ``decided`` (same code, message, fields) with the remedy
    :func:`fits_beside` bounds, or :func:`rows_fix` / :data:`NO_ROOM`; else return. Unchanged without ``total_bytes``.
    """
    refused = decided.refused
    if refused is None or total_bytes <= 0 or refused[0] != "build-mode" \
            or getattr(getattr(refused[1], "info", None), "code", None) != "workspace_too_small":
        return
    try:
        fits = fits_beside(stack, decided, total_bytes, env)
    except ConfigError:  # the KV pool below two pages: plan_pools' refusal comes after this one, as before
        return
    try:
        check_workspaces(request, decided["build-mode"], decided["device-init"].facts, fits=fits)
    except ConfigError as e:
        if not e.info.remedy:
            e.info = msgspec.structs.replace(e.info, remedy=rows_fix(request, stack, decided, total_bytes, env)
                                             or NO_ROOM)
        raise

