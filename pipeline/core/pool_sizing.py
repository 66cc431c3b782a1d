"""Sizing the KV memory pools from a memory budget and the model (sglang's ``init_memory_pool``).

The budget is either a fraction of the device's memory (``--mem-fraction``, sglang's
``mem_fraction_static``: the share of total device memory the static pools — weights and KV
cache — may use; the weights already allocated are subtracted) or an explicit byte count, or an
explicit slot count (``--num-token-slots``), in that order of precedence: slots > bytes > fraction.

Bytes per token = Σ over the built layers of ``Hkv·(D_qk + D_v)·elem_size(kv_dtype)`` (sglang's
``cell_size``), and ``D_qk·elem_size`` for an absorbed-MLA layer, whose one latent buffer holds V as a
view of its first ``D_v`` dims (sglang's ``MLATokenToKVPool``: ``kv_lora_rank + qk_rope_head_dim``
elements per token and layer); ``req_to_token`` costs ``max_reqs·max_context_len·4`` bytes (int32). The number of
token slots is the rest of the budget divided by bytes per token, rounded *down* to whole pages,
with at least two pages (page 0 is the reserved padding page).

Decode CUDA graphs take their own memory after the pools are sized (their private pool,
:mod:`states.graph_memory` estimates it). A budget from ``--mem-fraction`` is reduced by that estimate
(``graph_reserve_bytes``) before the KV pool is sized from it, as vLLM's ``determine_available_memory`` takes its
CUDA-graph estimate out of the memory the KV cache may use; an explicit ``--mem-bytes`` or ``--num-token-slots``
is kept as given. Either way the check against free memory counts the pools and the graphs together.

Before anything is allocated, :func:`check_fits` refuses pools larger than
:data:`POOL_MEMORY_SHARE` of the memory the device (the host on CPU) has free now
(:func:`available_bytes`), naming the input that set the size, the limit, and a value that fits —
rather than letting the allocator fail or the kernel's OOM killer end the process. Nothing here
imports torch.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal, Optional, Sequence

import msgspec

from pipeline.core.contracts import LayerKind, PoolFacts
from pipeline.core.errors import ConfigError
from pipeline.core.pool_remedy import REQ_TO_TOKEN_ELEM_BYTES, GraphTrial, refuse_pools, slot_floor
from pipeline.core.validation import MAX_POOL_DIM

KV_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}

Source = Literal["slots", "bytes", "mem_fraction"]


class PoolSizing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The sized pools: ``facts`` (what the pools are built from) and the accounting behind it.

    ``source``: which input decided (slots > bytes > mem_fraction); ``budget_bytes``: bytes the
    pools may use (None when slots were given); ``bytes_per_token``: KV bytes per token slot over
    all built layers; ``req_to_token_bytes`` / ``kv_bytes``: bytes the pools will hold;
    ``graph_reserve_bytes``: the decode CUDA graphs' estimated pool (0 without graphs), taken out of a
    ``mem_fraction`` budget before the KV pool was sized from it; ``workspace_bytes``: the planned FlashInfer
    workspaces (0 without), counted with the pools against free memory (s10mem) but not taken out of a budget
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
    """Size ``req_to_token`` and the K/V buffers; see the module docstring for the rules.

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


def host_available_bytes() -> int:
    """Host memory the kernel could hand out now: ``MemAvailable`` from /proc/meminfo (Linux),
    else free physical pages (``os.sysconf``); 0 when unknown."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


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
    ``graphs``: the captured graphs and their estimate at a lower top (:class:`~pipeline.core.pool_remedy.GraphTrial`),
    for the alternatives that lower or drop them; ``min_slots`` / ``min_context_len``: the least token slots and
    context a remedy may name (what ``run``'s verification batches need). The remedy is
    :func:`pipeline.core.pool_remedy.refuse_pools`'. ``of_total``: ``available`` is the device's total memory
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
    """The ", or lower …" tail of a budget remedy: only the sizes that can still go lower (adversarial pass #5: at
    ``max_reqs`` 1 and the verification's shortest context it offered both, and neither could work).
    ``min_context_len``: the least ``max_context_len`` the caller accepts (``run``'s verification)."""
    names = (["max_reqs"] if max_reqs > 1 else []) + (["max_context_len"] if max_context_len > min_context_len else [])
    return f", or lower {' or '.join(names)}" if names else ""
