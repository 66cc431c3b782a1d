"""What attention setup knows about a model: :class:`ModelSpec`, its attention layer kinds, and layer-id helpers.

:class:`ModelSpec` is read from a Hugging Face ``config.json`` by :func:`pipeline.core.model_spec.load_model_spec`;
:func:`layer_kinds` groups its layers into the distinct kinds a backend sees (the contracts re-export
these types). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Literal, Optional

import msgspec

from pipeline.core.errors import ConfigError, ModelConfigError
from pipeline.core.shard import ShardLayout
from pipeline.core.validation import check_types

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)
CONFIG_REMEDY = "fix this key in config.json (compare with the model's published config on the Hub)"


class MLADims(msgspec.Struct, **_STRUCT):
    """Multi-head latent attention dimensions (DeepSeek-V2/V3 style), from config.json."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        check_types(self, "mla.")

    @property
    def absorbed_qk_dim(self) -> int:
        """qk head dim of the absorbed form: ``kv_lora_rank + qk_rope_head_dim`` (e.g. 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def absorbed_v_dim(self) -> int:
        """v head dim of the absorbed form: ``kv_lora_rank`` (e.g. 512)."""
        return self.kv_lora_rank


# Attention layer kinds a backend computes (``LayerKind.kind``) and the per-layer entries of
# ``ModelSpec.layer_types``: the attention kinds plus the layer types that are not softmax
# attention over a KV cache (computed by the model's own linear-attention / state-space kernels).
ATTENTION_LAYER_TYPES = ("full", "sliding", "chunked")
NOT_ATTENTION_LAYER_TYPES = ("linear_attention", "mamba", "moe", "mlp", "no_op", "linear", "conv")
AttentionLayerType = Literal["full", "sliding", "chunked"]
LayerType = Literal["full", "sliding", "chunked", "linear_attention", "mamba", "moe", "mlp", "no_op", "linear", "conv"]


class LayerKind(msgspec.Struct, **_STRUCT):
    """One distinct kind of attention layer as a backend sees it.

    ``head_dim_qk``/``head_dim_v`` are the dims the kernel sees (for MLA: the absorbed dims),
    ``num_heads``/``num_kv_heads`` likewise (MLA absorbed: ``num_kv_heads == 1``).
    ``sliding_window`` is the number of keys a query may see, itself included (HF convention:
    key j is visible from query i when ``0 <= i - j < sliding_window``); None = no window.
    ``attention_chunk_size`` (``kind == "chunked"``, Llama-4's local layers): chunked local
    attention, a window that resets at chunk boundaries — key j is visible from query i iff
    ``j <= i`` and ``j // C == i // C`` (HF ``Llama4TextConfig.attention_chunk_size``; sglang's
    ``attention_chunk_size``); None = no chunking.
    ``layer_ids`` lists the layers of this kind.
    """

    kind: AttentionLayerType
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    scaling: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    has_sinks: bool = False
    is_mla: bool = False
    layer_ids: list[int] = []
    attention_chunk_size: int | None = None
    k_eq_v: bool = False


class LayerShape(msgspec.Struct, **_STRUCT):
    """What one attention layer's attention computes when a model's layers differ (Gemma-4's global layers, NAS
    blocks, per-layer head counts, MiMo-V2-Flash's sliding layers): heads, kv heads, qk / v head dims, softmax
    scale, whether its sinks exist and whether K = V (Gemma-4 ``attention_k_eq_v``: the keys serve as values)."""

    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    scaling: float
    has_sinks: bool = False
    k_eq_v: bool = False


class LayerGroup(msgspec.Struct, **_STRUCT):
    """Layers of one type that no attention backend computes (``kind``: ``linear_attention``, ``mamba``, ``moe``,
    ``mlp`` (MoE-/MLP-only blocks), ``no_op`` (NAS blocks without attention), ``linear`` (NAS attention replaced by a
    linear map), ``conv`` (LFM2's short convolutions)), with their ids: they keep no KV cache, so the pools, the model stack and the
    verification cover only the attention layers."""

    kind: str
    layer_ids: list[int]


class ModelSpec(msgspec.Struct, **_STRUCT):
    """What attention setup needs to know about a model, read from a Hugging Face config.json.

    Build one with :func:`pipeline.core.model_spec.load_model_spec` (path or dict); per-``model_type``
    rules for implicit fields (Gemma-2's alternating windows, Qwen2's ``use_sliding_window`` /
    ``max_window_layers``, gpt-oss's ``layer_types`` and sinks …) live in that module only.

    ``layer_types`` has one entry per hidden layer: an attention kind (``"full"``, ``"sliding"``,
    ``"chunked"``) or a layer that is not softmax attention over a KV cache (``"linear_attention"``:
    Qwen3-Next's Gated DeltaNet layers; ``"mamba"``: Jamba-style state-space layers) — those are
    listed by :meth:`not_attention` and served by no attention backend.
    ``attention_chunk_size``: the chunk of the ``"chunked"`` layers (Llama-4), None without them.
    ``head_dim``/``v_head_dim`` are the per-head qk / v dims of the un-absorbed model;
    for MLA the absorbed dims are in :attr:`mla`. ``global_head_dim``: qk and v head dim of the
    full-attention layers when it differs from the sliding layers' ``head_dim`` (Gemma-style
    256 local / 512 global); None = every layer uses ``head_dim``/``v_head_dim``.
    ``scaling`` is the softmax scale (``query_pre_attn_scalar ** -0.5`` where set, else
    ``head_dim ** -0.5``; for MLA ``(qk_nope + qk_rope) ** -0.5``).
    ``layer_shapes``: one entry per layer (None for layers that are not attention) when the attention layers differ
    in heads, dims, scale, sinks or K = V; None = every attention layer has the fields above.
    ``dtype`` is the checkpoint's (``torch_dtype`` / ``dtype``); ``dtype_missing``: the config names
    neither, so ``dtype`` is ``float32``, as sglang's ``_get_and_verify_dtype`` reads a missing one.
    ``shard``: set on one rank's view (:mod:`pipeline.core.shard`): heads, kv heads and layers are the rank's.
    """

    model_type: str
    architectures: list[str] = []
    source: str = ""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    v_head_dim: int
    global_head_dim: int | None = None
    scaling: float
    layer_types: list[LayerType]
    sliding_window: int | None = None
    logit_softcap: float | None = None
    has_attention_sinks: bool = False
    mla: MLADims | None = None
    is_encoder_decoder: bool = False
    dtype: str = "bfloat16"
    dtype_missing: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    vocab_size: int = 32000
    attention_chunk_size: int | None = None
    layer_shapes: list[LayerShape | None] | None = None
    shard: ShardLayout | None = None

    def __post_init__(self) -> None:
        check_types(self)  # a ModelSpec built by hand gets the types load_model_spec guarantees

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    def layer_kinds(self) -> list[LayerKind]:
        """The distinct attention layer kinds, in first-layer order (see :class:`LayerKind`)."""
        return layer_kinds(self)

    def not_attention(self) -> list[LayerGroup]:
        """The layers no attention backend computes, grouped by type in first-layer order ([] for most models)."""
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(self.layer_types):
            if t in NOT_ATTENTION_LAYER_TYPES:
                groups.setdefault(t, []).append(i)
        return [LayerGroup(kind=k, layer_ids=ids) for k, ids in groups.items()]


def _kind_dim(spec: ModelSpec, kind: str, dim: int) -> int:
    """Head dim of a layer kind: ``global_head_dim`` for full layers when set (Gemma-style), else ``dim``."""
    return spec.global_head_dim if kind == "full" and spec.global_head_dim is not None else dim


_KINDS_CACHE: dict[int, tuple[ModelSpec, tuple[str, ...], tuple[LayerKind, ...]]] = {}
_KINDS_CACHE_MAX = 16


def layer_kinds(spec: ModelSpec) -> list[LayerKind]:
    """The distinct attention layer kinds of ``spec``, in first-layer order (a new list each call).

    A setup asks for them about ten times (resolve, capability checks, pool sizing, build); the result is kept for
    the last :data:`_KINDS_CACHE_MAX` specs, by identity (the spec is held, so its id is not reused) and by the
    contents of ``layer_types`` (the one field a frozen spec can still change in place). The kinds are frozen
    Structs; their ``layer_ids`` lists are shared between calls and must not be changed.

    Non-MLA layers are grouped into ``"full"``, ``"sliding"`` (window ``spec.sliding_window``
    keys, the query itself included; FlashInfer's / sglang's ``window_left`` is ``window - 1``) and
    ``"chunked"`` (chunked local attention, chunk ``spec.attention_chunk_size``: key j is visible
    from query i iff ``j <= i`` and ``j // C == i // C``; Llama-4's RoPE layers).
    MLA layers are reported in absorbed form, as sglang's MLA
    backends see them: one latent KV head (``num_kv_heads == 1``), ``head_dim_qk =
    kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V2), ``head_dim_v = kv_lora_rank``.
    Layers that are not attention (``linear_attention``, ``mamba``) form no kind: see
    ``ModelSpec.not_attention()``. A model made only of such layers has no kind ([]).

    Raises ModelConfigError when ``layer_types`` does not have one entry per layer, a sliding
    layer has no ``sliding_window`` or a chunked layer no ``attention_chunk_size``.
    """
    types = tuple(spec.layer_types)
    hit = _KINDS_CACHE.get(id(spec))
    if hit is not None and hit[0] is spec and hit[1] == types:
        return list(hit[2])
    kinds = _layer_kinds(spec)
    if len(_KINDS_CACHE) >= _KINDS_CACHE_MAX:
        _KINDS_CACHE.pop(next(iter(_KINDS_CACHE)), None)
    _KINDS_CACHE[id(spec)] = (spec, types, tuple(kinds))
    return kinds


def _layer_kinds(spec: ModelSpec) -> list[LayerKind]:
    if len(spec.layer_types) != spec.num_hidden_layers:
        raise ModelConfigError("layer_types must have one entry per hidden layer", json_path="$.layer_types",
                               flags=[("layer_types", len(spec.layer_types)),
                                      ("num_hidden_layers", spec.num_hidden_layers)],
                               allowed=[f"{spec.num_hidden_layers} entries"], remedy=CONFIG_REMEDY)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(spec.layer_types):
        if t in ATTENTION_LAYER_TYPES:
            groups.setdefault((t, _shape(spec, t, i)), []).append(i)
    for kind, key in (("sliding", "sliding_window"), ("chunked", "attention_chunk_size")):
        if any(t == kind for t, _ in groups) and getattr(spec, key) is None:
            raise ModelConfigError(f"{kind} layers need {key}", json_path=f"$.{key}", flags=[(key, None)],
                                   allowed=["an integer >= 1"], remedy=CONFIG_REMEDY)
    return [LayerKind(
        kind=t, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim_qk=s.head_dim_qk, head_dim_v=s.head_dim_v,
        scaling=s.scaling, sliding_window=spec.sliding_window if t == "sliding" else None,
        logit_softcap=spec.logit_softcap, has_sinks=s.has_sinks, is_mla=spec.mla is not None, layer_ids=ids,
        attention_chunk_size=spec.attention_chunk_size if t == "chunked" else None, k_eq_v=s.k_eq_v)
        for (t, s), ids in groups.items()]


def _shape(spec: ModelSpec, t: str, i: int) -> LayerShape:
    """Layer ``i``'s attention as a backend sees it: its own :class:`LayerShape` when the spec lists them, else the
    spec's uniform fields (MLA absorbed: one latent KV head of ``kv_lora_rank + qk_rope_head_dim``)."""
    if spec.layer_shapes is not None and spec.layer_shapes[i] is not None:
        return spec.layer_shapes[i]
    mla = spec.mla
    return LayerShape(num_heads=spec.num_attention_heads, num_kv_heads=1 if mla else spec.num_key_value_heads,
                      head_dim_qk=mla.absorbed_qk_dim if mla else _kind_dim(spec, t, spec.head_dim),
                      head_dim_v=mla.absorbed_v_dim if mla else _kind_dim(spec, t, spec.v_head_dim),
                      scaling=spec.scaling, has_sinks=spec.has_attention_sinks)


def format_layer_ids(ids: list[int]) -> str:
    """Layer ids exactly and briefly: ``0..31 (32)``, ``3, 7, .., 47 (12, every 4th)``, ``0..2, 4..6 (6)``."""
    if len(ids) <= 3:
        return ", ".join(map(str, ids))
    steps = {b - a for a, b in zip(ids, ids[1:])}
    if steps == {1}:
        return f"{ids[0]}..{ids[-1]} ({len(ids)})"
    if len(steps) == 1:
        k = steps.pop()
        nth = f"{k}{'nd' if k % 10 == 2 and k % 100 != 12 else 'rd' if k % 10 == 3 and k % 100 != 13 else 'th'}"
        return f"{ids[0]}, {ids[1]}, .., {ids[-1]} ({len(ids)}, every {nth})"
    runs, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}..{a}")
            start = b
    return f"{', '.join(runs)} ({len(ids)})"


def attention_layer_ids(spec: ModelSpec) -> list[int]:
    """Ids of the layers an attention backend computes (every layer but ``linear_attention`` / ``mamba``)."""
    return [i for i, t in enumerate(spec.layer_types) if t in ATTENTION_LAYER_TYPES]


def layers_covering_every_kind(spec: ModelSpec, minimum: int = 2) -> int:
    """The fewest leading attention layers (at least ``minimum``, at most all) that include one layer of
    every attention kind: 2 for Llama-3 or Gemma-2 (alternating), 4 for Llama-4 (a full layer every
    4th), 6 for Gemma-3 (every 6th). ``attn-setup run``'s default ``--num-layers``."""
    ids = attention_layer_ids(spec)
    first = {}
    for n, lid in enumerate(ids, start=1):
        first.setdefault(spec.layer_types[lid], n)
    return min(max([minimum] + list(first.values())), len(ids))


def attention_prefix(spec: ModelSpec, num_attention_layers: int) -> int:
    """How many leading hidden layers hold the first ``num_attention_layers`` attention layers.

    ``attn-setup run --num-layers N`` builds the first N *attention* layers: for an all-attention model
    that is layers ``0..N-1``; for a hybrid (Qwen3-Next: 3 linear-attention layers, then 1 full) the
    prefix also spans the linear layers in between (N=2 → 8 layers: ids 3 and 7 are built).

    Raises ConfigError (``invalid_value``) naming ``num_layers`` when N is outside 1..(attention layers).
    """
    ids = attention_layer_ids(spec)
    if not 1 <= num_attention_layers <= len(ids):
        hybrid = f" ({len(ids)} of its {spec.num_hidden_layers} layers are attention)" \
            if len(ids) != spec.num_hidden_layers else ""
        raise ConfigError(f"num_layers={num_attention_layers} is outside 1..{len(ids)}{hybrid}", code="invalid_value",
                          flags=[("num_layers", num_attention_layers)], allowed=[f"1..{len(ids)}"],
                          remedy=f"pass --num-layers between 1 and {len(ids)}" if ids else
                          "this model has no attention layer to build")
    return ids[num_attention_layers - 1] + 1


def truncate_spec(spec: ModelSpec, num_layers: Optional[int]) -> ModelSpec:
    """``spec`` cut after its ``num_layers``-th attention layer (None = all layers).

    For an all-attention model that is its first ``num_layers`` layers; a hybrid keeps the
    non-attention layers in between (:func:`attention_prefix`).
    Raises ConfigError (``invalid_value``) when ``num_layers`` is not in ``1..<attention layers>``.
    """
    if num_layers is None:
        return spec
    n = attention_prefix(spec, num_layers)
    if n == spec.num_hidden_layers:
        return spec
    return msgspec.structs.replace(spec, num_hidden_layers=n, layer_types=spec.layer_types[:n],
                                   layer_shapes=None if spec.layer_shapes is None else spec.layer_shapes[:n])
