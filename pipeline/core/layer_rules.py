"""Which layers of a model are sliding, chunked, full, linear attention or mamba when its config does not list them:
the per-``model_type`` table :data:`LAYER_RULES` (the one place such rules live, each citing the HF / sglang code
it mirrors), the hybrid conventions, and the explicit per-layer lists that always win over the table
(``layer_types``, ``layers_block_type``, MiniMax's ``attn_type_list``). Used by
:func:`pipeline.core.model_spec.load_model_spec`; nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

from pipeline.core.config_reader import _Cfg, _show
from pipeline.core.errors import ModelConfigError
from pipeline.core.spec import ATTENTION_LAYER_TYPES


# Per-layer type names as HF configs spell them (``layer_types``; ``layers_block_type`` uses
# "attention"/"mamba"; HF Llama4TextConfig "chunked_attention"; Qwen3NextConfig "linear_attention").
_LAYER_TYPE_NAMES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                     "attention": "full", "linear_attention": "linear_attention", "mamba": "mamba",
                     "full": "full", "sliding": "sliding", "chunked": "chunked"}


# --------------------------------------------------------------------------------------------
# Implicit per-model_type rules: THE one place they live. Each rule returns one entry per layer
# ("full", "sliding", "chunked", "linear_attention" or "mamba"); it runs only when the config has
# no explicit per-layer list (layer_types / layers_block_type / attn_type_list).
# --------------------------------------------------------------------------------------------


def _all_full(c: _Cfg, n: int) -> list[str]:
    return ["full"] * n


def _uniform(c: _Cfg, n: int) -> list[str]:
    return ["sliding" if c.get("sliding_window") is not None else "full"] * n


def _even_sliding(c: _Cfg, n: int) -> list[str]:
    return ["sliding" if i % 2 == 0 else "full" for i in range(n)]


def _qwen_window_layers(c: _Cfg, n: int) -> list[str]:
    if not c.flag("use_sliding_window") or c.get("sliding_window") is None:
        return ["full"] * n
    first = c.integer("max_window_layers", 28, lo=0)
    return ["sliding" if i >= first else "full" for i in range(n)]


def _every_nth_full(c: _Cfg, n: int) -> list[str]:
    period = c.integer("sliding_window_pattern", 6)
    return ["full" if (i + 1) % period == 0 else "sliding" for i in range(n)]


def _every_nth_full_else_linear(c: _Cfg, n: int) -> list[str]:
    """Qwen3-Next: layer i is full attention iff (i + 1) % full_attention_interval == 0, else linear attention."""
    period = c.integer("full_attention_interval", 4)
    return ["full" if (i + 1) % period == 0 else "linear_attention" for i in range(n)]


def _attn_period_else_mamba(c: _Cfg, n: int) -> list[str]:
    """Jamba: layer i is attention iff i % attn_layer_period == attn_layer_offset, else mamba."""
    period = c.integer("attn_layer_period", 8)
    offset = c.integer("attn_layer_offset", 4, lo=0)
    if offset >= period:
        raise c.bad("attn_layer_offset", offset, f"an integer in [0, {period - 1}]",
                    f"must be smaller than attn_layer_period={period} (HF JambaConfig checks the same)")
    attn = "sliding" if c.get("sliding_window") is not None else "full"
    return [attn if i % period == offset else "mamba" for i in range(n)]


def _llama4_chunked(c: _Cfg, n: int) -> list[str]:
    """Llama-4: no_rope_layers[i] == 1 (a RoPE layer) is chunked local attention, 0 (NoPE) is full.

    An absent / empty ``no_rope_layers`` is built as HF does: ``int((i + 1) % no_rope_layer_interval != 0)``.
    With ``attention_chunk_size: null`` nothing is chunked (sglang serves no local attention then).
    """
    flags = c.get("no_rope_layers")
    if not flags:
        interval = c.integer("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if (not isinstance(flags, list) or len(flags) < n
            or any(isinstance(f, bool) or f not in (0, 1) for f in flags)):
        raise c.bad("no_rope_layers", flags, f"a list of at least {n} entries, each 0 or 1",
                    f"must give each of the {n} layers 0 (NoPE, full attention) or 1 (RoPE, chunked attention)")
    if c.get("attention_chunk_size") is None:
        return ["full"] * n
    return ["chunked" if f else "full" for f in flags[:n]]


class LayerRule(NamedTuple):
    """An implicit rule: ``layers(cfg, n)`` gives each layer's type; ``has_sinks``; ``cite`` = source;
    ``defaults``: the HF configuration class's defaults for keys a published config may leave out
    (applied only where the key is absent)."""

    layers: Callable[[_Cfg, int], list[str]]
    has_sinks: bool
    cite: str
    defaults: Mapping[str, Any] = {}


_QWEN = LayerRule(_qwen_window_layers, False,
                  "HF Qwen2Config/Qwen3Config: sliding_window applies only when use_sliding_window, "
                  "to layers i >= max_window_layers (default 28); the first max_window_layers are full")
_GEMMA3 = LayerRule(
    _every_nth_full, False,
    "HF Gemma3TextConfig: layer i is full iff (i + 1) % sliding_window_pattern == 0 (default 6), else sliding; "
    "the published multimodal configs (Gemma3ForConditionalGeneration) leave head_dim, query_pre_attn_scalar "
    "and other class defaults out of text_config, so those defaults apply",
    defaults={"hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
              "rope_theta": 1_000_000.0, "max_position_embeddings": 131072, "vocab_size": 262208})
_LLAMA4 = LayerRule(
    _llama4_chunked, False,
    "HF Llama4TextConfig: layer_types default to 'chunked_attention' where no_rope_layers[i] (RoPE layers) "
    "else 'full_attention' (NoPE); no_rope_layers defaults to int((i + 1) % no_rope_layer_interval != 0), "
    "interval 4; attention_chunk_size default 8192 (sglang get_hybrid_layer_ids: (i + 1) % 4 != 0 are local)",
    defaults={"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "head_dim": 128, "hidden_size": 5120,
              "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "rope_theta": 500000.0,
              "max_position_embeddings": 131072, "vocab_size": 202048})
_QWEN3_NEXT = LayerRule(
    _every_nth_full_else_linear, False,
    "HF Qwen3NextConfig: layer_types default to 'full_attention' iff (i + 1) % full_attention_interval == 0 "
    "(default 4), else 'linear_attention' (Gated DeltaNet, no KV cache)",
    defaults={"full_attention_interval": 4, "head_dim": 256, "hidden_size": 2048, "num_hidden_layers": 48,
              "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
              "max_position_embeddings": 32768})
_JAMBA = LayerRule(
    _attn_period_else_mamba, False,
    "HF JambaConfig.layers_block_type: 'attention' iff i % attn_layer_period == attn_layer_offset "
    "(defaults 8, 4), else 'mamba'",
    defaults={"attn_layer_period": 8, "attn_layer_offset": 4})
LAYER_RULES: dict[str, LayerRule] = {
    "llama": LayerRule(_all_full, False, "HF LlamaConfig: no sliding window"),
    "mistral": LayerRule(_uniform, False, "HF MistralConfig: sliding_window (4096 in v0.1) on every layer"),
    "mixtral": LayerRule(_uniform, False, "HF MixtralConfig: sliding_window on every layer when set"),
    "gemma2": LayerRule(_even_sliding, False,
                        "HF Gemma2Config.layer_types: layer i slides iff (i + 1) % 2, i.e. even i "
                        "(0, 2, ...) slide and odd are full; sglang gemma2.py: layer_id % 2 == 0"),
    "gemma3_text": _GEMMA3,
    "gemma3": _GEMMA3,  # the multimodal wrapper, when its text_config names no model_type
    "qwen2": _QWEN, "qwen2_moe": _QWEN, "qwen3": _QWEN, "qwen3_moe": _QWEN,
    "gpt_oss": LayerRule(_even_sliding, True,
                         "HF GptOssConfig: layer_types default alternates sliding/full from layer 0; "
                         "every attention layer has learned per-head sinks (GptOssAttention.sinks)"),
    "deepseek_v2": LayerRule(_all_full, False, "DeepSeek-V2 MLA: full attention everywhere"),
    "deepseek_v3": LayerRule(_all_full, False, "DeepSeek-V3 MLA: full attention everywhere"),
    "llama4_text": _LLAMA4, "llama4": _LLAMA4,
    "qwen3_next": _QWEN3_NEXT,
    "jamba": _JAMBA,
}
DEFAULT_RULE = LayerRule(_uniform, False, "HF convention for other decoders: sliding_window, when set, "
                                          "applies to every layer")


def _listed_types(c: _Cfg, key: str, n: int) -> list[str]:
    """An explicit per-layer list (``layer_types`` / ``layers_block_type``) read into layer types."""
    explicit = c.get(key)
    if not isinstance(explicit, list) or len(explicit) != n:
        raise c.bad(key, explicit, f"a list of {n} layer types (one per hidden layer)",
                    f"must list one type per layer (num_hidden_layers={n})")
    known = sorted(k for k in _LAYER_TYPE_NAMES if k not in ATTENTION_LAYER_TYPES)
    out = []
    for i, t in enumerate(explicit):
        if not isinstance(t, str) or t not in _LAYER_TYPE_NAMES:
            raise ModelConfigError(
                f"{c.at(key)}[{i}]={_show(t)} is not a layer type attn-setup knows", flags=[(f"{key}[{i}]", t)],
                json_path=f"{c.at(key)}[{i}]", allowed=known,
                remedy=f"if config.json is the published one, attn-setup does not support this layer type yet "
                       f"(it reads {', '.join(known)}); otherwise fix the entry")
        out.append(_LAYER_TYPE_NAMES[t])
    return out


def _minimax_types(c: _Cfg, n: int) -> list[str]:
    """MiniMax ``attn_type_list``: 1 = softmax (full) attention, 0 = linear (lightning) attention (vLLM
    ``ModelConfig.get_num_layers_by_block_type`` counts attention layers the same way)."""
    flags = c.get("attn_type_list")
    if not isinstance(flags, list) or len(flags) != n or any(isinstance(f, bool) or f not in (0, 1) for f in flags):
        raise c.bad("attn_type_list", flags, f"a list of {n} entries, each 0 or 1",
                    "must give each layer 1 (softmax attention) or 0 (linear attention)")
    return ["full" if f else "linear_attention" for f in flags]


def _layer_types(c: _Cfg, n: int, rule: Optional[LayerRule]) -> list[str]:
    """Per-layer types: an explicit list wins, then the model_type's rule, then the hybrid conventions.

    Order: ``layer_types`` > ``layers_block_type`` (Jamba-style) > ``attn_type_list`` (MiniMax) >
    :data:`LAYER_RULES` > a config with ``full_attention_interval`` and ``linear_*`` keys (the
    Qwen3-Next / Qwen3.5 layout) > ``attn_layer_period`` + ``attn_layer_offset`` (the Jamba layout) >
    :data:`DEFAULT_RULE`.
    """
    for key in ("layer_types", "layers_block_type"):
        if c.get(key) is not None:
            return _listed_types(c, key, n)
    if c.get("attn_type_list") is not None:
        return _minimax_types(c, n)
    if rule is not None:
        return rule.layers(c, n)
    if c.get("full_attention_interval") is not None and any(k.startswith("linear_") for k in c.data):
        return _every_nth_full_else_linear(c, n)
    if c.get("attn_layer_period") is not None and c.get("attn_layer_offset") is not None:
        return _attn_period_else_mamba(c, n)
    return DEFAULT_RULE.layers(c, n)
