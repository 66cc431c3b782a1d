"""The runner's static memory against the device: the KV pools sized from a budget (sglang's ``init_memory_pool``),
the attention stack's weights, what ``run``'s checks need of the pools, and the refusals' remedies.

Details: docs/internals.md, ``pipeline.memory.pools``.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Callable, Literal, NamedTuple, Optional, Sequence

import msgspec

from pipeline.core.contracts import LayerKind, PoolFacts
from pipeline.core.errors import ConfigError
from pipeline.core.numbers import largest_fitting, REMEDY_MAX_BS
from pipeline.core.validation import MAX_POOL_DIM


class GraphTrial(NamedTuple):
    """The decode graphs a refused configuration would capture, for a remedy that lowers them.

    ``sizes``: the captured batch sizes, ascending; ``list_given``: they came from ``cuda_graph_bs`` (a remedy then
    keeps the list's sizes up to N) rather than from the series up to ``cuda_graph_max_bs`` or the default top;
    ``max_bs_given``: ``cuda_graph_max_bs`` was set (with a list it must equal the list's largest size, so a remedy
    sets it too); ``bytes_at(n)``: the estimated bytes (:class:`pipeline.memory.graphs.GraphMemoryEstimate`'s
    ``total_bytes``) of the graphs cut to the sizes up to ``n`` — nondecreasing in ``n``: every size kept adds its
    pool share and its replay state."""

    sizes: Sequence[int]
    list_given: bool
    max_bs_given: bool
    bytes_at: Callable[[int], int]


def remedy_tops(sizes: Sequence[int]) -> list[int]:
    """The tops a remedy may name among the captured ``sizes`` (ascending): those below the largest and at most
    :data:`REMEDY_MAX_BS`, found by bisection, so a huge series (:class:`states.build_mode.BatchSeries`) is
    never listed past them."""
    return list(sizes[:bisect.bisect_left(sizes, min(sizes[-1], REMEDY_MAX_BS + 1))]) if sizes else []


def slot_floor(min_slots: int, page_size: int) -> int:
    """The fewest token slots a pool may hold: whole pages, at least two, and at least ``min_slots`` (what ``run``'s
    verification batches need; :func:`pipeline.memory.pools.size_pools` refuses fewer)."""
    return max(2 * page_size, -(-min_slots // page_size) * page_size)


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
    """:func:`pipeline.memory.pools.check_fits`' ConfigError (``pool_exceeds_memory``) for the sized pools ``s``
    (a :class:`~pipeline.memory.pools.PoolSizing`): ``limit`` the bytes the pools and graphs may use now,
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
        if not ways and not gfix and s.source != "mem_fraction":  # fewer rows and fewer graphs together
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
    """The alternatives that lower ``max_reqs`` and the decode graphs together, for when neither alone fits (``--max-context-len 2147483647 --max-reqs 16``, req_to_token of 137 GB beside graphs of 137 GB, got "free memory
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


KV_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}

Source = Literal["slots", "bytes", "mem_fraction"]


class PoolSizing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The sized pools: ``facts`` (what the pools are built from) and the accounting behind it.

    ``source``: which input decided (slots > bytes > mem_fraction); ``budget_bytes``: bytes the
    pools may use (None when slots were given); ``bytes_per_token``: KV bytes per token slot over
    all built layers; ``req_to_token_bytes`` / ``kv_bytes``: bytes the pools will hold;
    ``graph_reserve_bytes``: the decode CUDA graphs' estimated pool (0 without graphs), taken out of a
    ``mem_fraction`` budget before the KV pool was sized from it; ``workspace_bytes``: the planned FlashInfer
    workspaces (0 without), counted with the pools against free memory but not taken out of a budget
    (sglang allocates them outside ``mem_fraction_static``).
    """

    facts: PoolFacts
    source: Source
    budget_bytes: Optional[int]
    bytes_per_token: int
    req_to_token_bytes: int
    kv_bytes: int
    graph_reserve_bytes: int = 0
    workspace_bytes: int = 0


# The flag behind each budget source, for error messages.
_FLAG = {"bytes": "mem_bytes", "mem_fraction": "mem_fraction"}
# The pools may take at most this share of the memory free when they are sized: the rest is left for
# activations, the verification batches and whatever else runs (sglang leaves 1 - mem_fraction_static).
POOL_MEMORY_SHARE = 0.9
# A "largest that fits" remedy is computed against the free memory less this margin (a share of it, at least
# REMEDY_MARGIN_MIN_BYTES but never more than a quarter of it), so that following it still fits after free
# memory moved a little between runs (host page cache, another process).
REMEDY_MARGIN_SHARE = 0.05
REMEDY_MARGIN_MIN_BYTES = 512 << 20


def remedy_margin(available: int) -> int:
    """Bytes of ``available`` free memory a remedy leaves unused: 5 % of it, at least 512 MiB (at most a quarter
    of it on a device that small). Raises nothing."""
    available = max(int(available), 0)
    return max(math.ceil(available * REMEDY_MARGIN_SHARE), min(REMEDY_MARGIN_MIN_BYTES, available // 4))


def remedy_available(available: int) -> int:
    """The free memory a remedy is sized against: ``available`` less :func:`remedy_margin`. Raises nothing."""
    return max(int(available) - remedy_margin(available), min(int(available), 1))


def kv_bytes_per_token(kinds: Sequence[LayerKind], num_layers: int, kv_dtype: str) -> int:
    """KV-cache bytes one token slot costs over layers ``0..num_layers-1`` (K and V, every layer; an MLA
    layer's one latent buffer of ``head_dim_qk`` elements)."""
    if kv_dtype not in KV_ELEM_BYTES:
        raise ConfigError(f"kv dtype {kv_dtype!r} has no known element size", code="invalid_value",
                          flags=[("kv_cache_dtype", kv_dtype)], allowed=sorted(KV_ELEM_BYTES),
                          remedy="pick one of the allowed KV cache dtypes")
    per_layer = {lid: k.num_kv_heads * (k.head_dim_qk + (0 if k.is_mla else k.head_dim_v))
                 for k in kinds for lid in k.layer_ids}
    return sum(per_layer.get(lid, 0) for lid in range(num_layers)) * KV_ELEM_BYTES[kv_dtype]


def check_mem_fraction(mem_fraction: float) -> None:
    """Raise ConfigError (``invalid_value``) unless ``0 < mem_fraction <= 1`` (nan is refused too)."""
    if not 0.0 < mem_fraction <= 1.0:
        raise ConfigError(f"mem_fraction={mem_fraction} is outside (0, 1]", code="invalid_value",
                          flags=[("mem_fraction", mem_fraction)], allowed=["0 < mem_fraction <= 1"],
                          remedy="pass a fraction such as 0.8 (sglang's mem_fraction_static)")


def budget_from_fraction(mem_fraction: float, total_memory_bytes: int, already_allocated: int = 0) -> int:
    """``mem_fraction·total − already_allocated`` bytes (sglang: weights count against the static share).

    Raises ConfigError (``invalid_value``) when ``mem_fraction`` is not in (0, 1].
    """
    check_mem_fraction(mem_fraction)
    return int(mem_fraction * total_memory_bytes) - int(already_allocated)


def fraction_covering(need_bytes: int, total_bytes: int, allocated_bytes: int = 0) -> Optional[float]:
    """The smallest ``mem_fraction`` of three significant digits whose budget (:func:`budget_from_fraction` of
    ``total_bytes`` less ``allocated_bytes``) is at least ``need_bytes``; None when that is above 1 or the total is
    unknown (0)."""
    if total_bytes <= 0 or need_bytes + allocated_bytes > total_bytes:
        return None
    exact = max(need_bytes + allocated_bytes, 1) / total_bytes
    e = math.floor(math.log10(exact)) - 2
    m = max(math.floor(exact / 10.0 ** e), 1)
    while int(float(f"{m}e{e}") * total_bytes) - allocated_bytes < need_bytes:
        m += 1
    f = float(f"{m}e{e}")
    return f if f <= 1 else None


def _raise_budget(source: str, need: int, graphs: int, total: int, allocated: int, lower: str = "") -> str:
    """The remedy of a budget below ``need`` bytes: raise the flag to cover them — a ``mem_fraction`` to the
    fraction that does (the graphs' ``graphs`` bytes come out of it first) when the device's memory is known —,
    or lower the sizes in ``lower`` (:func:`_lowerable`: only those that can still go lower)."""
    f = fraction_covering(need + (graphs if source == "mem_fraction" else 0), total, allocated) \
        if source == "mem_fraction" else None
    cover = f"to {f:g} or more (it then covers {need} bytes)" if f is not None else f"to cover {need} bytes"
    return f"raise {_FLAG.get(source, source)} {cover}" + lower


def size_pools(kinds: Sequence[LayerKind], num_layers: int, kv_dtype: str, *, page_size: int, max_reqs: int,
               max_context_len: int, num_token_slots: Optional[int] = None, budget_bytes: Optional[int] = None,
               source: Source = "bytes", mem_fraction: Optional[float] = None, min_slots: int = 0,
               min_slots_for: str = "", graph_reserve_bytes: int = 0, workspace_bytes: int = 0,
               total_bytes: int = 0, allocated_bytes: int = 0, min_context_len: int = 1) -> PoolSizing:
    """Size ``req_to_token`` and the K/V buffers; see docs/internals.md, ``pipeline.memory.pools`` for the rules.

    Exactly one of ``num_token_slots`` (rounded up to whole pages) or ``budget_bytes`` must be
    given (``mem_fraction``: the fraction a ``source="mem_fraction"`` budget came from, for the
    error). The pool must hold at least two pages and ``min_slots`` token slots (rounded up to
    pages; ``min_slots_for`` says what needs them, e.g. ``attn-setup run``'s verification batches).
    A budget is used up to ``MAX_POOL_DIM`` (2**31 - 1) slots, what int32 token locations address.
    ``graph_reserve_bytes`` (bytes, >= 0: the decode graphs' estimated pool) is subtracted from a
    ``source="mem_fraction"`` budget first (``budget_bytes`` then records what is left for the pools) and recorded
    for :func:`check_fits` whatever the source; so is ``workspace_bytes`` (bytes, >= 0: the planned workspaces),
    never taken out of a budget.
    Raises ConfigError (``pool_budget_too_small``) naming the flag, what it must cover and a remedy
    otherwise — for a ``mem_fraction`` budget the fraction that covers it (:func:`fraction_covering` of the
    device's ``total_bytes`` less ``allocated_bytes``, when known); nothing is allocated.
    """
    per_tok = kv_bytes_per_token(kinds, num_layers, kv_dtype)
    r2t = max_reqs * max_context_len * REQ_TO_TOKEN_ELEM_BYTES
    floor = slot_floor(min_slots, page_size)
    what = f"{floor} token slots ({min_slots_for})" if min_slots_for else f"{floor // page_size} pages of {page_size} token(s)"
    if num_token_slots is not None:
        slots, source, budget = -(-num_token_slots // page_size) * page_size, "slots", None
        if slots < floor:
            raise ConfigError(f"num_token_slots={num_token_slots} cannot hold {what}", code="pool_budget_too_small",
                              flags=[("num_token_slots", num_token_slots), ("page_size", page_size)],
                              allowed=[f">= {floor}"], remedy=f"set num_token_slots={floor} or more")
    elif budget_bytes is not None:
        budget = int(budget_bytes) - (int(graph_reserve_bytes) if source == "mem_fraction" else 0)
        # a budget beyond what int32 token locations address is used up to that (MAX_POOL_DIM) only
        slots = min(max(0, (budget - r2t) // max(per_tok, 1)), MAX_POOL_DIM) // page_size * page_size
        need = r2t + floor * per_tok
        if slots < floor:
            graphs = (f" (after the decode CUDA graphs' estimated {graph_reserve_bytes} bytes)"
                      if graph_reserve_bytes and source == "mem_fraction" else "")
            raise ConfigError(
                f"a pool budget of {budget} bytes{graphs} cannot hold req_to_token ({r2t} bytes) and {what} "
                f"at {per_tok} bytes per token ({need} bytes in all)",
                code="pool_budget_too_small",
                flags=([("mem_fraction", mem_fraction), ("budget_bytes", budget)] if source == "mem_fraction"
                       else [(_FLAG.get(source, source), budget)]) + [("max_reqs", max_reqs),
                                                                      ("max_context_len", max_context_len)],
                allowed=[f">= {need} bytes"],
                remedy=_raise_budget(source, need, int(graph_reserve_bytes), total_bytes, allocated_bytes,
                                     _lowerable(max_reqs, max_context_len, min_context_len)))
    else:
        raise ConfigError("size_pools needs num_token_slots or budget_bytes", code="invalid_value",
                          flags=[("num_token_slots", None), ("budget_bytes", None)],
                          remedy="pass num_token_slots or budget_bytes")
    facts = PoolFacts(max_reqs=max_reqs, max_context_len=max_context_len, num_token_slots=slots, page_size=page_size)
    return PoolSizing(facts=facts, source=source, budget_bytes=budget, bytes_per_token=per_tok,
                      req_to_token_bytes=r2t, kv_bytes=slots * per_tok,
                      graph_reserve_bytes=max(int(graph_reserve_bytes), 0), workspace_bytes=max(int(workspace_bytes), 0))


def available_bytes(platform: Any, index: int = 0) -> int:
    """Bytes the pools could still get on ``platform``'s device ``index`` (0 = unknown).

    The platform's ``memory_available(index)`` when it has one (CPU: host ``MemAvailable``; CUDA:
    ``torch.cuda.mem_get_info``), else its total memory minus what torch has allocated there.
    """
    probe = getattr(platform, "memory_available", None)
    if probe is not None:
        return max(int(probe(index)), 0)
    total = platform.device_facts(index).total_memory_bytes
    return max(int(total) - int(platform.memory_allocated(index)), 0) if total else 0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_fits(s: PoolSizing, available: int, *, device: str, cli: bool = True, total_bytes: int = 0,
               allocated_bytes: int = 0, mem_fraction: Optional[float] = None, graph_top: int = 0,
               graphs: Optional[GraphTrial] = None, min_slots: int = 0, min_context_len: int = 1,
               of_total: bool = False) -> None:
    """Refuse pools (``req_to_token`` + every layer's K/V), the decode graphs' estimated pool
    (``s.graph_reserve_bytes``) and the planned workspaces (``s.workspace_bytes``) above
    ``POOL_MEMORY_SHARE × available`` bytes together.

    ``available``: bytes free on ``device`` now (:func:`available_bytes`; 0 = unknown, no check).
    The error (ConfigError ``pool_exceeds_memory``, exit 3) names the input that decided the size
    (``num_token_slots``, ``mem_bytes`` or ``mem_fraction`` by ``s.source``; ``max_reqs`` and
    ``max_context_len`` when ``req_to_token`` alone is too big), the limit in bytes, and a value of
    that input that fits; ``cli`` words the remedy with flags (``--num-token-slots``) rather than
    the library's ``PoolFacts`` fields. ``total_bytes``/``allocated_bytes``/``mem_fraction`` let a
    ``mem_fraction`` remedy compute the largest fraction that fits. Each remedy's value is sized against the free
    memory less :func:`remedy_margin` and rounded down, so it still fits when free memory drops by that much.
    ``graph_top``: the largest decode graph size given (``cuda_graph_max_bs`` or the largest of ``cuda_graph_bs``, 0:
    none), which a remedy lowering ``max_reqs`` below it lowers too (a size above ``max_reqs`` is refused).
    ``graphs``: the captured graphs and their estimate at a lower top (:class:`~pipeline.memory.pools.GraphTrial`),
    for the alternatives that lower or drop them; ``min_slots`` / ``min_context_len``: the least token slots and
    context a remedy may name (what ``run``'s verification batches need). The remedy is
    :func:`pipeline.memory.pools.refuse_pools`'. ``of_total``: ``available`` is the device's total memory
    (``plan``, which cannot know the free memory a run will find), and the message says so.
    """
    if available <= 0:
        return
    limit = int(available * POOL_MEMORY_SHARE)
    graphs_bytes, ws = s.graph_reserve_bytes, s.workspace_bytes
    need = s.req_to_token_bytes + s.kv_bytes + graphs_bytes + ws
    if need <= limit:
        return
    name = (lambda f: "--" + f.replace("_", "-")) if cli else (lambda f: "pool." + f)
    extra = (f" + decode CUDA graphs {graphs_bytes} (estimated)" if graphs_bytes else "") + \
        (f" + workspaces {ws}" if ws else "")
    has = (f"{available} bytes in all ({_gib(available)}; plan cannot know the free memory a run will find, at most "
           "this total, so it checks against the total)" if of_total else f"{available} bytes free ({_gib(available)})")
    head = (f"the KV pools need {need} bytes ({_gib(need)}: req_to_token {s.req_to_token_bytes} + K/V "
            f"{s.kv_bytes}{extra}) but {device} has {has}; the pools may use "
            f"{POOL_MEMORY_SHARE:.0%} of that, {limit} bytes")
    refuse_pools(s, head, limit, int(remedy_available(available) * POOL_MEMORY_SHARE), name, cli=cli,
                 total_bytes=total_bytes, allocated_bytes=allocated_bytes, mem_fraction=mem_fraction,
                 graph_top=graph_top, graphs=graphs, min_slots=min_slots, min_context_len=min_context_len)


def _lowerable(max_reqs: int, max_context_len: int, min_context_len: int) -> str:
    """The ", or lower …" tail of a budget remedy: only the sizes that can still go lower (at
    ``max_reqs`` 1 and the verification's shortest context it offered both, and neither could work).
    ``min_context_len``: the least ``max_context_len`` the caller accepts (``run``'s verification)."""
    names = (["max_reqs"] if max_reqs > 1 else []) + (["max_context_len"] if max_context_len > min_context_len else [])
    return f", or lower {' or '.join(names)}" if names else ""


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REFERENCE_BYTES = 8  # float64


def _layer_elems(model: Any, kind: Any) -> int:
    h, hkv, hid = kind.num_heads, kind.num_kv_heads, model.hidden_size
    if kind.is_mla:
        m = model.mla
        return (h * (m.qk_nope_head_dim + m.qk_rope_head_dim) * hid + (m.kv_lora_rank + m.qk_rope_head_dim) * hid
                + h * m.qk_nope_head_dim * m.kv_lora_rank + h * m.v_head_dim * m.kv_lora_rank
                + hid * h * m.v_head_dim)
    return (h + 2 * hkv) * kind.head_dim_qk * hid + hid * h * kind.head_dim_v


def weight_bytes(model: Any, num_layers: int, dtype: str) -> tuple[int, int]:
    """``(model-dtype bytes, float64 reference bytes)`` of the first ``num_layers`` attention layers' weights
    of ``model`` (a :class:`~pipeline.core.contracts.ModelSpec`) at compute dtype ``dtype`` (a dtype name).

    Raises the ConfigError of :func:`pipeline.core.spec.attention_prefix` when ``num_layers`` is outside
    the model's attention layers."""
    from pipeline.core.spec import attention_prefix

    elems, n_hidden = 0, attention_prefix(model, num_layers)
    for kind in model.layer_kinds():
        layers = sum(1 for lid in kind.layer_ids if lid < n_hidden)
        elems += layers * _layer_elems(model, kind)
    return elems * DTYPE_BYTES.get(dtype, 2), elems * REFERENCE_BYTES


def check_weights_fit(model: Any, num_layers: int, dtype: str, *, device_free: int, host_free: int,
                      on_host: bool, device: str) -> None:
    """Refuse (ConfigError ``weights_exceed_memory``, exit 3) a stack of ``num_layers`` attention layers whose
    weights or float64 reference exceed :data:`~pipeline.memory.pools.POOL_MEMORY_SHARE` of the free bytes.

    ``device_free`` / ``host_free``: bytes free now on the device and the host (0 = unknown: that side is not
    checked); ``on_host``: the device is the host (CPU), so weights and reference share ``host_free``. The
    error names ``num_layers`` (its value), the bytes needed and the limit, and as remedy the largest
    ``--num-layers`` that fits the free memory less :func:`~pipeline.memory.pools.remedy_margin` (or, when
    not even one layer does, a smaller model or more free memory).
    """
    from pipeline.core.spec import attention_layer_ids

    def fits(n: int, spare: bool = False) -> tuple[bool, str]:
        own, ref = weight_bytes(model, n, dtype)
        device_free, host_free = (remedy_available(d_free), remedy_available(h_free)) if spare else (d_free, h_free)
        if on_host:
            limit = int(host_free * POOL_MEMORY_SHARE)
            return (not host_free or own + ref <= limit,
                    f"{own + ref} bytes (weights {own} + float64 reference {ref}) but the host has {host_free} "
                    f"bytes free; {POOL_MEMORY_SHARE:.0%} of that is {limit} bytes")
        dlim, hlim = int(device_free * POOL_MEMORY_SHARE), int(host_free * POOL_MEMORY_SHARE)
        if device_free and own > dlim:
            return False, (f"{own} bytes of weights but {device} has {device_free} bytes free; "
                           f"{POOL_MEMORY_SHARE:.0%} of that is {dlim} bytes")
        if host_free and ref > hlim:
            return False, (f"{ref} bytes for the float64 verification reference but the host has {host_free} "
                           f"bytes free; {POOL_MEMORY_SHARE:.0%} of that is {hlim} bytes")
        return True, ""

    d_free, h_free = device_free, host_free
    ok, why = fits(num_layers)
    if ok:
        return
    lo, hi = 0, min(num_layers, len(attention_layer_ids(model)))  # largest n in [1, hi) that fits: binary search
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if fits(mid, spare=True)[0]:
            lo = mid
        else:
            hi = mid
    remedy = (f"pass --num-layers {lo} or fewer (the most attention layers whose weights fit; sizes scale with "
              "the layer count)" if lo >= 1 else
              "free memory on the device and the host, or use a smaller model: not even one attention layer fits "
              "with a margin for free memory that moves between runs")
    raise ConfigError(f"{num_layers} attention layers need {why}", code="weights_exceed_memory",
                      state="load-model", flags=[("num_layers", num_layers)],
                      allowed=[f"num_layers <= {lo}" if lo >= 1 else "a model whose one layer fits"], remedy=remedy)


# The two batches ``run``'s checks put through the stack (their modules hold the code that runs them): the built
# instances' check (:mod:`pipeline.runtime.verify`: cached prefixes and new tokens per request, then decode steps)
# and the model steps (:mod:`pipeline.runtime.model_steps`: an extend, a chunked extend, then decode steps).
PREFIX_LENS = (0, 3, 21, 0, 10)
NEW_LENS = (9, 4, 2, 6, 1)
EXTEND_LENS = (5, 9, 2, 7)
CHUNK_LENS = (3, 1, 4, 2)
DEFAULT_DECODE_STEPS = 3   # run's --decode-steps default


class CheckNeeds(NamedTuple):
    """What ``run``'s two check batches need of the pools (:func:`check_needs`): token slots (whole pages per
    request, plus the reserved page 0: sglang's allocator never hands it out) and the context length of the longest
    request, for the built instances' check (``verify_*``) and the model steps (``steps_*``)."""

    verify_slots: int
    verify_context: int
    steps_slots: int
    steps_context: int

    @property
    def slots(self) -> int:
        """Token slots a pool must hold for both batches (the larger: they run one after the other)."""
        return max(self.verify_slots, self.steps_slots)

    @property
    def context(self) -> int:
        """The ``max_context_len`` both batches need (the longer)."""
        return max(self.verify_context, self.steps_context)


def check_needs(max_reqs: int, page_size: int = 1, decode_steps: int = DEFAULT_DECODE_STEPS, spec: Any = None,
                draft: bool = False) -> CheckNeeds:
    """:class:`CheckNeeds` of ``run``'s batches for a pool of ``max_reqs`` rows and ``page_size``, with
    ``decode_steps`` decode steps. Each batch takes its first ``min(len, max_reqs)`` requests. Torch-free, so that
    ``plan`` refuses what ``run`` would refuse and its remedies name values ``run`` accepts. ``spec`` (the settled
    :class:`~pipeline.core.contracts.SpeculativeParams`, or None): a target worker's checks verify a tree of
    ``num_draft_tokens`` per request on top of its tokens (a bound: the accepted path stays); a draft worker's
    (``draft``) run ``num_steps`` draft steps of ``topk`` branches, each step's tokens in fresh pages outside
    ``req_to_token``."""
    tree = spec.num_draft_tokens if spec is not None and not draft else 0
    scratch = spec.num_steps * -(-spec.topk // page_size) * page_size if spec is not None and draft else 0

    def need(firsts: tuple[int, ...], seconds: tuple[int, ...]) -> tuple[int, int]:
        pairs = list(zip(firsts, seconds))[:min(len(firsts), max_reqs)]
        slots = page_size * (1 + sum(-(-(x + y + decode_steps + tree) // page_size) for x, y in pairs))
        return slots + scratch * len(pairs), max(x + y for x, y in pairs) + decode_steps + tree

    return CheckNeeds(*need(PREFIX_LENS, NEW_LENS), *need(EXTEND_LENS, CHUNK_LENS))


