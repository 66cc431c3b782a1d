"""Read a Hugging Face ``config.json`` into a :class:`~pipeline.core.contracts.ModelSpec`.

Fields are read as published (``num_key_value_heads`` defaults to the head count, ``head_dim``
to ``hidden_size // num_attention_heads``); a multimodal config that wraps its language model in
``text_config`` is read from there. What a config leaves implicit (which layers use a sliding
window, which are chunked local attention, which are not attention at all, whether attention sinks
exist, and the HF class defaults a sparse config leaves out) is decided by the per-``model_type``
table :data:`LAYER_RULES` below, the only place such rules live. An explicit per-layer list
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

import json
import math
import os
import pathlib
from collections import ChainMap
from typing import Any, Callable, Mapping, NamedTuple, Optional

from pipeline.core.errors import ModelConfigError, UsageError
from pipeline.core.spec import (  # noqa: F401 (layer_kinds … re-exported: this module held them)
    ATTENTION_LAYER_TYPES, CONFIG_REMEDY, MLADims, ModelSpec, attention_layer_ids, attention_prefix, format_layer_ids,
    layer_kinds, layers_covering_every_kind,
)
from pipeline.core.validation import is_text

BUNDLED_CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "configs"
DEFAULT_MODEL_CONFIG = BUNDLED_CONFIG_DIR / "llama-3.1-8b.json"

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
# Per-layer type names as HF configs spell them (``layer_types``; ``layers_block_type`` uses
# "attention"/"mamba"; HF Llama4TextConfig "chunked_attention"; Qwen3NextConfig "linear_attention").
_LAYER_TYPE_NAMES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
                     "attention": "full", "linear_attention": "linear_attention", "mamba": "mamba",
                     "full": "full", "sliding": "sliding", "chunked": "chunked"}


# Upper bounds far above any published model, so a typo cannot make the pipeline size (or loop over)
# absurd structures: a billion layers would hang before anything could be refused.
UPPER = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1024,
         "v_head_dim": 1024, "hidden_size": 1 << 20, "kv_lora_rank": 8192, "qk_rope_head_dim": 1024,
         "qk_nope_head_dim": 1024, "q_lora_rank": 1 << 16, "sliding_window": 1 << 24,
         "attention_chunk_size": 1 << 24}
# Any other integer key: int32 range (positions, vocab ids and layer counts are int32 in HF and sglang).
DEFAULT_UPPER = (1 << 31) - 1
# Longer digit strings are not parsed into ints (Python refuses above 4300 digits; nothing in a config
# needs more than an int64): such a value reads as :class:`_HugeInt` and each key that is read refuses it.
MAX_INT_DIGITS = 20


def _finite(v: int | float) -> bool:
    """A float, or an int a float can hold (``math.isfinite(10**400)`` raises OverflowError)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class _HugeInt:
    """A JSON integer literal too long to be a config value; never equal to anything a getter accepts."""

    def __init__(self, digits: str) -> None:
        self.n = len(digits.lstrip("+-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.n} digits>"


def _parse_int(text: str) -> int | _HugeInt:
    return _HugeInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


# Ranges for what sets the softmax scale and the logit softcap: wide around every published model,
# narrow enough that attention stays finite in float16/bfloat16 (a softcap of 1e308 is inf in
# bf16, and cap * tanh(x / cap) then gives NaN; a scale of 1e150 overflows every logit).
SOFTCAP_RANGE = (1.0, 65504.0)        # Gemma-2: 50, Grok-1: 30; 65504 = float16's largest finite value
PRE_ATTN_SCALAR_RANGE = (1.0, float(1 << 20))  # Gemma-2: 256 (9B), 144 (27B); scale = x ** -0.5 ∈ [2**-10, 1]
YARN_FACTOR_RANGE = (1e-3, 1e4)       # DeepSeek-V2/V3: 40; the YaRN mscale grows with ln(factor)
MSCALE_RANGE = (1e-3, 100.0)          # DeepSeek-V2/V3: mscale_all_dim 0.707 / 1.0


def _in_range(c: "_Cfg", key: str, value: float | None, rng: tuple[float, float], why: str) -> float | None:
    """``value`` when None or inside ``rng`` (inclusive), else ModelConfigError at ``key``'s JSON path."""
    lo, hi = rng
    if value is not None and not lo <= value <= hi:
        raise c.bad(key, value, f"a number in [{lo:g}, {hi:g}]", f"must be in [{lo:g}, {hi:g}] ({why})")
    return value


class _Cfg:
    """One JSON object plus its JSON path, with typed getters that raise ModelConfigError."""

    def __init__(self, data: Mapping[str, Any], path: str) -> None:
        self.data, self.path = data, path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def bad(self, key: str, value: Any, allowed: str, why: str) -> ModelConfigError:
        return ModelConfigError(f"{self.at(key)} {why}", flags=[(key, value)], json_path=self.at(key),
                                allowed=[allowed], remedy=CONFIG_REMEDY)

    def get(self, key: str) -> Any:
        """The value, or None when the key is absent or JSON null."""
        return self.data.get(key)

    def integer(self, key: str, default: int | None = None, *, required: bool = False,
                lo: int = 1) -> int | None:
        """An integer in ``[lo, UPPER[key]]`` (absurd sizes are refused before anything is sized from them)."""
        v = self.get(key)
        hi = UPPER.get(key, DEFAULT_UPPER)
        rng = f"an integer in [{lo}, {hi}]"
        if v is None:
            if required:
                raise self.bad(key, None, rng, "is missing (required)")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise self.bad(key, v, rng, f"must be {rng}")
        return v

    def num(self, key: str, default: float | None = None) -> float | None:
        v = self.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v <= 0:
            raise self.bad(key, v, "a finite number > 0", "must be a finite number > 0")
        return float(v)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.bad(key, v, "true or false", "must be a boolean")
        return v

    def text(self, key: str, *, required: bool = False) -> str | None:
        v = self.get(key)
        if v is None and required:
            raise self.bad(key, None, "a non-empty string", "is missing (required)")
        if v is not None and (not is_text(v) or not v):
            raise self.bad(key, v, "a non-empty string (valid UTF-8)",
                           "must be a non-empty string" + (" of valid UTF-8 text (it holds a lone surrogate)"
                                                           if isinstance(v, str) and v else ""))
        return v


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


MAX_CONFIG_BYTES = 16 << 20  # published config.json files are a few KB; the largest multimodal ones < 100 KB


def _read_json(path: pathlib.Path) -> Any:
    from pipeline.core.files import read_capped

    try:
        raw = read_capped(path, MAX_CONFIG_BYTES, flag="path", what="model config")
    except UsageError as e:  # a FIFO or device (not_a_regular_file), too large, or unreadable
        if e.info.code == "file_unreadable":
            import msgspec

            e.info = msgspec.structs.replace(e.info, code="config_unreadable",
                                             remedy="pass the path of a readable Hugging Face config.json")
        raise
    try:
        return json.loads(raw, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                               code="model_config_malformed", json_path="$",
                               flags=[("path", str(path)), ("line", e.lineno), ("column", e.colno)],
                               allowed=["a JSON object"], remedy="fix the JSON syntax") from None
    except RecursionError:
        raise ModelConfigError(f"{path} nests JSON too deeply to be a model config", code="model_config_malformed",
                               json_path="$", flags=[("path", str(path))], allowed=["a flat JSON object"],
                               remedy="pass the model's config.json") from None
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path} is not UTF-8 text: {e.reason}", code="model_config_malformed",
                               json_path="$", flags=[("path", str(path))], allowed=["UTF-8 JSON"],
                               remedy="save config.json as UTF-8") from None


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


def _choice(v: Any, names: Mapping[str, str], path: str, flag: str, allowed: str, why: str) -> str:
    """``names[v]`` when ``v`` is one of the string keys; any other JSON value (a list, an object, a
    number) is refused naming ``path``, never looked up (a list or object is not even hashable)."""
    if isinstance(v, str) and v in names:
        return names[v]
    raise ModelConfigError(f"{path}={_show(v)} {why}", flags=[(flag, v)], json_path=path, allowed=[allowed],
                           remedy=CONFIG_REMEDY)


def _show(v: Any) -> str:
    """A short JSON rendering of a config value for messages (never fails: huge ints, deep nesting)."""
    try:
        text = json.dumps(v, default=repr, ensure_ascii=True)
    except (ValueError, RecursionError):
        text = f"<a {type(v).__name__} too large to show>"
    return text if len(text) <= 60 else text[:57] + "..."


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


def _rope_theta(c: _Cfg) -> float:
    theta = c.num("rope_theta")
    rope = _rope_block(c)
    if theta is None and rope is not None:
        theta = rope[1].num("rope_theta")
    return theta if theta is not None else 10000.0


def _dtype(c: _Cfg, top: _Cfg) -> str:
    for cfg in (c, top):
        for key in ("torch_dtype", "dtype"):
            v = cfg.get(key)
            if v is not None:
                return _choice(v, _DTYPES, cfg.at(key), key, "bfloat16, float16 or float32",
                               "is not a supported model dtype")
    return "bfloat16"


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
    return ModelSpec(
        model_type=model_type, architectures=list(archs), source=source, hidden_size=hidden,
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, v_head_dim=v_dim, scaling=_scaling(c, head_dim, mla), layer_types=kinds,
        sliding_window=window,
        logit_softcap=_in_range(c, "attn_logit_softcapping", c.num("attn_logit_softcapping"), SOFTCAP_RANGE,
                                "logits become cap * tanh(logit / cap)"),
        has_attention_sinks=(rule or DEFAULT_RULE).has_sinks, mla=mla,
        is_encoder_decoder=top.flag("is_encoder_decoder") or c.flag("is_encoder_decoder"),
        dtype=_dtype(c, top), rope_theta=_rope_theta(c),
        max_position_embeddings=c.integer("max_position_embeddings", 4096),
        vocab_size=c.integer("vocab_size", 32000), attention_chunk_size=chunk)
