"""The rules attn-setup keeps beside transformers' configuration classes, each citing the code it mirrors:

- :data:`OWN_FAMILIES`: per-layer types of the families transformers 5 has no class for (remote-code models sglang
  serves: Baichuan, InternLM2, MiMo, EXAONE-3, Kimi-K2, Llama-Nemotron NAS);
- :data:`SLIDES_EVERY_LAYER`: the classes that list no ``layer_types`` and apply ``sliding_window`` to every layer;
- :func:`modeling_overrides`: what a family's modeling code does that its configuration does not say (Gemma-4's
  scale 1.0 and K = V, MiMo-V2-Flash's doubled kv heads and sinks on sliding layers, gpt-oss's sinks, Granite's
  ``attention_multiplier``);
- :data:`LAYER_TYPE_NAMES`: transformers' per-layer type names read into ours, and the ones refused as features.
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

from pipeline.core.config_reader import _Cfg

# transformers' layer type names (``layer_types`` / ``layers_block_type``) → ours; "mamba" is also spelled
# "linear_attention" by transformers 5 (JambaConfig, NemotronHConfig); "conv": LFM2's short-convolution blocks.
LAYER_TYPE_NAMES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                    "attention": "full", "linear_attention": "linear_attention", "mamba": "mamba", "moe": "moe",
                    "mlp": "mlp", "conv": "conv", "full": "full", "sliding": "sliding", "chunked": "chunked"}
# Layer types that are attention attn-setup does not compute yet: refused as ``unsupported_attention_feature``.
SPARSE_LAYER_TYPES = {
    "indexed_attention": "DeepSeek sparse attention: an indexer picks index_topk keys per query (DSA)",
    "deepseek_sparse_attention": "DeepSeek sparse attention: an indexer picks the keys each query sees (DSA)",
    "compressed_sparse_attention": "compressed sparse attention (DeepSeek-V4)",
    "heavily_compressed_attention": "heavily compressed attention (DeepSeek-V4)",
    "hybrid": "a mamba block with a shared attention block whose input is the hidden state concatenated with the "
              "embeddings (Zamba2)",
}
# Classes without ``layer_types`` whose attention passes ``sliding_window=config.sliding_window`` on every layer
# (transformers modeling_mistral/mixtral/starcoder2/phi3/phimoe/qwen3_moe: create_sliding_window_causal_mask
# whenever config.sliding_window is set).
SLIDES_EVERY_LAYER = frozenset({"mistral", "mixtral", "starcoder2", "phi3", "phimoe", "qwen3_moe"})


class OwnRule(NamedTuple):
    """A family transformers lacks: ``layers(cfg, n)`` gives each layer's type; ``cite``: the code mirrored."""

    layers: Callable[[_Cfg, int], list[str]]
    cite: str
    alibi: Callable[[_Cfg], bool] = lambda c: False
    reference: str | None = None  # the transformers model_type whose code computes the same layers (the oracle's)


def _all_full(c: _Cfg, n: int) -> list[str]:
    return ["full"] * n


def _qwen_window_layers(c: _Cfg, n: int) -> list[str]:
    if not c.flag("use_sliding_window") or c.get("sliding_window") is None:
        return ["full"] * n
    first = c.integer("max_window_layers", 28, lo=0)
    return ["sliding" if i >= first else "full" for i in range(n)]


def _nas_blocks(c: _Cfg, n: int) -> list[str]:
    """Llama-Nemotron NAS ``block_configs[i].attention``: ``no_op`` → no attention, ``replace_with_linear`` → a linear
    map (no KV), else full attention with ``num_attention_heads // n_heads_in_group`` kv heads."""
    blocks = c.get("block_configs")
    if not isinstance(blocks, list) or len(blocks) != n or not all(isinstance(b, Mapping) for b in blocks):
        raise c.bad("block_configs", blocks, f"a list of {n} block objects", f"must list one block per layer ({n})")
    out = []
    for b in blocks:
        a = b.get("attention") or {}
        out.append("no_op" if a.get("no_op") else "linear" if a.get("replace_with_linear") else "full")
    return out


OWN_FAMILIES: dict[str, OwnRule] = {
    "baichuan": OwnRule(_all_full, "sglang models/baichuan.py: hidden_size 4096 (7B) uses RoPE, otherwise (13B) ALiBi",
                        alibi=lambda c: c.get("hidden_size") != 4096),
    "internlm2": OwnRule(_all_full, "sglang models/internlm2.py: packed wqkv, causal attention on every layer",
                         reference="llama"),
    "mimo": OwnRule(_qwen_window_layers, "sglang models/mimo.py (Qwen2 layers): sliding_window only when "
                                         "use_sliding_window, on layers i >= max_window_layers", reference="qwen2"),
    "exaone": OwnRule(_all_full, "sglang models/exaone.py: Llama-style attention on every layer, no window",
                      reference="llama"),
    "kimi_k2": OwnRule(_all_full, "sglang serves Kimi-K2 (architectures DeepseekV3ForCausalLM) with models/deepseek_v2.py: "
                                  "MLA on every layer", reference="deepseek_v3"),
    "nemotron-nas": OwnRule(_nas_blocks, "sglang models/nemotron_nas.py DeciLMDecoderLayer: block_configs[i].attention "
                                         "no_op / replace_with_linear / n_heads_in_group"),
}


def nas_kv_heads(c: _Cfg, i: int, heads: int) -> int:
    """kv heads of NAS block ``i``: ``heads // block_configs[i].attention.n_heads_in_group``."""
    group = (c.get("block_configs")[i].get("attention") or {}).get("n_heads_in_group")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1 or heads % group:
        raise c.bad(f"block_configs[{i}].attention.n_heads_in_group", group, f"a divisor of {heads}",
                    f"must divide num_attention_heads={heads}")
    return heads // group


def modeling_overrides(model_type: str, hf: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
    """What the family's modeling code sets for a layer of ``layer_type`` that its configuration does not:
    ``scaling``, ``kv_factor`` (kv heads multiplier), ``has_sinks``, ``k_eq_v``."""
    out: dict[str, Any] = {}
    if model_type in ("gemma4", "gemma4_text"):
        out["scaling"] = 1.0  # modeling_gemma4.Gemma4TextAttention: self.scaling = 1.0 (q and k are RMS-normed)
        # use_alternative_attention = config.attention_k_eq_v and not self.is_sliding: v is k
        out["k_eq_v"] = bool(hf.get("attention_k_eq_v")) and layer_type != "sliding"
    elif model_type == "mimo_v2_flash" and layer_type == "sliding":
        out["kv_factor"] = 2  # MiMoV2FlashAttention: SWA layers double the kv heads and have sinks
        out["has_sinks"] = True
    elif model_type == "gpt_oss":
        out["has_sinks"] = True  # GptOssAttention.sinks on every layer
    if model_type.startswith("granite") and hf.get("attention_multiplier") is not None:
        out["scaling"] = float(hf["attention_multiplier"])  # GraniteAttention: self.scaling = attention_multiplier
    return out
