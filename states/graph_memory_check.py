"""``attn-setup plan``'s check of the decode CUDA graphs' estimated memory against the device profile, so that it
refuses what ``run`` certainly refuses (s9mem: ``plan --max-reqs 100000 --cuda-graph-max-bs 100000`` on the h200
profile said ``ok`` beside an estimate of ~9.7 TB for a 141 GB device).

``run`` refuses the KV pools and the graphs' estimate together above
:data:`~pipeline.core.pool_sizing.POOL_MEMORY_SHARE` (90 %) of the device's *free* memory (:func:`pipeline.core.pool_sizing.check_fits`, ``pool_exceeds_memory``), and
the graphs are captured after the workspaces were allocated, so graphs and workspaces together above the device's
memory cannot be captured. ``plan`` cannot know the free memory of the device a run will get, only the profile's
*total*, which the free memory never exceeds; so it refuses, with the same code, the graphs alone above 90 % of the
total, or the graphs and the planned workspaces together above the total — both certain refusals or failures of
``run``.

s10mem: :func:`check_plan_memory` counts what ``plan`` can know without allocating, as ``run``'s preflight counts it
(:func:`pipeline.core.pool_sizing.check_fits`: ``req_to_token``, the KV pool of ``--num-token-slots`` — plan has no
``--mem-bytes`` or ``--mem-fraction`` —, the graphs' estimate and the planned workspaces, together at most 90 % of
the memory) against the profile's total: the workspaces alone first (``workspace_exceeds_memory``,
:mod:`states.workspace_memory_check`), then the graphs when they are what is too large, then the pools
(``pool_exceeds_memory`` with run's remedy builder, :func:`pipeline.core.pool_remedy.refuse_pools`).
Pure decisions, no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional

import msgspec

from pipeline.core.errors import ConfigError
from pipeline.core.pool_remedy import graph_fixes
from pipeline.core.pool_sizing import POOL_MEMORY_SHARE, remedy_available
from states.graph_memory import GraphMemoryEstimate, graph_trial
from states.workspace_memory_check import check_workspaces_fit

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import SetupRequest
    from pipeline.core.driver import Decided


def plan_pools(request: "SetupRequest", estimate: Optional[GraphMemoryEstimate], ws: int) -> Any:
    """The :class:`~pipeline.core.pool_sizing.PoolSizing` ``run`` sizes for ``request`` (its served model the
    stack run builds) when no ``--mem-bytes`` / ``--mem-fraction`` is given: ``req_to_token`` and the KV pool of
    ``pool.num_token_slots`` (:func:`pipeline.core.pool_sizing.size_pools`, bytes), with the graphs' estimate and
    the workspaces' ``ws`` bytes recorded beside them. Raises size_pools' ConfigError for a pool below two pages."""
    from pipeline.core.dtypes import kv_dtype
    from pipeline.core.pool_sizing import size_pools

    spec, p = request.served_model, request.pool
    return size_pools(spec.layer_kinds(), spec.num_hidden_layers, kv_dtype(request.args, spec),
                      page_size=request.args.page_size, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
                      num_token_slots=p.num_token_slots, graph_reserve_bytes=0 if estimate is None else
                      estimate.total_bytes, workspace_bytes=ws)


def check_plan_memory(request: "SetupRequest", decided: "Decided", estimate: Optional[GraphMemoryEstimate],
                      total_bytes: int, env: Mapping[str, str] = os.environ) -> None:
    """``plan``'s memory refusals against ``total_bytes`` (the profile's device memory; 0: unknown, none), in the
    order their remedies need: the planned workspaces alone above 90 % (``workspace_exceeds_memory``), the graphs
    (:func:`check_graphs_fit_device`), then ``req_to_token`` + the KV pool + the graphs + the workspaces above 90 %
    (``pool_exceeds_memory``, state ``init-memory-pool``, with ``run``'s remedy builder; every alternative then
    plans ok). ``request``'s served model is the stack ``run`` builds. Common path: a pool sizing and sums."""
    from pipeline.core.pool_sizing import check_fits
    from pipeline.core.verification_sizes import context_needed, slots_needed

    if not total_bytes:
        return
    d, facts = decided["build-mode"], decided["device-init"].facts
    ws = d.plan.workspace_bytes
    s = plan_pools(request, estimate, ws)
    pools, g = s.req_to_token_bytes + s.kv_bytes, s.graph_reserve_bytes
    check_workspaces_fit(request, d, facts, total_bytes, pool_bytes=pools, graph_bytes=g, total=True,
                         device=facts.name or facts.type)
    check_graphs_fit_device(request, decided, estimate, total_bytes, env, pool_bytes=pools)
    args = request.args
    try:
        check_fits(s, total_bytes, device=facts.name or facts.type, of_total=True,
                   graph_top=args.cuda_graph_max_bs or max(args.cuda_graph_bs or [0]),
                   graphs=graph_trial(request, decided, estimate, env=env),
                   min_slots=slots_needed(request.pool.max_reqs, args.page_size),
                   min_context_len=context_needed(request.pool.max_reqs))
    except ConfigError as e:
        e.info = msgspec.structs.replace(e.info, state="init-memory-pool")
        raise


def refuse_early(request: "SetupRequest", decided: "Decided", bound: Optional[GraphMemoryEstimate],
                 total_bytes: int, env: Mapping[str, str] = os.environ) -> None:
    """s11: :func:`check_plan_memory` with the graphs' lower ``bound``
    (:func:`states.graph_memory_bound.lower_bound_for_decided`) in place of their estimate, when the bound alone
    already decides a refusal whose code and remedy are those the full estimate gives: the bound above 90 % of
    ``total_bytes``, or the bound with the workspaces and the KV pools above it while those two fit. The remedies
    then do not depend on the graphs' bytes (only on their sizes, and on the room the pools and workspaces leave),
    so they are the same; only the message's graph bytes are the bound's. Returns when the bound decides nothing
    (the full estimate is needed), so an accepted top is estimated as before."""
    if bound is None or not total_bytes:
        return
    share = int(total_bytes * POOL_MEMORY_SHARE)
    if bound.total_bytes <= share:
        ws = decided["build-mode"].plan.workspace_bytes
        s = plan_pools(request, None, ws)
        rest = ws + s.req_to_token_bytes + s.kv_bytes
        if rest > share or bound.total_bytes + rest <= share:
            return
    check_plan_memory(request, decided, bound, total_bytes, env)


def check_graphs_fit_device(request: "SetupRequest", decided: "Decided", estimate: Optional[GraphMemoryEstimate],
                            total_bytes: int, env: Mapping[str, str] = os.environ, pool_bytes: int = 0) -> None:
    """Raise ConfigError ``pool_exceeds_memory`` (state ``init-memory-pool``, where ``run`` refuses it) when the
    graphs' ``estimate`` (bytes) is above 90 % of ``total_bytes`` (the profile's device memory), or the estimate plus
    the planned workspaces (``decided["build-mode"].plan.workspaces``, bytes) and the KV pools (``pool_bytes``) above
    90 % of it while those two fit (else the pools are what to refuse: :func:`check_plan_memory`). Nothing to check
    without graphs (``estimate`` None) or a memory reading (``total_bytes`` 0).

    The remedy's alternatives (:func:`pipeline.core.pool_remedy.graph_fixes`) then pass this check: the largest
    captured top (at most :data:`~pipeline.core.pool_remedy.REMEDY_MAX_BS`) whose estimate fits both bounds less
    :func:`~pipeline.core.pool_sizing.remedy_margin` of the total, found by a binary search over the captured sizes
    (the estimate is nondecreasing in the top); and ``disable_cuda_graph`` when the workspaces alone fit 90 % of that.
    Costs nothing on the common path (two comparisons); the search runs only for a refusal. Workspaces above 90 %
    of the total by themselves are :mod:`states.workspace_memory_check`'s refusal, checked first.
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
