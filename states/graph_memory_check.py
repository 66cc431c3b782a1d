"""``attn-setup plan``'s check of the decode CUDA graphs' estimated memory against the device profile, so that it
refuses what ``run`` certainly refuses (s9mem: ``plan --max-reqs 100000 --cuda-graph-max-bs 100000`` on the h200
profile said ``ok`` beside an estimate of ~9.7 TB for a 141 GB device).

``run`` refuses the KV pools and the graphs' estimate together above
:data:`~pipeline.core.pool_sizing.POOL_MEMORY_SHARE` (90 %) of the device's *free* memory (:func:`pipeline.core.pool_sizing.check_fits`, ``pool_exceeds_memory``), and
the graphs are captured after the workspaces were allocated, so graphs and workspaces together above the device's
memory cannot be captured. ``plan`` cannot know the free memory of the device a run will get, only the profile's
*total*, which the free memory never exceeds; so it refuses, with the same code, the graphs alone above 90 % of the
total, or the graphs and the planned workspaces together above the total — both certain refusals or failures of
``run``. (``plan`` sizes no KV pool, so the pools count as 0 here: the check is a lower bound of ``run``'s.)
Pure decisions, no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional

from pipeline.core.errors import ConfigError
from pipeline.core.pool_remedy import graph_fixes
from pipeline.core.pool_sizing import POOL_MEMORY_SHARE, remedy_available
from states.graph_memory import GraphMemoryEstimate, graph_trial

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import SetupRequest
    from pipeline.core.driver import Decided


def check_graphs_fit_device(request: "SetupRequest", decided: "Decided", estimate: Optional[GraphMemoryEstimate],
                            total_bytes: int, env: Mapping[str, str] = os.environ) -> None:
    """Raise ConfigError ``pool_exceeds_memory`` (state ``init-memory-pool``, where ``run`` refuses it) when the
    graphs' ``estimate`` (bytes) is above 90 % of ``total_bytes`` (the profile's device memory), or the estimate plus
    the planned workspaces (``decided["build-mode"].plan.workspaces``, bytes) above ``total_bytes``. Nothing to check
    without graphs (``estimate`` None) or a memory reading (``total_bytes`` 0).

    The remedy's alternatives (:func:`pipeline.core.pool_remedy.graph_fixes`) then pass this check: the largest
    captured top (at most :data:`~pipeline.core.pool_remedy.REMEDY_MAX_BS`) whose estimate fits both bounds less
    :func:`~pipeline.core.pool_sizing.remedy_margin` of the total, found by a binary search over the captured sizes
    (the estimate is nondecreasing in the top); and ``disable_cuda_graph`` when the workspaces alone fit 90 % of that.
    Costs nothing on the common path (two comparisons); the search runs only for a refusal. Workspaces above 90 %
    of the total by themselves are not counted: no graph size is their remedy (``run`` refuses them as
    ``workspace_exceeds_memory`` against its free memory; ``plan`` does not check that yet).
    """
    if estimate is None or not total_bytes:
        return
    g, share = estimate.total_bytes, int(total_bytes * POOL_MEMORY_SHARE)
    ws = sum(w.bytes for w in decided["build-mode"].plan.workspaces)
    ws = ws if ws <= share else 0  # workspaces that alone cannot fit are run's workspace_exceeds_memory, not this
    if g <= share and g + ws <= total_bytes:
        return
    avail = remedy_available(total_bytes)
    room = min(int(avail * POOL_MEMORY_SHARE), avail - ws)
    fixes = graph_fixes(graph_trial(request, decided, estimate, env=env), room,
                        eager_fits=ws <= int(avail * POOL_MEMORY_SHARE))
    args, sizes = request.args, estimate.batch_sizes
    why = (f"above the {POOL_MEMORY_SHARE:.0%} of it ({share} bytes) that run lets the pools and graphs use"
           if g > share else f"which with the planned workspaces ({ws} bytes) is above all of it")
    raise ConfigError(
        f"the decode CUDA graphs for bs {sizes[0]}..{sizes[-1]} ({len(sizes)} sizes) are estimated at {g} bytes "
        f"({g / (1 << 30):.2f} GiB), but the device has {total_bytes} bytes in all, {why} (plan cannot know the "
        "free memory a run will find, at most this total, so it checks against the total)",
        code="pool_exceeds_memory", state="init-memory-pool",
        flags=[("cuda_graph_bs", args.cuda_graph_bs) if args.cuda_graph_bs else
               ("cuda_graph_max_bs", args.cuda_graph_max_bs), ("max_reqs", request.pool.max_reqs),
               ("graph_bytes_estimate", g), ("workspace_bytes", ws), ("total_memory_bytes", total_bytes)],
        allowed=[f"<= {min(share, total_bytes - ws)} bytes of decode CUDA graphs"],
        remedy=", or ".join(fixes) if fixes else "use a device with more memory (no graph size fits this one)")
