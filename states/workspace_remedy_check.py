"""s12ws (s11 gap 2): ``plan``'s FlashInfer workspace refusal (``workspace_too_small``) with a remedy whose every
alternative then passes the whole plan — the KV pools and the decode graphs too.

Build-mode's workspace check (:func:`states.workspace_memory_check.check_workspaces`) bounds a remedy's workspace
by each one's share of the device alone: with ``--max-reqs 16777216 --cuda-graph-max-bs 16777216`` on the h200
profile it named "workspace 2705061920 and --cuda-graph-max-bs 8192", which ``plan`` then refused as
``pool_exceeds_memory`` (req_to_token of 64 GiB and the 8192-top graphs do not fit beside each other). ``plan``
knows the pools and can estimate the graphs, so it asks the same check again with :func:`fits_beside`: each
alternative's workspaces, the graphs up to the top it names and the KV pools ``run`` sizes, together within
:data:`~pipeline.core.pool_sizing.POOL_MEMORY_SHARE` of the profile's total less
:func:`~pipeline.core.pool_sizing.remedy_margin` — what :func:`states.graph_memory_check.check_plan_memory`
accepts, with the margin every memory remedy keeps. Pure decisions, no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import msgspec

from pipeline.backends import registry
from pipeline.core.driver import Decided
from pipeline.core.errors import ConfigError
from pipeline.core.pool_remedy import REMEDY_MAX_BS, largest_fitting
from pipeline.core.pool_sizing import POOL_MEMORY_SHARE, remedy_available
from pipeline.core.validation import MAX_BYTES
from states.graph_memory import estimate_for_decided, graphs_up_to
from states.graph_memory_bound import lower_bound_for_decided
from states.graph_memory_check import plan_pools
from states.workspace_memory_check import check_workspaces, need_at, workspace_setting

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import SetupRequest


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
    """``fits(ws, bs)``: whether the planned workspaces the workspace setting sizes, each at ``ws`` bytes, the
    other planned workspaces as they are, the decode graphs up to ``bs`` (0: none; the estimate of
    :func:`~states.graph_memory.estimate_for_decided` for ``stack`` cut to that top,
    :func:`~states.graph_memory.graphs_up_to`) and the KV pools of ``stack`` (:func:`plan_pools`) are together
    at most 90 % of ``total_bytes`` less the remedy margin. ``stack``: the request as ``run`` builds it (its served
    model cut to ``--num-layers``), as ``plan``'s memory checks count it; ``decided``: ``plan``'s decide walk
    (a refusal it holds is ignored here). Once false it stays false as ``ws`` or ``bs`` grows (the estimate is
    nondecreasing in the top), as the remedy's binary searches need. Each top's graphs are estimated once, after
    their lower bound (:mod:`states.graph_memory_bound`, O(1) in the top) did not already rule it out."""
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
    """The alternative that lowers ``max_reqs`` (library wording), for when no workspace or graph size can work
    because the KV pools leave no room (``--max-reqs 2147483647``: 8 TiB of ``req_to_token``): the largest
    ``max_reqs`` R below the one asked, at least the largest ``cuda_graph_bs`` size (a size above it is refused),
    with which the whole plan fits, as :func:`fits_beside` counts it — the KV pools of R rows; the graphs, their
    top capped at R (sglang's default top is; a ``cuda_graph_max_bs`` above R is lowered to R or
    :data:`~pipeline.core.pool_remedy.REMEDY_MAX_BS`, the lower, and named); each sized workspace at the larger of
    its size and what the backends need at R rows and that top (named when above its size; at most 2**48 bytes,
    the flag's domain). "" when not even one row fits. Binary search (everything grows with R): O(log max_reqs)
    lower bounds, and estimates where they pass, one per graph top."""
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
    """When ``decided`` (``plan``'s decide walk for ``request``) was refused in build-mode with
    ``workspace_too_small``, raise that refusal again — the same check, code, message and fields — with the remedy
    :func:`fits_beside` bounds (``stack``: the request as ``run`` builds it, see there); when no workspace or graph
    size can work, :func:`rows_fix` (or, when not even that fits, :data:`NO_ROOM`). Else return. Without a memory
    reading (``total_bytes`` 0) the refusal stays as it was."""
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
