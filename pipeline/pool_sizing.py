"""Sizing the KV memory pools from a memory budget and the model (sglang's ``init_memory_pool``).

The budget is either a fraction of the device's memory (``--mem-fraction``, sglang's
``mem_fraction_static``: the share of total device memory the static pools — weights and KV
cache — may use; the weights already allocated are subtracted) or an explicit byte count, or an
explicit slot count (``--num-token-slots``), in that order of precedence: slots > bytes > fraction.

Bytes per token = Σ over the built layers of ``Hkv·(D_qk + D_v)·elem_size(kv_dtype)`` (sglang's
``cell_size``); ``req_to_token`` costs ``max_reqs·max_context_len·4`` bytes (int32). The number of
token slots is the rest of the budget divided by bytes per token, rounded *down* to whole pages,
with at least two pages (page 0 is the reserved padding page). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import msgspec

from pipeline.contracts import LayerKind, PoolFacts
from pipeline.errors import ConfigError

KV_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
REQ_TO_TOKEN_ELEM_BYTES = 4

Source = Literal["slots", "bytes", "mem_fraction"]


class PoolSizing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The sized pools: ``facts`` (what the pools are built from) and the accounting behind it.

    ``source``: which input decided (slots > bytes > mem_fraction); ``budget_bytes``: bytes the
    pools may use (None when slots were given); ``bytes_per_token``: KV bytes per token slot over
    all built layers; ``req_to_token_bytes`` / ``kv_bytes``: bytes the pools will hold.
    """

    facts: PoolFacts
    source: Source
    budget_bytes: Optional[int]
    bytes_per_token: int
    req_to_token_bytes: int
    kv_bytes: int


# The flag behind each budget source, for error messages.
_FLAG = {"bytes": "mem_bytes", "mem_fraction": "mem_fraction"}

def kv_bytes_per_token(kinds: Sequence[LayerKind], num_layers: int, kv_dtype: str) -> int:
    """KV-cache bytes one token slot costs over layers ``0..num_layers-1`` (K and V, every layer)."""
    if kv_dtype not in KV_ELEM_BYTES:
        raise ConfigError(f"kv dtype {kv_dtype!r} has no known element size", code="invalid_value",
                          flags=[("kv_cache_dtype", kv_dtype)], allowed=sorted(KV_ELEM_BYTES),
                          remedy="pick one of the allowed KV cache dtypes")
    per_layer = {lid: k.num_kv_heads * (k.head_dim_qk + k.head_dim_v) for k in kinds for lid in k.layer_ids}
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


def size_pools(kinds: Sequence[LayerKind], num_layers: int, kv_dtype: str, *, page_size: int, max_reqs: int,
               max_context_len: int, num_token_slots: Optional[int] = None, budget_bytes: Optional[int] = None,
               source: Source = "bytes", mem_fraction: Optional[float] = None, min_slots: int = 0,
               min_slots_for: str = "") -> PoolSizing:
    """Size ``req_to_token`` and the K/V buffers; see the module docstring for the rules.

    Exactly one of ``num_token_slots`` (rounded up to whole pages) or ``budget_bytes`` must be
    given (``mem_fraction``: the fraction a ``source="mem_fraction"`` budget came from, for the
    error). The pool must hold at least two pages and ``min_slots`` token slots (rounded up to
    pages; ``min_slots_for`` says what needs them, e.g. ``attn-setup run``'s verification batches).
    Raises ConfigError (``pool_budget_too_small``) naming the flag, what it must cover and a remedy
    otherwise; nothing is allocated.
    """
    per_tok = kv_bytes_per_token(kinds, num_layers, kv_dtype)
    r2t = max_reqs * max_context_len * REQ_TO_TOKEN_ELEM_BYTES
    floor = max(2 * page_size, -(-min_slots // page_size) * page_size)
    what = f"{floor} token slots ({min_slots_for})" if min_slots_for else f"{floor // page_size} pages of {page_size} token(s)"
    if num_token_slots is not None:
        slots, source, budget = -(-num_token_slots // page_size) * page_size, "slots", None
        if slots < floor:
            raise ConfigError(f"num_token_slots={num_token_slots} cannot hold {what}", code="pool_budget_too_small",
                              flags=[("num_token_slots", num_token_slots), ("page_size", page_size)],
                              allowed=[f">= {floor}"], remedy=f"set num_token_slots={floor} or more")
    elif budget_bytes is not None:
        budget = int(budget_bytes)
        slots = max(0, (budget - r2t) // max(per_tok, 1)) // page_size * page_size
        need = r2t + floor * per_tok
        if slots < floor:
            raise ConfigError(
                f"a pool budget of {budget} bytes cannot hold req_to_token ({r2t} bytes) and {what} "
                f"at {per_tok} bytes per token ({need} bytes in all)",
                code="pool_budget_too_small",
                flags=([("mem_fraction", mem_fraction), ("budget_bytes", budget)] if source == "mem_fraction"
                       else [(_FLAG.get(source, source), budget)]) + [("max_reqs", max_reqs),
                                                                      ("max_context_len", max_context_len)],
                allowed=[f">= {need} bytes"],
                remedy=f"raise {_FLAG.get(source, source)} to cover {need} bytes, or lower max_reqs or "
                       "max_context_len")
    else:
        raise ConfigError("size_pools needs num_token_slots or budget_bytes", code="invalid_value",
                          flags=[("num_token_slots", None), ("budget_bytes", None)],
                          remedy="pass num_token_slots or budget_bytes")
    facts = PoolFacts(max_reqs=max_reqs, max_context_len=max_context_len, num_token_slots=slots, page_size=page_size)
    return PoolSizing(facts=facts, source=source, budget_bytes=budget, bytes_per_token=per_tok,
                      req_to_token_bytes=r2t, kv_bytes=slots * per_tok)
