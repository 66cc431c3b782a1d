"""Tensor- and pipeline-parallel shards: which heads and layers one rank serves, with sglang's rules.

- Rank layout (sglang ``ModelRunner.init_torch_distributed``: ``rank = tp_size * pp_rank + tp_rank``, world size
  ``tp_size * pp_size``): ``tp_rank = rank % tp_size``, ``pp_rank = rank // tp_size``.
- Attention DP (sglang ``layers/dp_attention.py`` ``compute_dp_attention_world_info``): attention heads are split over
  ``attn_tp_size = tp_size // attn_dp_size`` ranks, ``attn_tp_rank = tp_rank % attn_tp_size``.
- Query heads: ``num_attention_heads / attn_tp_size`` each, rank r holds heads ``[r*h, (r+1)*h)`` (sglang
  ``LlamaAttention.__init__``: ``assert total_num_heads % tp_size == 0``).
- KV heads (sglang ``LlamaAttention.__init__`` and ``QKVParallelLinear``): when ``kv >= tp`` they divide (``kv % tp``
  must be 0), else they are replicated (``tp % kv`` must be 0); a rank holds ``max(1, kv // tp)``, the replicated
  head being ``tp_rank // (tp // kv)`` (``QKVParallelLinear.weight_loader``: ``shard_id = tp_rank //
  num_kv_head_replicas``).
- MLA (sglang ``DeepseekV2AttentionMLA``: ``num_local_heads = num_heads // attn_tp_size``; ``MLATokenToKVPool``):
  query heads split, the latent cache (``kv_lora_rank + qk_rope_head_dim``, one latent head) replicated per rank.
- PP layer range (sglang ``distributed/utils.py`` ``get_pp_indices``, used by ``make_layers``): every decoder layer
  is partitioned, attention or not; ``num_hidden_layers // pp_size`` each, the last ``num_hidden_layers % pp_size``
  stages one more; ``SGLANG_PP_LAYER_PARTITION`` (comma-separated layers per stage) overrides. A stage's attention
  layers are those in its range; its pools hold only them (sglang's KV pools index ``layer_id - start_layer``), so
  the stage's spec counts its layers from 0.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.errors import ConfigError

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)
PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"


class ShardLayout(msgspec.Struct, **_STRUCT):
    """One rank's shard: its place in the tp × pp grid, its heads and its layers.

    ``num_heads``/``num_kv_heads``: the rank's query / kv heads (un-absorbed; MLA's latent cache is one head per rank,
    see :func:`shard_spec`); ``head_start``/``kv_head_start``: the first of them in the whole model;
    ``layer_range``: ``[start, end)`` of the whole model's layers; ``partition``: layers per stage (all stages);
    ``total_*``: the whole model's counts; ``model_sha``: a hash of the whole model (what every rank must share).
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    num_heads: int
    num_kv_heads: int
    head_start: int = 0
    kv_head_start: int = 0
    total_heads: int
    total_kv_heads: int
    total_layers: int
    layer_range: tuple[int, int]
    partition: list[int] = []
    model_sha: str = ""

    @property
    def kv_replicated(self) -> bool:
        """True when fewer kv heads than attention-TP ranks: each rank holds a copy of one kv head."""
        return self.total_kv_heads < self.attn_tp_size

    @property
    def is_whole(self) -> bool:
        return self.tp_size == 1 and self.pp_size == 1

    def grid_text(self) -> str:
        """The layout every rank shares (no rank of its own): what the rank digest compares."""
        return (f"tp {self.tp_size} x pp {self.pp_size}, attention tp {self.attn_tp_size}; heads "
                f"{self.total_heads}/{self.attn_tp_size}, kv heads {self.total_kv_heads} -> {self.num_kv_heads} per rank"
                f"; partition {self.partition} of {self.total_layers}")


def rank_coords(rank: int, tp_size: int) -> tuple[int, int]:
    """``(tp_rank, pp_rank)`` of a global rank, as sglang numbers ranks (``rank = tp_size * pp_rank + tp_rank``)."""
    return rank % tp_size, rank // tp_size


def pp_partition(num_layers: int, pp_size: int, environ: Mapping[str, str] = os.environ) -> list[int]:
    """Layers per stage, as sglang's ``get_pp_indices`` splits ``num_layers`` (see the module doc).

    Raises ConfigError ``pp_size_invalid`` when ``pp_size > num_layers``, ``invalid_value`` when
    ``SGLANG_PP_LAYER_PARTITION`` is not ``pp_size`` positive integers summing to ``num_layers``."""
    if pp_size > num_layers:
        raise ConfigError(f"pp_size={pp_size} exceeds the model's {num_layers} layers (each stage needs one)",
                          code="pp_size_invalid", flags=[("pp_size", pp_size), ("num_hidden_layers", num_layers)],
                          allowed=[f"1..{num_layers}"], remedy=f"pass --pp-size {min(2, num_layers)} (at most "
                          f"{num_layers})")
    raw = environ.get(PARTITION_ENV)
    if raw is None:
        base, extra = divmod(num_layers, pp_size)
        return [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    try:
        parts = [int(x) for x in raw.split(",")]
    except ValueError:
        parts = []
    if len(parts) != pp_size or sum(parts) != num_layers or min(parts, default=0) < 1:
        even = pp_partition(num_layers, pp_size, {})
        raise ConfigError(f"{PARTITION_ENV}={raw!r} must be {pp_size} positive layer counts summing to {num_layers}",
                          code="invalid_value", flags=[(PARTITION_ENV, raw), ("pp_size", pp_size),
                                                       ("num_hidden_layers", num_layers)],
                          allowed=[f"{pp_size} integers >= 1 with sum {num_layers}"],
                          remedy=f"set {PARTITION_ENV}={','.join(map(str, even))} or unset it (the even split)")
    return parts


def _tp_works(heads: int, kv: int, upto: int) -> list[int]:
    return [t for t in range(1, upto + 1) if heads % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)]


def check_tp(heads: int, kv: int, tp: int, *, is_mla: bool = False) -> None:
    """Refuse a TP size sglang's attention cannot split: ``tp_size_invalid`` naming both numbers and sizes that work.

    Query heads must divide by ``tp``; kv heads (not for MLA, whose latent cache is replicated) must divide by ``tp``
    or divide it."""
    why = None
    if heads % tp:
        why = f"{heads} query heads do not divide by tp_size={tp}"
    elif not is_mla and kv >= tp and kv % tp:
        why = f"{kv} kv heads do not divide by tp_size={tp}"
    elif not is_mla and kv < tp and tp % kv:
        why = f"tp_size={tp} is not a multiple of the {kv} kv heads (sglang replicates kv heads only evenly)"
    if why is None:
        return
    works = _tp_works(heads, heads if is_mla else kv, max(tp * 2, 16))
    fix = min(works, key=lambda t: (abs(t - tp), t))
    raise ConfigError(why, code="tp_size_invalid", flags=[("tp_size", tp), ("num_attention_heads", heads)] +
                      ([] if is_mla else [("num_key_value_heads", kv)]), allowed=[", ".join(map(str, works))],
                      remedy=f"pass --tp-size {fix}")


def check_stages(model: Any, parts: list[int]) -> None:
    """Refuse (``pp_size_invalid``) a partition with a stage that holds no attention layer of a model that has some
    (a hybrid: Qwen3-Next's full layers are every 4th): that stage has nothing for an attention backend to serve.
    The remedy names the largest pp size whose every stage holds one."""
    other = {i for g in model.not_attention() for i in g.layer_ids}
    attn = [i not in other for i in range(len(model.layer_types))]
    if len(parts) == 1 or not any(attn):
        return

    def empty(ps: list[int]) -> list[int]:
        bounds = [sum(ps[:i]) for i in range(len(ps) + 1)]
        return [i for i in range(len(ps)) if not any(attn[bounds[i]:bounds[i + 1]])]

    bad = empty(parts)
    if not bad:
        return
    n = len(parts)
    fits = [p for p in range(n - 1, 0, -1) if not empty(pp_partition(len(attn), p, {}))]
    s = sum(parts[:bad[0]])
    raise ConfigError(f"pipeline stage {bad[0]} of pp_size={n} (layers {s}-{s + parts[bad[0]] - 1}) holds no attention "
                      f"layer: nothing for an attention backend to serve there", code="pp_size_invalid",
                      flags=[("pp_size", n), ("stages_without_attention", bad), ("partition", parts)],
                      allowed=[f"a pp size whose every stage holds an attention layer: at most {fits[0]}"],
                      remedy=f"pass --pp-size {fits[0]}, or set {PARTITION_ENV} so that every stage holds an attention "
                      "layer")


def plan_layout(model: Any, *, tp_size: int, pp_size: int, rank: int, attn_dp_size: int = 1,
                environ: Mapping[str, str] = os.environ) -> ShardLayout:
    """The :class:`ShardLayout` of global ``rank`` for ``model`` (a whole :class:`ModelSpec`) under tp × pp.

    Raises ConfigError: ``tp_size_invalid`` (:func:`check_tp`), ``pp_size_invalid`` / ``invalid_value``
    (:func:`pp_partition`), ``conflicting_options`` when ``attn_dp_size`` does not divide ``tp_size``."""
    if tp_size % attn_dp_size:
        raise ConfigError(f"attn_dp_size={attn_dp_size} does not divide tp_size={tp_size} (sglang: tp_size must be "
                          "divisible by dp_size)", code="conflicting_options",
                          flags=[("attn_dp_size", attn_dp_size), ("tp_size", tp_size)],
                          allowed=[f"a divisor of {tp_size}"], remedy=f"pass --attn-dp-size "
                          f"{max(d for d in range(1, attn_dp_size + 1) if tp_size % d == 0)} (a divisor of {tp_size})")
    attn_tp = tp_size // attn_dp_size
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    check_tp(heads, kv, attn_tp, is_mla=model.mla is not None)
    parts = pp_partition(model.num_hidden_layers, pp_size, environ)
    tp_rank, pp_rank = rank_coords(rank, tp_size)
    a_rank = tp_rank % attn_tp
    h = heads // attn_tp
    if model.mla is not None:  # the un-absorbed kv heads split with the query heads; the latent cache is replicated
        kv_per, kv_start = h, a_rank * h
    elif kv >= attn_tp:
        kv_per, kv_start = kv // attn_tp, a_rank * (kv // attn_tp)
    else:
        kv_per, kv_start = 1, a_rank // (attn_tp // kv)
    check_stages(model, parts)
    start = sum(parts[:pp_rank])
    rec = msgspec.to_builtins(model)
    rec.pop("source", None)
    rec.pop("shard", None)
    sha = hashlib.sha256(msgspec.json.encode(rec, order="deterministic")).hexdigest()[:16]
    return ShardLayout(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, attn_tp_size=attn_tp,
                       attn_tp_rank=a_rank, num_heads=h, num_kv_heads=kv_per, head_start=a_rank * h,
                       kv_head_start=kv_start, total_heads=heads, total_kv_heads=kv, total_layers=model.num_hidden_layers,
                       layer_range=(start, start + parts[pp_rank]), partition=parts, model_sha=sha)


def shard_spec(model: Any, layout: ShardLayout) -> Any:
    """The rank's view of ``model``: its heads, kv heads and its stage's layers (ids from 0), ``shard`` set.

    The whole model itself when the layout is 1 × 1; a view is never sharded again."""
    if layout.is_whole or getattr(model, "shard", None) is not None:
        return model
    s, e = layout.layer_range
    shapes = getattr(model, "layer_shapes", None)
    if shapes is not None:  # heterogeneous layers (Gemma-4, per-layer heads): each split as the uniform heads are
        shapes = [None if x is None else _shard_shape(x, layout, model.mla is not None) for x in shapes[s:e]]
    return msgspec.structs.replace(model, num_attention_heads=layout.num_heads, num_key_value_heads=layout.num_kv_heads,
                                   num_hidden_layers=e - s, layer_types=list(model.layer_types[s:e]), shard=layout,
                                   layer_shapes=shapes)


def _shard_shape(shape: Any, layout: ShardLayout, is_mla: bool) -> Any:
    """One layer's :class:`~pipeline.core.spec.LayerShape` on this rank (:func:`plan_layout`'s rule; MLA's one latent
    kv head replicated). Raises ``tp_size_invalid`` when the layer's heads do not split."""
    tp, r = layout.attn_tp_size, layout.attn_tp_rank
    check_tp(shape.num_heads, shape.num_kv_heads, tp, is_mla=is_mla)
    kv = shape.num_kv_heads if is_mla else shape.num_kv_heads // tp if shape.num_kv_heads >= tp else 1
    return msgspec.structs.replace(shape, num_heads=shape.num_heads // tp, num_kv_heads=kv)


_VIEWS: dict[tuple, tuple[Any, Any]] = {}


def served_shard(model: Any, *, tp_size: Optional[int], pp_size: int, rank: int, world_size: int,
                 attn_dp_size: int = 1) -> Any:
    """The rank's view of ``model`` for a request's fields (kept for the last few models: the same object each
    call, so per-spec caches hold). ``tp_size`` None: ``world_size // pp_size``. A view is returned unchanged."""
    if getattr(model, "shard", None) is not None:
        return model
    tp = tp_size if tp_size is not None else max(world_size // pp_size, 1)
    if tp == 1 and pp_size == 1:
        return model
    key = (id(model), tp, pp_size, rank, attn_dp_size, os.environ.get(PARTITION_ENV))
    hit = _VIEWS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    view = shard_spec(model, plan_layout(model, tp_size=tp, pp_size=pp_size, rank=rank, attn_dp_size=attn_dp_size))
    if len(_VIEWS) >= 16:
        _VIEWS.pop(next(iter(_VIEWS)))
    _VIEWS[key] = (model, view)
    return view


def check_world(tp_size: Optional[int], pp_size: int, world_size: int) -> None:
    """Refuse ``tp_size * pp_size != world_size`` (``conflicting_options``, sglang launches exactly tp × pp ranks);
    with ``tp_size`` unset, ``pp_size`` must divide ``world_size``."""
    tp = tp_size if tp_size is not None else world_size // pp_size
    if tp >= 1 and tp * pp_size == world_size:
        return
    raise ConfigError(f"tp_size={tp_size} x pp_size={pp_size} = {(tp_size or 1) * pp_size} ranks, but the launch has "
                      f"world_size={world_size}" if tp_size is not None else
                      f"pp_size={pp_size} does not divide world_size={world_size}", code="conflicting_options",
                      flags=[("tp_size", tp_size), ("pp_size", pp_size), ("world_size", world_size)],
                      allowed=[f"tp_size * pp_size == {world_size}"],
                      remedy=f"pass --tp-size {max(world_size // pp_size, 1)} --pp-size {pp_size}"
                      if world_size % pp_size == 0 else f"pass --tp-size {world_size} --pp-size 1, or launch "
                      f"{(tp_size or 1) * pp_size} ranks")


def layout_of(request: Any) -> ShardLayout:
    """The :class:`ShardLayout` a :class:`SetupRequest` serves (whole model: tp 1 × pp 1)."""
    view = request.served_model
    if view.shard is not None:
        return view.shard
    m = view
    return ShardLayout(num_heads=m.num_attention_heads, num_kv_heads=m.num_key_value_heads,
                       total_heads=m.num_attention_heads, total_kv_heads=m.num_key_value_heads,
                       total_layers=m.num_hidden_layers, layer_range=(0, m.num_hidden_layers),
                       partition=[m.num_hidden_layers])


def shard_fields(request: Any) -> dict[str, Any]:
    """``plan --json``'s ``shard``: ``{tp_size, tp_rank, pp_size, pp_rank, num_heads, num_kv_heads, layer_range,
    kinds}`` of the request's rank. ``num_heads``/``num_kv_heads`` are those the backend sees for the first attention
    kind (MLA: one latent kv head); ``kinds`` lists them per attention kind (``[{kind, num_heads, num_kv_heads}]``)."""
    lay = layout_of(request)
    kinds = request.served_model.layer_kinds()
    first = kinds[0] if kinds else None
    return {"tp_size": lay.tp_size, "tp_rank": lay.tp_rank, "pp_size": lay.pp_size, "pp_rank": lay.pp_rank,
            "num_heads": first.num_heads if first else lay.num_heads,
            "num_kv_heads": first.num_kv_heads if first else lay.num_kv_heads, "layer_range": list(lay.layer_range),
            "kinds": [{"kind": k.kind, "num_heads": k.num_heads, "num_kv_heads": k.num_kv_heads} for k in kinds]}


def shard_line(fields: Mapping[str, Any], total_heads: int, total_kv_heads: int, total_layers: int,
               is_mla: bool = False) -> str:
    """The human one-liner of :func:`shard_fields`: ``shard: tp_size 16 tp_rank 0, pp_size 1 pp_rank 0: 4 of 64
    heads, 1 of 8 kv heads (replicated: 2 ranks share each), layers 0-79 of 80``."""
    f = fields
    s, e = f["layer_range"]
    if is_mla:
        kv = "latent kv cache (1 head) on every rank"
    else:
        kv = f"{f['num_kv_heads']} of {total_kv_heads} kv heads" + (
            f" (replicated: {f['tp_size'] // total_kv_heads} ranks share each)" if total_kv_heads < f["tp_size"]
            else "")
    return (f"shard: tp_size {f['tp_size']} tp_rank {f['tp_rank']}, pp_size {f['pp_size']} pp_rank {f['pp_rank']}: "
            f"{f['num_heads']} of {total_heads} heads, {kv}, layers {s}-{e - 1} of {total_layers}")


def shard_summary(request: Any) -> str:
    """:func:`shard_line` of a request's rank (``plan`` and ``run`` print it)."""
    lay = layout_of(request)
    return shard_line(shard_fields(request), lay.total_heads, lay.total_kv_heads, lay.total_layers,
                      request.served_model.is_mla)
