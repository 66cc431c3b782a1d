"""Decode CUDA-graph memory, estimated before capture and torch-free (docs/internals.md)."""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Sequence, TYPE_CHECKING

from pipeline.backends import registry
from pipeline.core.contracts import LayerKind, ModelSpec
from pipeline.memory.allocator import _decode_trace, _Trace, blas_workspace_bytes, ELEM_BYTES, MiB, PoolModel
from states.build_mode import BatchSeries, series_sum

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import SetupRequest
    from pipeline.core.steps import Decided
    from pipeline.memory.pools import GraphTrial

__all__ = ['GraphMemoryEstimate', 'estimate_graph_memory', 'estimate_for_decided', 'graph_trial', 'graphs_up_to', 'blas_workspace_bytes', 'PoolModel', 'MiB', 'graph_memory_lower_bound', 'lower_bound_for_decided']


class GraphMemoryEstimate(NamedTuple):
    """The estimate in bytes: ``total_bytes`` = ``pool_bytes`` + ``state_bytes`` + ``warmup_bytes``; ``per_bs``: each
    size's addition to the pool (largest first; sums to ``pool_bytes``); ``blas_workspace_bytes`` (within
    ``warmup_bytes``); ``num_layers``, ``batch_sizes``; ``lower_bound`` (``per_bs`` empty); ``mode`` /
    ``tokens_per_req``."""

    total_bytes: int
    per_bs: dict[int, int]
    blas_workspace_bytes: int
    num_layers: int
    batch_sizes: list[int]
    pool_bytes: int = 0
    state_bytes: int = 0
    warmup_bytes: int = 0
    lower_bound: bool = False
    mode: str = "decode"
    tokens_per_req: int = 1


def _built_kinds(spec: ModelSpec) -> dict[int, LayerKind]:
    return {lid: kind for kind in spec.layer_kinds() for lid in kind.layer_ids if lid < spec.num_hidden_layers}


def runner_buffer_bytes(max_bs: int, hidden_size: int, dtype: str, tokens_per_req: int = 1,
                        mode: str = "decode") -> tuple[int, ...]:
    """Bytes of the graph runner's fixed inputs at ``max_bs`` requests of ``tokens_per_req`` rows (``hidden``,
    ``positions``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``; target verify adds two int32 [max_bs])."""
    rows = max_bs * tokens_per_req
    out = (rows * hidden_size * ELEM_BYTES[dtype], rows * 8, max_bs * 8, max_bs * 4, rows * 8)
    return out + ((max_bs * 4, max_bs * 4) if mode == "target_verify" else ())

def estimate_graph_memory(spec: ModelSpec, *, dtype: str, kv_dtype: str, decode_backend: str,
                          batch_sizes: Sequence[int], arch: str = "", aux_layers: Sequence[int] = (),
                          max_context_len: int = 1024, page_size: int = 1, num_sms: int = 1,
                          env: Mapping[str, str] = os.environ, mode: str = "decode",
                          tokens_per_req: int = 1) -> GraphMemoryEstimate:
    """Bytes decode-graph capture of every size in ``batch_sizes`` takes (:class:`GraphMemoryEstimate`; empty → 0).

    ``spec``: the served model as built; ``dtype`` / ``kv_dtype``: names; ``decode_backend``: registry name (its
    ``graph_decode_allocs``); ``arch``: for the cuBLAS workspace; ``aux_layers``: EAGLE3; ``max_context_len``,
    ``page_size``, ``num_sms``: size the backend's buffers; ``mode`` / ``tokens_per_req``: a speculative captured step.
    Raises BackendUnknown / BackendUnavailable for an unknown ``decode_backend``.
    """
    entry = registry.get(decode_backend, flag="decode_attention_backend")
    elem = ELEM_BYTES[dtype]
    kinds = _built_kinds(spec)
    sizes = sorted(set(int(b) for b in batch_sizes), reverse=True)
    if not sizes or not kinds:
        return GraphMemoryEstimate(0, {}, 0, spec.num_hidden_layers, sorted(sizes), mode=mode,
                                   tokens_per_req=tokens_per_req)
    pool, state, side, per_bs = PoolModel(), PoolModel(), PoolModel(), {}
    blas = blas_workspace_bytes(arch, env)
    mb, t = sizes[0], tokens_per_req
    for nbytes in runner_buffer_bytes(mb, spec.hidden_size, dtype, t, mode):
        state.malloc(nbytes)
    backend_state = entry.graph_state_allocs(list(_kinds_of(kinds)), sizes, max_context_len=max_context_len,
                                             page_size=page_size, num_sms=num_sms, mode=mode, tokens_per_req=t)
    by_bs: dict[int, list[int]] = {}  # the backend's state per captured size (0: made once), in its order
    for b, nbytes in backend_state:
        by_bs.setdefault(b, []).append(nbytes)
    for nbytes in by_bs.get(0, ()):
        state.malloc(nbytes)
    tr, warm = _Trace(pool), _Trace(side)
    for i, bs in enumerate(sizes):
        for nbytes in by_bs.get(bs, ()):  # a lookup: scanning backend_state per size was O(sizes**2)
            state.malloc(nbytes)
        if i == 0 and blas:
            warm.a(blas)  # the side stream's cuBLAS workspace, made by the first warm-up's matmul and kept
        warm.f(*_decode_trace(warm, spec, kinds, bs * t, elem, kv_dtype, entry, list(aux_layers)))
        before = pool.reserved
        _decode_trace(tr, spec, kinds, bs * t, elem, kv_dtype, entry, list(aux_layers))
        per_bs[bs] = pool.reserved - before
    total = pool.reserved + state.reserved + side.reserved
    return GraphMemoryEstimate(total, per_bs, blas, spec.num_hidden_layers, sorted(sizes), pool.reserved,
                               state.reserved, side.reserved, mode=mode, tokens_per_req=t)


def _kinds_of(kinds: dict[int, LayerKind]) -> Iterator[LayerKind]:
    """The distinct layer kinds among the built layers, in layer order (one graph wrapper per kind)."""
    seen: list[LayerKind] = []
    for lid in sorted(kinds):
        if not any(k is kinds[lid] for k in seen):
            seen.append(kinds[lid])
    yield from seen


def estimate_for_decided(request: "SetupRequest", decided: "Decided",
                         aux_layers: Sequence[int] = (), env: Mapping[str, str] = os.environ
                         ) -> Optional[GraphMemoryEstimate]:
    """The estimate for a setup decided torch-free (:func:`pipeline.setup.build.decide_setup`) for ``request`` as the
    runner builds it, or None without graphs or when refused; ``plan`` and the runner's pool sizing both call it."""
    from states.build_mode import capture_batch_sizes

    return _for_decided(estimate_graph_memory, capture_batch_sizes, request, decided, aux_layers, env)


def _for_decided(estimator: Any, series: Any, request: "SetupRequest", decided: "Decided", aux_layers: Sequence[int],
                 env: Mapping[str, str]) -> Optional[GraphMemoryEstimate]:
    """``estimator`` over the sizes ``series`` gives for a decided setup, or None without graphs or when refused."""
    from pipeline.core.dtypes import kv_dtype, model_dtype

    if decided.refused is not None or not decided["build-mode"].graphs.capture:
        return None
    spec, args, facts = request.served_model, request.args, decided["device-init"].facts
    return estimator(spec, dtype=model_dtype(args, spec), kv_dtype=kv_dtype(args, spec),
                     batch_sizes=series(args, request.pool.max_reqs, device=facts, world_size=request.tp_size),
                     arch=facts.arch, aux_layers=aux_layers, max_context_len=request.pool.max_context_len,
                     page_size=args.page_size, num_sms=facts.sm_count, env=env, **captured_step(request, decided))


def captured_step(request: "SetupRequest", decided: "Decided") -> dict:
    """What the graphs capture for a decided setup: ``decode_backend``, ``mode`` (:func:`states.build_mode.graph_mode`)
    and ``tokens_per_req``."""
    from states.build_mode import graph_backend, graph_mode

    res = decided["resolve"]
    mode = graph_mode(res.speculative, request.is_draft_worker)
    t = {"target_verify": getattr(res.speculative, "num_draft_tokens", 1),
         "draft_decode": getattr(res.speculative, "topk", 1)}.get(mode, 1)
    return dict(decode_backend=graph_backend(res.pair, res.speculative, request.is_draft_worker), mode=mode,
                tokens_per_req=t)


def graphs_up_to(request: "SetupRequest", n: int) -> "SetupRequest":
    """``request`` with its graphs cut to top ``n`` (``cuda_graph_max_bs=n`` or the list's sizes up to ``n``, >= its
    smallest)."""
    import msgspec

    args = request.args
    listed = [b for b in args.cuda_graph_bs if b <= n] if args.cuda_graph_bs else None
    top = n if listed is None else max(listed, default=None) if args.cuda_graph_max_bs is not None else None
    return msgspec.structs.replace(request, args=msgspec.structs.replace(args, cuda_graph_bs=listed,
                                                                         cuda_graph_max_bs=top))


def graph_trial(request: "SetupRequest", decided: "Decided", estimate: Optional[GraphMemoryEstimate],
                aux_layers: Sequence[int] = (), env: Mapping[str, str] = os.environ) -> Optional["GraphTrial"]:
    """The graphs of ``estimate`` as a :class:`pipeline.memory.pools.GraphTrial` (``bytes_at(n)`` nondecreasing), or
    None."""
    from pipeline.memory.pools import GraphTrial

    if estimate is None or not estimate.batch_sizes:
        return None
    args = request.args

    def bytes_at(n: int) -> int:
        est = estimate_for_decided(graphs_up_to(request, n), decided, aux_layers, env)
        return 0 if est is None else est.total_bytes

    return GraphTrial(estimate.batch_sizes, bool(args.cuda_graph_bs), args.cuda_graph_max_bs is not None,
                      bytes_at)


def graph_memory_lower_bound(spec, *, dtype: str, kv_dtype: str, decode_backend: str, batch_sizes: Sequence[int],
                             arch: str = "", aux_layers: Sequence[int] = (), max_context_len: int = 1024,
                             page_size: int = 1, num_sms: int = 1, env: Mapping[str, str] = os.environ,
                             mode: str = "decode", tokens_per_req: int = 1) -> GraphMemoryEstimate:
    """A :class:`GraphMemoryEstimate` (``lower_bound`` True, ``per_bs`` empty) at most :func:`estimate_graph_memory`'s
    ``total_bytes``, from the largest size alone: O(1) in the sizes, same arguments.

    A lower bound because pool and warm-up stream start as with the largest size alone and never shrink; each graph's
    float32 output [bs, hidden] stays in the pool; replay state is never freed (at least the largest size's plus each
    other size's smallest per-size state).
    """
    sizes = batch_sizes if isinstance(batch_sizes, BatchSeries) else sorted(set(int(b) for b in batch_sizes))
    kw = dict(dtype=dtype, kv_dtype=kv_dtype, decode_backend=decode_backend, arch=arch, aux_layers=aux_layers,
              max_context_len=max_context_len, page_size=page_size, num_sms=num_sms, env=env, mode=mode,
              tokens_per_req=tokens_per_req)
    if not sizes:
        return estimate_graph_memory(spec, batch_sizes=[], **kw)._replace(lower_bound=True)
    one = estimate_graph_memory(spec, batch_sizes=sizes[-1:], **kw)
    kinds = list(_kinds_of(_built_kinds(spec)))
    state = one.state_bytes
    pool = max(one.pool_bytes, series_sum(sizes) * tokens_per_req * spec.hidden_size * 4) if kinds \
        else one.pool_bytes  # the outputs kept
    if len(sizes) > 1 and kinds:
        entry, mb, r = registry.get(decode_backend, flag="decode_attention_backend"), sizes[-1], PoolModel.round_size
        sk = dict(max_context_len=max_context_len, page_size=page_size, num_sms=num_sms, mode=mode,
                  tokens_per_req=tokens_per_req)
        live = sum(r(b) for b in runner_buffer_bytes(mb, spec.hidden_size, dtype, tokens_per_req, mode)) + \
            sum(r(b) for _, b in entry.graph_state_allocs(kinds, [mb], **sk))
        per_small = sum(r(b) for bs, b in entry.graph_state_allocs(kinds, sizes[:1], **sk) if bs)
        state = max(state, live + (len(sizes) - 1) * per_small)
    return one._replace(total_bytes=pool + state + one.warmup_bytes, state_bytes=state, pool_bytes=pool, per_bs={},
                        batch_sizes=sizes, lower_bound=True)


def lower_bound_for_decided(request: "SetupRequest", decided: "Decided", aux_layers: Sequence[int] = (),
                            env: Mapping[str, str] = os.environ) -> Optional[GraphMemoryEstimate]:
    """:func:`graph_memory_lower_bound` for what :func:`pipeline.memory.graphs.estimate_for_decided` estimates (same
    request, sizes, backend and device), or None where that is None."""
    from states.build_mode import capture_series

    return _for_decided(graph_memory_lower_bound, capture_series, request, decided, aux_layers, env)
