"""A cheap lower bound of the decode CUDA graphs' memory estimate (:mod:`states.graph_memory`), so that ``plan``
refuses graphs the device profile cannot hold before estimating every captured size (s11: ``plan --max-reqs
16777216 --cuda-graph-max-bs 16777216`` on the h200 profile estimated ~2M sizes, minutes, before any memory check).

The full estimate replays every captured size, largest first; the bound replays only the largest one
(:func:`~states.graph_memory.estimate_graph_memory` of ``[top]``: O(1) in the top) and adds what every other size
keeps for replay, counted from the smallest size (the registry entries' per-size state is nondecreasing in the
size: FlashInfer's 8 MiB int workspace per size and layer kind, a tensor-core wrapper's ``qo_indptr`` [bs + 1]).
Why it is a lower bound of the full estimate's ``total_bytes``:

- the graph pool and the warm-up stream start with the largest size exactly as with it alone, and a model pool's
  reserved bytes never shrink, so each is at least the largest size's alone;
- each captured graph's output (the float32 residual stream [bs, hidden]) stays allocated in the graph pool for the
  graphs' life, so the pool holds at least the sum of those over the sizes;
- the replay state is never freed, so its reserved bytes are at least both the largest size's alone and the bytes
  of every state request (rounded to 512), that is those of the largest size plus each other size's, at least the
  smallest size's per-size state each.

Pure arithmetic, no torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from pipeline.backends import registry
from states.batch_series import BatchSeries, series_sum
from states.cuda_allocator import PoolModel
from states.graph_memory import (GraphMemoryEstimate, _built_kinds, _kinds_of, estimate_graph_memory,
                                 runner_buffer_bytes)

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import SetupRequest
    from pipeline.core.driver import Decided

__all__ = ["graph_memory_lower_bound", "lower_bound_for_decided"]


def graph_memory_lower_bound(spec, *, dtype: str, kv_dtype: str, decode_backend: str, batch_sizes: Sequence[int],
                             arch: str = "", aux_layers: Sequence[int] = (), max_context_len: int = 1024,
                             page_size: int = 1, num_sms: int = 1,
                             env: Mapping[str, str] = os.environ) -> GraphMemoryEstimate:
    """A :class:`GraphMemoryEstimate` (``lower_bound`` True, ``per_bs`` empty) whose ``total_bytes`` is at most
    :func:`~states.graph_memory.estimate_graph_memory`'s for the same arguments (module docstring), computed from
    the largest size alone: O(1) in the sizes (a :class:`~states.batch_series.BatchSeries` is never listed; other
    sizes are sorted). Same arguments as that."""
    sizes = batch_sizes if isinstance(batch_sizes, BatchSeries) else sorted(set(int(b) for b in batch_sizes))
    kw = dict(dtype=dtype, kv_dtype=kv_dtype, decode_backend=decode_backend, arch=arch, aux_layers=aux_layers,
              max_context_len=max_context_len, page_size=page_size, num_sms=num_sms, env=env)
    if not sizes:
        return estimate_graph_memory(spec, batch_sizes=[], **kw)._replace(lower_bound=True)
    one = estimate_graph_memory(spec, batch_sizes=sizes[-1:], **kw)
    kinds = list(_kinds_of(_built_kinds(spec)))
    state = one.state_bytes
    pool = max(one.pool_bytes, series_sum(sizes) * spec.hidden_size * 4) if kinds else one.pool_bytes  # the outputs kept
    if len(sizes) > 1 and kinds:
        entry, mb, r = registry.get(decode_backend, flag="decode_attention_backend"), sizes[-1], PoolModel.round_size
        sk = dict(max_context_len=max_context_len, page_size=page_size, num_sms=num_sms)
        live = sum(r(b) for b in runner_buffer_bytes(mb, spec.hidden_size, dtype)) + sum(r(b) for _, b in entry.graph_state_allocs(kinds, [mb], **sk))
        per_small = sum(r(b) for bs, b in entry.graph_state_allocs(kinds, sizes[:1], **sk) if bs)
        state = max(state, live + (len(sizes) - 1) * per_small)
    return one._replace(total_bytes=pool + state + one.warmup_bytes, state_bytes=state, pool_bytes=pool, per_bs={},
                        batch_sizes=sizes, lower_bound=True)


def lower_bound_for_decided(request: "SetupRequest", decided: "Decided", aux_layers: Sequence[int] = (),
                            env: Mapping[str, str] = os.environ) -> Optional[GraphMemoryEstimate]:
    """:func:`graph_memory_lower_bound` for what :func:`states.graph_memory.estimate_for_decided` estimates (same
    request, sizes, backend and device), or None where that is None."""
    from pipeline.core.dtypes import kv_dtype, model_dtype
    from states.graphs import capture_series

    if decided.refused is not None or not decided["build-mode"].graphs.capture:
        return None
    spec, args, facts = request.served_model, request.args, decided["device-init"].facts
    return graph_memory_lower_bound(
        spec, dtype=model_dtype(args, spec), kv_dtype=kv_dtype(args, spec), decode_backend=decided["resolve"].pair.decode,
        batch_sizes=capture_series(args, request.pool.max_reqs, device=facts, world_size=request.world_size),
        arch=facts.arch, aux_layers=aux_layers, max_context_len=request.pool.max_context_len,
        page_size=args.page_size, num_sms=facts.sm_count, env=env)
