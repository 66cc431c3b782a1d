"""Read a Hugging Face ``config.json`` into a :class:`~pipeline.core.contracts.ModelSpec`.

Fields are read as published (``num_key_value_heads`` defaults to the head count, ``head_dim``
to ``hidden_size // num_attention_heads``); a multimodal config that wraps its language model in
``text_config`` is read from there. What a config leaves implicit (which layers use a sliding
window, which are chunked local attention, which are not attention at all, whether attention sinks
exist, and the HF class defaults a sparse config leaves out) is decided by the per-``model_type``
table :data:`~pipeline.core.layer_rules.LAYER_RULES`, the only place such rules live. An explicit per-layer list
(``layer_types``, else ``layers_block_type``, else MiniMax's ``attn_type_list``) always wins over
the table. Unknown extra keys are ignored: HF configs carry many.

Layers that are not softmax attention over a KV cache — Qwen3-Next's linear-attention (Gated
DeltaNet) layers, Jamba's mamba layers — are read as ``"linear_attention"`` / ``"mamba"`` in
``ModelSpec.layer_types``; they form no :class:`LayerKind` (no backend computes them, no KV cache
is sized for them) and are listed by ``ModelSpec.not_attention()``.

Bad input raises :class:`pipeline.core.errors.ModelConfigError` (exit code 3) with the JSON path of the
offending key; an unreadable file, one that is not a regular file (a FIFO, ``/dev/zero``) or one
over :data:`MAX_CONFIG_BYTES` raises :class:`pipeline.core.errors.UsageError` (exit code 2) before
reading more than that.
Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections import ChainMap
from typing import Any, Mapping

from pipeline.core.config_reader import (  # noqa: F401 (MAX_CONFIG_BYTES … re-exported: this module held them)
    DEFAULT_UPPER, MAX_CONFIG_BYTES, MAX_INT_DIGITS, MSCALE_RANGE, PRE_ATTN_SCALAR_RANGE, ROPE_THETA_RANGE,
    SOFTCAP_RANGE, UPPER, YARN_FACTOR_RANGE, _Cfg, _choice, _in_range, _read_json, _show,
)
from pipeline.core.errors import ModelConfigError, UsageError
from pipeline.core.layer_rules import DEFAULT_RULE, LAYER_RULES, LayerRule, _layer_types  # noqa: F401
from pipeline.core.spec import (  # noqa: F401 (layer_kinds … re-exported: this module held them)
    ATTENTION_LAYER_TYPES, CONFIG_REMEDY, MLADims, ModelSpec, attention_layer_ids, attention_prefix, format_layer_ids,
    layer_kinds, layers_covering_every_kind,
)
from pipeline.core.validation import is_text

BUNDLED_CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "configs"
DEFAULT_MODEL_CONFIG = BUNDLED_CONFIG_DIR / "llama-3.1-8b.json"

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def layer_rule_note(src: str | os.PathLike | Mapping[str, Any]) -> str | None:
    """Which rule read the layers of a config whose ``model_type`` has no :data:`LAYER_RULES` entry and that lists
    no layer types itself (``layer_types`` / ``layers_block_type`` / ``attn_type_list``) — one sentence naming the
    rule applied and how to override it — else None (a known model type, or an explicit list: nothing was
    guessed). ``src`` is a config :func:`load_model_spec` has read (this reads it again, as it did)."""
    data = _read_json(pathlib.Path(src)) if isinstance(src, (str, os.PathLike)) else src
    top = _Cfg(data, "$")
    c = _text_cfg(top)
    model_type = c.get("model_type") or top.get("model_type")
    if model_type in LAYER_RULES or any(c.get(k) is not None
                                        for k in ("layer_types", "layers_block_type", "attn_type_list")):
        return None
    if c.get("full_attention_interval") is not None and any(k.startswith("linear_") for k in c.data):
        rule = "the Qwen3-Next layout (full attention every full_attention_interval-th layer, linear attention between)"
    elif c.get("attn_layer_period") is not None and c.get("attn_layer_offset") is not None:
        rule = "the Jamba layout (attention where i % attn_layer_period == attn_layer_offset, mamba elsewhere)"
    elif c.get("sliding_window") is not None:
        rule = f"the default rule ({DEFAULT_RULE.cite}): every layer slides over sliding_window"
    else:
        rule = f"the default rule ({DEFAULT_RULE.cite}): every layer is full attention"
    return (f"model_type {_show(model_type)} has no layer rule in attn-setup (LAYER_RULES), so its layers were read "
            f"by {rule}; if that is wrong, list every layer in config.json's layer_types (full_attention, "
            "sliding_attention, chunked_attention, linear_attention or mamba, one per layer)")


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN attention-scale correction ``0.1 * mscale * ln(factor) + 1`` (1.0 when factor <= 1).

    Mirrors ``yarn_get_mscale`` in HF's and sglang's DeepSeek-V2 code; the softmax scale is
    multiplied by its square when ``rope_scaling.mscale_all_dim`` is set.
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_model_spec(src: str | os.PathLike | Mapping[str, Any], *, source: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a path, or the already-parsed dict) into a ModelSpec.

    Parameters
    ----------
    src: path of a ``config.json`` file, or its parsed content (a dict).
    source: label recorded in ``ModelSpec.source`` (default: the path, or ``"dict"``).

    Returns
    -------
    ModelSpec with per-layer kinds, softmax ``scaling`` (``query_pre_attn_scalar ** -0.5``
    where set, else ``head_dim ** -0.5``; MLA: ``(qk_nope + qk_rope) ** -0.5`` times
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` when ``rope_scaling.mscale_all_dim`` is set, as
    HF's and sglang's DeepSeek-V2 attention do) and MLA dims when ``kv_lora_rank`` is set.

    Raises
    ------
    UsageError: the file cannot be read (code ``config_unreadable``), is not a regular file
        (``not_a_regular_file``) or is larger than :data:`MAX_CONFIG_BYTES` (``file_too_large``);
        flag ``path``.
    ModelConfigError: malformed JSON, a missing/mistyped/non-positive key, a head count not
        divisible by the kv-head count, or inconsistent layer types; ``info.json_path`` names
        the key (``$.num_attention_heads``, ``$.text_config.head_dim`` …).
    """
    if isinstance(src, Mapping):
        data, label = src, "dict"
    elif isinstance(src, (str, os.PathLike)):
        # a file name with undecodable bytes is shown with escapes: the label goes into every log record
        data, label = _read_json(pathlib.Path(src)), os.fsencode(src).decode("utf-8", "backslashreplace")
    else:
        raise UsageError(f"model config must be a path or a dict, not {type(src).__name__}",
                         flags=[("src", type(src).__name__)], allowed=["str", "os.PathLike", "dict"],
                         remedy="pass the path of config.json or its parsed dict")
    if not isinstance(data, Mapping):
        raise ModelConfigError("config.json must hold a JSON object", json_path="$",
                               flags=[("config", type(data).__name__)], allowed=["a JSON object"],
                               remedy="the top level of config.json is {...}")
    return _build(_Cfg(data, "$"), source if source is not None else label)


def _text_cfg(top: _Cfg) -> _Cfg:
    inner = top.get("text_config")
    if inner is None:
        return top
    if not isinstance(inner, Mapping):
        raise top.bad("text_config", inner, "a JSON object", "must be a JSON object")
    return _Cfg(inner, top.at("text_config"))


def _heads(c: _Cfg) -> tuple[int, int, int, int]:
    """(hidden_size, layers, heads, kv_heads); kv heads default to heads and must divide them."""
    hidden = c.integer("hidden_size", required=True)
    layers = c.integer("num_hidden_layers", required=True)
    heads = c.integer("num_attention_heads", required=True)
    kv = c.integer("num_key_value_heads", heads)
    if heads % kv:
        raise ModelConfigError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}",
            flags=[("num_key_value_heads", kv), ("num_attention_heads", heads)],
            json_path=c.at("num_key_value_heads"),
            allowed=[str(d) for d in range(1, heads + 1) if heads % d == 0], remedy=CONFIG_REMEDY)
    return hidden, layers, heads, kv


_MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")


def _mla(c: _Cfg) -> MLADims | None:
    if c.get("kv_lora_rank") is None:
        partial = [k for k in _MLA_KEYS[1:] if c.get(k) is not None]
        if partial:  # an MLA config that lost kv_lora_rank must not silently become an MHA model
            raise c.bad("kv_lora_rank", None, "an integer >= 1",
                        f"is missing although {', '.join(partial)} (MLA dims) are set")
        return None
    rope_dim = c.integer("qk_rope_head_dim", required=True)
    if rope_dim % 2:
        raise c.bad("qk_rope_head_dim", rope_dim, "an even integer",
                    "must be even (rotary embeddings rotate pairs of dims)")
    return MLADims(kv_lora_rank=c.integer("kv_lora_rank", required=True),
                   qk_rope_head_dim=rope_dim,
                   qk_nope_head_dim=c.integer("qk_nope_head_dim", required=True),
                   v_head_dim=c.integer("v_head_dim", required=True), q_lora_rank=c.integer("q_lora_rank"))


def _computed_head_dim(c: _Cfg, hidden: int, heads: int) -> ModelConfigError:
    """A config without ``head_dim`` whose ``hidden_size / num_attention_heads`` is no even integer: the error names
    the two keys it was computed from (the JSON path is ``hidden_size``'s), never the absent ``head_dim`` key."""
    quotient = f"{hidden} / {heads} = {hidden / heads:g}"
    why = ("not an integer" if hidden % heads else "odd (rotary embeddings rotate pairs of dims)" if hidden // heads % 2
           else f"above the largest head_dim accepted ({UPPER['head_dim']})")
    return ModelConfigError(
        f"the config has no head_dim, so it is computed as {c.at('hidden_size')} / {c.at('num_attention_heads')} "
        f"= {quotient}, which is {why}", flags=[("hidden_size", hidden), ("num_attention_heads", heads)],
        json_path=c.at("hidden_size"), allowed=["hidden_size / num_attention_heads an even integer",
                                                "an explicit even head_dim"],
        remedy="add the model's head_dim to config.json, or fix hidden_size / num_attention_heads (compare with the "
               "model's published config on the Hub)")


def _head_dims(c: _Cfg, hidden: int, heads: int, mla: MLADims | None) -> tuple[int, int]:
    """(qk head dim, v head dim) of the un-absorbed model."""
    if mla is not None:
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    head_dim = c.integer("head_dim")
    if head_dim is None:  # computed as HF's LlamaConfig does: hidden_size // num_attention_heads
        if hidden % heads or (hidden // heads) % 2 or hidden // heads > UPPER["head_dim"]:
            raise _computed_head_dim(c, hidden, heads)
        head_dim = hidden // heads
    if head_dim % 2:
        raise c.bad("head_dim", head_dim, "an even integer", "must be even (rotary embeddings rotate pairs of dims)")
    v_dim = c.integer("v_head_dim", head_dim)
    if v_dim != head_dim:  # only MLA has its own v dim (HF configs of other decoders have one head_dim)
        raise c.bad("v_head_dim", v_dim, f"{head_dim} (= head_dim) unless the model is MLA (kv_lora_rank set)",
                    f"must equal head_dim={head_dim} on a model without MLA: one head dim serves q, k and v "
                    "(the attention stack, the KV pool and every backend's non-MLA path)")
    return head_dim, v_dim


def _rope_block(c: _Cfg) -> tuple[str, _Cfg] | None:
    for key in ("rope_scaling", "rope_parameters"):
        block = c.get(key)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise c.bad(key, block, "a JSON object or null", "must be a JSON object or null")
        return key, _Cfg(block, c.at(key))
    return None


def _scaling(c: _Cfg, head_dim: int, mla: MLADims | None) -> float:
    """Softmax scale as HF/sglang compute it (see :func:`load_model_spec`)."""
    if mla is None:
        scalar = _in_range(c, "query_pre_attn_scalar", c.num("query_pre_attn_scalar"), PRE_ATTN_SCALAR_RANGE,
                           "the softmax scale is its inverse square root")
        return (scalar if scalar is not None else float(head_dim)) ** -0.5
    scale = float(head_dim) ** -0.5
    rope = _rope_block(c)
    if rope is not None and rope[1].get("mscale_all_dim"):
        r = rope[1]
        m = yarn_mscale(_in_range(r, "factor", r.num("factor", 1.0), YARN_FACTOR_RANGE, "YaRN context extension factor"),
                        _in_range(r, "mscale_all_dim", r.num("mscale_all_dim"), MSCALE_RANGE,
                                  "its square multiplies the softmax scale"))
        scale *= m * m
    return scale


def _rope_theta(c: _Cfg) -> float:
    """``rope_theta`` (top level, else in the RoPE block; default 10000) in ``ROPE_THETA_RANGE``, low end
    exclusive (config_reader says why), else ModelConfigError at its JSON path."""
    theta, at, rope = c.num("rope_theta"), c, _rope_block(c)
    if theta is None and rope is not None:
        theta, at = rope[1].num("rope_theta"), rope[1]
    lo, hi = ROPE_THETA_RANGE
    if theta is not None and not lo < theta <= hi:
        raise at.bad("rope_theta", theta, f"a number in ({lo:g}, {hi:g}]", f"must be in ({lo:g}, {hi:g}] (RoPE's "
                     "base: at 1 or below the rotary frequencies are all alike or above a radian per position, "
                     "above it the lowest underflow)")
    return theta if theta is not None else 10000.0


def _dtype(c: _Cfg, top: _Cfg) -> tuple[str, bool]:
    """The checkpoint dtype and whether the config left it out (then float32, as sglang reads it)."""
    for cfg in (c, top):
        for key in ("torch_dtype", "dtype"):
            v = cfg.get(key)
            if v is not None:
                return _choice(v, _DTYPES, cfg.at(key), key, "bfloat16, float16 or float32",
                               "is not a supported model dtype"), False
    return "float32", True


def _build(top: _Cfg, source: str) -> ModelSpec:
    c = _text_cfg(top)
    model_type = c.text("model_type") or top.text("model_type", required=True)
    archs = top.get("architectures")
    archs = [] if archs is None else archs  # absent or null; any other falsy value (0, "", {}) is refused
    if not isinstance(archs, list) or not all(is_text(a) for a in archs):
        raise top.bad("architectures", archs, "a list of strings", "must be a list of strings")
    rule = LAYER_RULES.get(model_type)
    if rule is not None and rule.defaults:  # HF class defaults for the keys a published config leaves out
        c = _Cfg(ChainMap(dict(c.data), dict(rule.defaults)), c.path)
    hidden, n_layers, heads, kv = _heads(c)
    mla = _mla(c)
    head_dim, v_dim = _head_dims(c, hidden, heads, mla)
    kinds = _layer_types(c, n_layers, rule)
    window = c.integer("sliding_window", required=True) if "sliding" in kinds else None
    chunk = c.integer("attention_chunk_size", required=True) if "chunked" in kinds else None
    dtype, dtype_missing = _dtype(c, top)
    return ModelSpec(
        model_type=model_type, architectures=list(archs), source=source, hidden_size=hidden,
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, v_head_dim=v_dim, scaling=_scaling(c, head_dim, mla), layer_types=kinds,
        sliding_window=window,
        logit_softcap=_in_range(c, "attn_logit_softcapping", c.num("attn_logit_softcapping"), SOFTCAP_RANGE,
                                "logits become cap * tanh(logit / cap)"),
        has_attention_sinks=(rule or DEFAULT_RULE).has_sinks, mla=mla,
        is_encoder_decoder=top.flag("is_encoder_decoder") or c.flag("is_encoder_decoder"),
        dtype=dtype, dtype_missing=dtype_missing, rope_theta=_rope_theta(c),
        max_position_embeddings=c.integer("max_position_embeddings", 4096),
        vocab_size=c.integer("vocab_size", 32000), attention_chunk_size=chunk)
