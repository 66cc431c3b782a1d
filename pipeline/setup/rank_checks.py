"""device-init's memory exchange between ranks (used by :mod:`pipeline.setup.build`).

Every rank reads its free device memory (``Platform.memory_available``), the ranks gather the list
over the CPU group (an arrival-checked wait: a rank that never arrives is named ``rank_stalled``),
and each checks the same list with :func:`pipeline.setup.rank_digest.check_memory_balance` — so either
every rank logs ``memory_balanced`` or every rank fails with ``memory_imbalance``, before any pool
is allocated. CPU ranks share their host's memory, so there is nothing to balance: the step is
recorded as skipped (``StepSkipped``, ``what="memory_balance"``).
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.core import events as ev

__all__ = ["balance_memory"]


def balance_memory(run: Any, index: int) -> None:
    """Exchange and check free device memory for the pipeline run ``run`` (a :class:`~pipeline.setup.context.SetupContext`) on device ``index``.

    Raises :class:`~pipeline.core.errors.MemoryImbalance` (every rank) or
    :class:`~pipeline.core.errors.RankStalled` (a rank did not arrive within the group's ``timeout_s``)."""
    from pipeline.setup.distributed import gather
    from pipeline.setup.rank_digest import check_memory_balance

    g, req = run.rank_group, run.request
    reader = getattr(run.platform, "memory_available", None)
    free = None if run.platform.device_type == "cpu" or reader is None else reader(index)
    t = time.perf_counter()
    got = gather(None if free is None else int(free), g.cpu_group, req.rank, req.world_size, g.timeout_s,
                 watch=run.watch, what="the memory exchange", state="device-init")
    if any(x is None for x in got):
        run.log.emit(ev.StepSkipped, state=run.state, outcome="skipped", what="memory_balance",
                     reason="no free device memory to compare on " + ", ".join(
                         f"rank {r}" for r, x in enumerate(got) if x is None) + " (CPU ranks share the host)")
        return
    limit = getattr(g, "max_memory_imbalance", None)
    limit = 0.1 if limit is None else limit
    check_memory_balance(list(got), limit, rank=req.rank, device=req.device)
    run.log.emit(ev.MemoryBalanced, state=run.state, free_bytes=list(got), max_imbalance=limit,
                 duration_ms=(time.perf_counter() - t) * 1e3)
