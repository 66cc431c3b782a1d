"""The runner's ``init-memory-pool`` step (:data:`pipeline.runtime.table.RUNNER`): pool sizing and allocation.

``decide_pools`` sizes ``req_to_token`` and the per-layer K/V buffers (slots > bytes > a fraction of the device's
memory, the decode graphs' estimated bytes set aside: :func:`graph_estimate`) without allocating; ``alloc_pools``
allocates them. Split out of :mod:`pipeline.runtime.table`, which re-exports every name. Nothing here imports torch
at import time.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.core import events as ev
from pipeline.core.dtypes import kv_dtype
from pipeline.core.errors import ConfigError
from pipeline.memory.pools import (POOL_MEMORY_SHARE, available_bytes, budget_from_fraction, check_fits,
                                        check_mem_fraction, remedy_available, size_pools)


def served_field(req: Any, spec: Any) -> dict[str, Any]:
    """``{model or draft_model: spec}``: the field of ``req`` holding the model it serves."""
    return {"draft_model": spec} if req.is_draft_worker and req.draft_model is not None else {"model": spec}


# -- init-memory-pool: req_to_token and the per-layer K/V buffers, sized from the budget -----------------------
def decide_pools(r: Any) -> Any:
    """The pool sizes (slots > bytes > fraction of the device's memory, weights already there subtracted), refused
    when above the device's memory or its free share, or below ``config.min_token_slots``; a ``mem_fraction``
    outside (0, 1] is refused with a remedy naming the largest share that fits this device (:func:`fraction_remedy`).

    When decode graphs will be captured, the process's one-time capture costs are paid first (the platform's
    ``prime_graph_capture``; on CUDA :func:`pipeline.platforms.cuda.prime_capture`: PyTorch's stream pool and
    lazily loaded graph machinery, ~160 MiB outside the allocator on the H200), so the free memory the budget is
    read from no longer holds them; ``r.capture_prime_bytes`` keeps what they took (the ``cuda_graph_memory``
    event's ``prime_device_bytes``).

    The planned FlashInfer workspaces (:func:`workspace_bytes`) count with the pools and the graphs (s10mem: they
    were checked only after the pools were allocated, and without the graphs, so graphs and workspaces too large
    together failed out of memory during capture): workspaces alone above 90 % of the free memory are refused first
    (``workspace_exceeds_memory``, :func:`pipeline.memory.workspaces.check_workspaces_fit`), then the sum by
    :func:`size_for`."""
    cfg = r.config
    if cfg.mem_fraction is not None:
        try:
            check_mem_fraction(cfg.mem_fraction)
        except ConfigError as e:  # "such as 0.8" is not true everywhere (0.8 of a CPU host's memory is refused)
            raise ConfigError(f"--mem-fraction {cfg.mem_fraction} is outside (0, 1]", code=e.info.code,
                              flags=[("mem_fraction", cfg.mem_fraction)], allowed=list(e.info.allowed),
                              remedy=fraction_remedy(r.platform, r.index, cfg, r.load.spec,
                                                     graph_reserve_bytes(r, r.load.spec),
                                                     workspace_bytes(r, r.load.spec))) from None
    reserve, ws = graph_reserve_bytes(r, r.load.spec), workspace_bytes(r, r.load.spec)
    if ws:  # before the prime: the budget's free-memory read comes right after it
        from pipeline.memory.workspaces import check_workspaces_fit

        req, d = setup_decided(r, r.load.spec)
        check_workspaces_fit(req, d["build-mode"], d["device-init"].facts, available_bytes(r.platform, r.index),
                             graph_bytes=reserve, device=r.platform.torch_device(r.index))
    prime = getattr(r.platform, "prime_graph_capture", None)
    if reserve and prime is not None:  # graphs will be captured: pay their one-time process costs, then read memory
        # summed: preflight decides this step too, and only the first call pays (later calls return 0)
        r.capture_prime_bytes = getattr(r, "capture_prime_bytes", 0) + prime(r.index)
    return size_for(r.platform, r.index, cfg, r.load.spec, graph_reserve=reserve, graphs=graph_trial_of(r, r.load.spec),
                    workspace=ws)


def setup_decided(r: Any, spec: Any) -> Any:
    """``(request, decided)``: the setup decided torch-free (:func:`pipeline.setup.build.decide_setup`) for this
    run's request serving ``spec``, before the pools are sized (the backends, their workspaces and whether graphs
    are captured depend on ``max_reqs``, not on the pool's size); computed once per runner and spec (kept on ``r``)."""
    kept = getattr(r, "setup_decided_for", None)
    if kept is not None and kept[0] is spec:
        return kept[1]
    from pipeline.setup.build import decide_setup

    req = msgspec.structs.replace(r.config.request, **served_field(r.config.request, spec))
    out = (req, decide_setup(req, platform=r.platform, installed=r.installed, rank_group=r.rank_group))
    r.setup_decided_for = (spec, out)
    return out


def _workspaces_possible(device_type: str) -> bool:
    """Whether a backend with a workspace (FlashInfer, FA3) can be built on ``device_type`` at all: a CPU run then
    resolves once, for its attention step only (``tests/test_cli_run.py``)."""
    from pipeline.backends import registry

    return any(device_type in e.capability.devices and (e.capability.workspace_bytes or e.rules.workspace)
               for e in map(registry.get, registry.names()))


def workspace_bytes(r: Any, spec: Any) -> int:
    """Bytes of the FlashInfer workspaces build-mode plans for this run serving ``spec`` (0: none, or the setup is
    refused — the attention step raises that at its own state): the bytes ``plan`` counts with the pools."""
    if not _workspaces_possible(r.platform.device_facts(r.index).type):
        return 0
    try:
        return setup_decided(r, spec)[1]["build-mode"].plan.workspace_bytes
    except Exception:  # noqa: BLE001 - a refused setup decision (no build-mode): refused later, where it belongs
        return 0


def graph_estimate(r: Any, spec: Any) -> Any:
    """The decode CUDA graphs' estimated memory (:class:`pipeline.memory.graphs.GraphMemoryEstimate`) for this run's
    built ``spec``, from the setup decided torch-free for it (:func:`pipeline.setup.build.decide_setup`: the decode
    backend and whether it is captured depend on ``max_reqs``, not on the pool's size); None when no graphs are
    captured (CPU, ``--disable-cuda-graph``, a decode backend without graphs) or the setup is refused. Computed once
    per runner and spec (kept on ``r``); where graphs cannot apply at all (:func:`states.build_mode.decide_graphs` before
    any backend is known) nothing is resolved for it, so such a run still resolves once."""
    from states.build_mode import decide_graphs

    cfg = r.config
    kept = getattr(r, "graph_estimate_for", None)
    if kept is not None and kept[0] is spec:
        return kept[1]
    est = None
    if decide_graphs(cfg.request.args, r.platform.device_facts(r.index).type, []).capture:
        from pipeline.memory.graphs import estimate_for_decided, graph_trial

        req, decided = setup_decided(r, spec)
        est = _bound_if_beyond_device(r, req, decided) or \
            estimate_for_decided(req, decided, aux_layers=cfg.aux_hidden_state_layers or ())
        r.graph_trial_for = (spec, graph_trial(req, decided, est, aux_layers=cfg.aux_hidden_state_layers or ()))
    r.graph_estimate_for = (spec, est)
    return est


def _bound_if_beyond_device(r: Any, req: Any, decided: Any) -> Any:
    """The graphs' lower bound (:func:`pipeline.memory.graphs.lower_bound_for_decided`, closed form whatever the
    top) when it alone is above the share of the device's total memory the pools may use, else None. Then the run
    is refused whatever the full estimate says, and the full estimate, one entry per captured size, is not built: a
    ``--cuda-graph-max-bs`` of 2**31 - 1 would list ~268M sizes (``plan`` refuses from the bound the same way,
    :func:`pipeline.memory.fits.refuse_early`)."""
    from pipeline.memory.pools import POOL_MEMORY_SHARE
    from pipeline.memory.graphs import lower_bound_for_decided

    total = r.platform.device_facts(r.index).total_memory_bytes
    bound = lower_bound_for_decided(req, decided, aux_layers=r.config.aux_hidden_state_layers or ())
    return bound if bound is not None and total and bound.total_bytes > total * POOL_MEMORY_SHARE else None


def graph_trial_of(r: Any, spec: Any) -> Any:
    """The graphs :func:`graph_estimate` estimated for ``spec``, as a :class:`pipeline.memory.pools.GraphTrial`
    (their estimate at a lower top, for a pool remedy that lowers it); None without graphs."""
    graph_estimate(r, spec)
    kept = getattr(r, "graph_trial_for", None)
    return kept[1] if kept is not None and kept[0] is spec else None


def graph_reserve_bytes(r: Any, spec: Any) -> int:
    """Bytes :func:`graph_estimate` sets aside (0 without graphs)."""
    est = graph_estimate(r, spec)
    return 0 if est is None else est.total_bytes


def size_for(platform: Any, index: int, cfg: Any, spec: Any, graph_reserve: int = 0, spare: bool = False,
             graphs: Any = None, workspace: int = 0) -> Any:
    """:func:`decide_pools`' sizing for ``cfg`` (a RunnerConfig, its ``mem_fraction`` already checked) and the
    built ``spec`` on ``platform``'s device ``index``; nothing is allocated. Raises the sizing's ConfigError.
    ``config.min_token_slots`` binds every pool (the default slots too, so a ``--num-token-slots`` remedy is enough
    when followed; s13: a ``mem_fraction`` pool too, whose refusal names the fraction that covers it). ``graph_reserve``: the decode graphs' estimated bytes
    (:func:`graph_reserve_bytes`), out of a ``mem_fraction`` budget and counted against free memory
    (:func:`pipeline.memory.pools.size_pools`). ``spare``: check against the free memory less
    :func:`~pipeline.memory.pools.remedy_margin` (what a remedy is sized for). A ``--mem-bytes`` above the
    device's total is a ConfigError (``invalid_value``) naming a value that fits. ``graphs``: the graphs behind
    ``graph_reserve`` (:func:`graph_trial_of`), for a remedy that lowers or drops them; every remedy names values
    inside their flags' domains, at least ``cfg.min_token_slots`` slots and ``cfg.min_context_len`` tokens.
    ``workspace``: the planned workspaces' bytes (:func:`workspace_bytes`), counted with the pools and the graphs
    against free memory (not taken out of a ``mem_fraction`` budget: sglang allocates them outside it)."""
    req = cfg.request
    p, facts = req.pool, platform.device_facts(index)
    if cfg.mem_bytes is not None and facts.total_memory_bytes and cfg.mem_bytes > facts.total_memory_bytes:
        fit = min(int(remedy_available(available_bytes(platform, index)) * POOL_MEMORY_SHARE) - graph_reserve
                  - workspace,
                  facts.total_memory_bytes)
        raise ConfigError(f"--mem-bytes {cfg.mem_bytes} exceeds the device's {facts.total_memory_bytes} bytes",
                          code="invalid_value", flags=[("mem_bytes", cfg.mem_bytes)],
                          allowed=[f"<= {facts.total_memory_bytes}"],
                          remedy=(f"pass --mem-bytes {fit} or less (what fits the memory free now, with a margin), "
                                  "or use --mem-fraction" if fit > 0 else
                                  "free memory on the device, or drop --mem-bytes"))
    budget, source, total, allocated = cfg.mem_bytes, "bytes", 0, platform.memory_allocated(index)
    if cfg.num_token_slots is None and budget is None and cfg.mem_fraction is not None:
        total = facts.total_memory_bytes
        budget, source = budget_from_fraction(cfg.mem_fraction, total, allocated), "mem_fraction"
    slots = cfg.num_token_slots if cfg.num_token_slots is not None else (None if budget is not None else
                                                                         p.num_token_slots)
    s = size_pools(spec.layer_kinds(), spec.num_hidden_layers, kv_dtype(req.args, spec), page_size=req.args.page_size,
                   max_reqs=p.max_reqs, max_context_len=p.max_context_len, num_token_slots=slots,
                   budget_bytes=budget, source=source,
                   mem_fraction=cfg.mem_fraction, min_slots=cfg.min_token_slots, min_slots_for=cfg.min_token_slots_for,
                   graph_reserve_bytes=graph_reserve, workspace_bytes=workspace, total_bytes=total,
                   allocated_bytes=allocated, min_context_len=cfg.min_context_len)
    avail = available_bytes(platform, index)
    check_fits(s, remedy_available(avail) if spare else avail, device=platform.torch_device(index), total_bytes=total,
               allocated_bytes=allocated, mem_fraction=cfg.mem_fraction,
               graph_top=req.args.cuda_graph_max_bs or max(req.args.cuda_graph_bs or [0]), graphs=graphs,
               min_slots=cfg.min_token_slots, min_context_len=cfg.min_context_len)
    return s


def fraction_remedy(platform: Any, index: int, cfg: Any, spec: Any, graph_reserve: int = 0, workspace: int = 0) -> str:
    """A ``--mem-fraction`` remedy that is true on this device: the largest share (in hundredths, up to 0.9) whose
    pools both hold ``cfg.min_token_slots`` and fit its free memory less a margin (:func:`size_for` with ``spare``,
    sizing only — nothing is allocated), or, when none does, the default sizing (drop the flag)."""
    import dataclasses

    for pct in range(90, 0, -1):
        try:
            size_for(platform, index, dataclasses.replace(cfg, mem_fraction=pct / 100), spec, graph_reserve, spare=True,
                     workspace=workspace)
        except ConfigError:
            continue
        return (f"pass --mem-fraction {pct / 100:g} or less (the largest share of this device's memory whose "
                "pools fit and hold the verification batches; sglang's mem_fraction_static), or drop it")
    return "drop --mem-fraction (the pools are then sized from --num-token-slots)"


def alloc_pools(r: Any, s: Any) -> None:
    """Allocate ``req_to_token`` and the K/V buffers; log tokens and bytes; the request then carries the sizes."""
    from pipeline.backends.memory import KVPool, ReqToTokenPool, torch_dtype

    req, p, dev = r.request, s.facts, r.platform.torch_device(r.index)
    model = req.served_model
    pools = {"req_to_token_pool": ReqToTokenPool(p.max_reqs, p.max_context_len, dev)}
    pools["kv_pool"] = KVPool.for_layer_kinds(model.layer_kinds(), model.num_hidden_layers, p.num_token_slots,
                                              p.page_size, torch_dtype(kv_dtype(req.args, model)), dev)
    r.sizing, r.request = s, msgspec.structs.replace(req, pool=p)
    r.emit(ev.MemoryPoolSized, source=s.source, budget_bytes=s.budget_bytes, bytes_per_token=s.bytes_per_token,
           num_token_slots=p.num_token_slots, max_reqs=p.max_reqs, max_context_len=p.max_context_len,
           page_size=p.page_size, req_to_token_bytes=s.req_to_token_bytes, kv_bytes=s.kv_bytes,
           graph_bytes_estimate=s.graph_reserve_bytes)
    r.machine.model.pools = pools
