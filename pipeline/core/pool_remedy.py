"""Remedies for memory refusals that involve the decode CUDA graphs: every alternative names a value inside its
flag's domain (:mod:`pipeline.cli.domains`) that then passes the same check, and a flag no value of which can work
is not offered (s9mem: the pool remedy offered ``--max-reqs`` "at most 0 rows", below the flag's minimum of 1,
when the graphs' estimate alone was above the limit, and ``--max-context-len`` without a value).

The graphs' side is :class:`GraphTrial`: the captured sizes and the estimated bytes (:mod:`states.graph_memory`)
of the graphs cut to a smaller top, passed in by the caller (``attn-setup plan``, the runner's pool sizing), so that
nothing here imports the estimate. Pure arithmetic, no torch.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

# A remedy never names a largest captured batch above this (the pool, graph and FlashInfer workspace remedies all
# use it): its series (1, 2, 4, 8, 16, 24, … 8192:
# 1027 sizes) is estimated in about a second, so the search below stays within seconds, while a workspace fitting
# 2**48 bytes would fit ~850M captured requests, a series no plan or capture gets through (t6verify's remedy named
# --cuda-graph-max-bs 852334595, and that plan ran out of memory).
REMEDY_MAX_BS = 8192


class GraphTrial(NamedTuple):
    """The decode graphs a refused configuration would capture, for a remedy that lowers them.

    ``sizes``: the captured batch sizes, ascending; ``list_given``: they came from ``cuda_graph_bs`` (a remedy then
    keeps the list's sizes up to N) rather than from the series up to ``cuda_graph_max_bs`` or the default top;
    ``max_bs_given``: ``cuda_graph_max_bs`` was set (with a list it must equal the list's largest size, so a remedy
    sets it too); ``bytes_at(n)``: the estimated bytes (:class:`states.graph_memory.GraphMemoryEstimate`'s
    ``total_bytes``) of the graphs cut to the sizes up to ``n`` — nondecreasing in ``n``: every size kept adds its
    pool share and its replay state."""

    sizes: Sequence[int]
    list_given: bool
    max_bs_given: bool
    bytes_at: Callable[[int], int]


def remedy_tops(sizes: Sequence[int]) -> list[int]:
    """The tops a remedy may name among the captured ``sizes`` (ascending): those below the largest and at most
    :data:`REMEDY_MAX_BS`, found by bisection, so a huge series (:class:`states.batch_series.BatchSeries`) is
    never listed past them."""
    return list(sizes[:bisect.bisect_left(sizes, min(sizes[-1], REMEDY_MAX_BS + 1))]) if sizes else []


def slot_floor(min_slots: int, page_size: int) -> int:
    """The fewest token slots a pool may hold: whole pages, at least two, and at least ``min_slots`` (what ``run``'s
    verification batches need; :func:`pipeline.core.pool_sizing.size_pools` refuses fewer)."""
    return max(2 * page_size, -(-min_slots // page_size) * page_size)


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> Optional[int]:
    """The largest of ``candidates`` (ascending) with ``fits``, or None: the largest is tried first (a lowered top
    often fits at once), then a binary search, O(log n) calls — valid because ``fits`` holds on a prefix (the
    estimate is nondecreasing in the top, :class:`GraphTrial`)."""
    if not candidates or not fits(candidates[0]):
        return None
    if fits(candidates[-1]):
        return candidates[-1]
    lo, hi = 0, len(candidates) - 1  # fits(candidates[lo]) holds, fits(candidates[hi]) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(candidates[mid]) else (lo, mid)
    return candidates[lo]


def graph_fixes(trial: Optional[GraphTrial], room: int, *, eager_fits: bool) -> list[str]:
    """The alternatives that lower the decode graphs' memory (library wording, field names: the command line shows
    them as flags), each then within ``room`` bytes: the largest top below the captured one (at most
    :data:`REMEDY_MAX_BS`) whose estimate fits ``room`` — ``set cuda_graph_max_bs=N``, or with a ``cuda_graph_bs``
    list ``use only sizes up to N in cuda_graph_bs`` —, and ``set disable_cuda_graph=True`` when ``eager_fits`` (what
    else must fit does without the graphs). Empty without graphs (``trial`` None or no sizes)."""
    out: list[str] = []
    if trial is None or not trial.sizes:
        return out
    candidates = remedy_tops(trial.sizes)
    n = largest_fitting(candidates, lambda b: trial.bytes_at(b) <= room) if room > 0 else None
    if n is not None:
        out.append(top_fix(trial, n))
    if eager_fits:
        out.append("set disable_cuda_graph=True")
    return out


def top_fix(trial: GraphTrial, n: int) -> str:
    """The change that makes ``n`` (one of ``trial.sizes``) the largest captured batch, library wording: ``set
    cuda_graph_max_bs=n``, or with a ``cuda_graph_bs`` list ``use only sizes up to n in cuda_graph_bs`` (and ``set
    cuda_graph_max_bs=n`` when that was set too: it must equal the list's largest size)."""
    if trial.list_given:
        return (f"use only sizes up to {n} in cuda_graph_bs"
                + (f" and set cuda_graph_max_bs={n}" if trial.max_bs_given else ""))
    return f"set cuda_graph_max_bs={n}"


REQ_TO_TOKEN_ELEM_BYTES = 4  # req_to_token holds int32 token locations (sglang's ReqToTokenPool)


def refuse_pools(s: Any, head: str, limit: int, fit: int, name: Callable[[str], str], *, cli: bool, total_bytes: int,
                 allocated_bytes: int, mem_fraction: Optional[float], graph_top: int = 0,
                 graphs: Optional[GraphTrial] = None, min_slots: int = 0, min_context_len: int = 1) -> None:
    """:func:`pipeline.core.pool_sizing.check_fits`' ConfigError (``pool_exceeds_memory``) for the sized pools ``s``
    (a :class:`~pipeline.core.pool_sizing.PoolSizing`): ``limit`` the bytes the pools and graphs may use now,
    ``fit`` the bytes a remedy's values are sized to (the limit less the remedy margin). Every alternative names a
    value that then fits ``fit`` bytes and lies in its flag's domain, else it is left out: ``max_reqs`` rows and
    ``max_context_len`` tokens of at least 1 (and ``min_context_len``, what ``run``'s verification reaches), with
    ``num_token_slots`` at the pool's floor when the pool was sized from a budget (slots win over bytes and
    fraction); ``num_token_slots`` of at least ``min_slots`` and two pages; ``--mem-bytes`` / ``--mem-fraction``
    that still cover ``req_to_token`` and that floor; and, where the graphs are what is too large (``graphs``:
    :func:`graph_fixes`), a lower top or no graphs — not for a ``--mem-fraction`` budget, which the KV pool fills
    whatever the graphs take. ``graph_top``: the largest graph size given (0: none), lowered with ``max_reqs``.
    Every value fits beside the planned workspaces (``s.workspace_bytes``), kept as they are. When neither fewer rows
    nor fewer graphs alone fit, both together: :func:`rows_and_fewer_graphs`."""
    from pipeline.core.errors import ConfigError

    p, allowed, gr, w = s.facts, [f"<= {limit} bytes of pools"], s.graph_reserve_bytes, s.workspace_bytes
    g = gr + w  # what the pools must fit beside: the graphs (a remedy may lower them) and the workspaces
    per_tok, page, r2t, kv = max(s.bytes_per_token, 1), p.page_size, s.req_to_token_bytes, s.kv_bytes
    floor = slot_floor(min_slots, page)
    gfix = [] if s.source == "mem_fraction" else graph_fixes(graphs, fit - r2t - kv - w, eager_fits=r2t + kv + w <= fit)
    fit_slots = (fit - r2t - g) // per_tok // page * page
    slots_fix = [f"pass {name('num_token_slots')} {fit_slots} or fewer ({s.bytes_per_token} bytes per token slot)"] \
        if floor <= fit_slots else []
    if r2t + 2 * page * s.bytes_per_token + g > limit:
        kv_min, more = (kv, "") if s.source == "slots" else (floor * s.bytes_per_token,
                                                             f" and set num_token_slots={floor}")
        room = fit - g - kv_min  # bytes left for req_to_token
        rows = max(room // max(p.max_context_len * REQ_TO_TOKEN_ELEM_BYTES, 1), 0)
        ctx = max(room // max(p.max_reqs * REQ_TO_TOKEN_ELEM_BYTES, 1), 0)
        sizes = "--cuda-graph-max-bs / --cuda-graph-bs" if cli else "cuda_graph_max_bs / cuda_graph_bs"
        also = f" and {sizes} to at most that" if graph_top > rows else ""  # a graph size above max_reqs is refused
        ways = [f"lower {name('max_reqs')} (at most {rows} rows at this context length){also}{more}"] * (rows >= 1)
        ways += ([f"lower {name('max_context_len')} (at most {ctx} tokens at this row count){more}"]
                 if ctx >= max(min_context_len, 1) else [])
        if not ways and not gfix and s.source != "mem_fraction":  # fewer rows and fewer graphs together (s12ws)
            ways = rows_and_fewer_graphs(graphs, fit - kv_min - w, p.max_context_len * REQ_TO_TOKEN_ELEM_BYTES,
                                         lambda r: f"lower {name('max_reqs')} (at most {r} rows at this context "
                                                   f"length){more}")
        raise ConfigError(f"{head}; {_too_large(p, gr, w, limit)}", code="pool_exceeds_memory",
                          flags=[("max_reqs", p.max_reqs), ("max_context_len", p.max_context_len),
                                 ("limit_bytes", limit)], allowed=allowed,
                          remedy=_either(ways + gfix))
    if s.source == "slots" or not cli:
        raise ConfigError(head, code="pool_exceeds_memory",
                          flags=[("num_token_slots", p.num_token_slots), ("limit_bytes", limit)], allowed=allowed,
                          remedy=_either(slots_fix + gfix))
    if s.source == "bytes":
        mem = fit - g
        raise ConfigError(head, code="pool_exceeds_memory", flags=[("mem_bytes", s.budget_bytes),
                                                                    ("limit_bytes", limit)], allowed=allowed,
                          remedy=_either(([f"pass --mem-bytes {mem} or less"] if mem >= r2t + floor * per_tok
                                          else []) + gfix))
    frac = math.floor((fit - w + allocated_bytes) / total_bytes * 100) / 100 if total_bytes else 0.0  # w: outside it
    frac_ok = frac > 0 and int(frac * total_bytes) - allocated_bytes - gr >= r2t + floor * per_tok
    raise ConfigError(head, code="pool_exceeds_memory", flags=[("mem_fraction", mem_fraction),
                                                                ("limit_bytes", limit)], allowed=allowed,
                      remedy=_either([f"pass --mem-fraction {frac:.2f} or less"] if frac_ok else slots_fix,
                                     " (or free memory on the device)"))


def _too_large(p: Any, gr: int, w: int, limit: int) -> str:
    """What is too large when req_to_token (``p``: the pool facts) and the 2-page floor of the KV pool do not fit
    ``limit`` beside the graphs' ``gr`` and the workspaces' ``w`` bytes: those two alone, or req_to_token beside them."""
    g = gr + w
    others = " and ".join([f"the decode CUDA graphs ({gr} bytes estimated)"] * bool(gr)
                          + [f"the planned workspaces ({w} bytes)"] * bool(w))
    if g >= limit:
        return (f"{others} alone" if w else f"the decode CUDA graphs alone ({gr} bytes estimated)") + " are too large"
    return (f"req_to_token {'alone ' if not g else ''}({p.max_reqs} x {p.max_context_len} int32) is too large"
            + (f" beside {others}" if g else ""))


def rows_and_fewer_graphs(trial: Optional[GraphTrial], room: int, row_bytes: int,
                          rows_text: Callable[[int], str]) -> list[str]:
    """The alternatives that lower ``max_reqs`` and the decode graphs together, for when neither alone fits (s12ws:
    ``--max-context-len 2147483647 --max-reqs 16``, req_to_token of 137 GB beside graphs of 137 GB, got "free memory
    on the device"). ``room``: the bytes req_to_token and the graphs may take together; ``row_bytes``: one row of
    req_to_token (``max_context_len`` x 4); ``rows_text(r)``: the wording of at most ``r`` rows. Each names values
    that then fit: the largest captured top N below the current one (at most :data:`REMEDY_MAX_BS`) whose
    estimate (``trial.bytes_at``) leaves room for at least N rows (a top above ``max_reqs`` is refused), with the
    rows that then fit and that top (:func:`top_fix`); and no graphs, with the rows that fit without them. Both
    need at least one row. Empty without graphs. O(log sizes) estimates (the rows left fall as the top grows)."""
    out: list[str] = []
    if trial is None or not trial.sizes or row_bytes <= 0:
        return out
    rows_at = lambda b: (room - trial.bytes_at(b)) // row_bytes  # noqa: E731
    candidates = remedy_tops(trial.sizes)
    n = largest_fitting(candidates, lambda b: rows_at(b) >= b)
    if n is not None:
        out.append(f"{rows_text(rows_at(n))} and {top_fix(trial, n)}")
    if room // row_bytes >= 1:
        out.append(f"{rows_text(room // row_bytes)} and set disable_cuda_graph=True")
    return out


def _either(ways: Sequence[str], tail: str = "") -> str:
    """The alternatives joined with ``, or `` (then ``tail``); when none can work, freeing memory is what is left."""
    return ", or ".join(ways) + tail if ways else "free memory on the device (no value of these flags fits it)"
