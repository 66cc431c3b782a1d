"""Read a Hugging Face ``config.json`` into a :class:`~pipeline.core.contracts.ModelSpec`.

Structure comes from transformers' own configuration class for the ``model_type`` (:mod:`pipeline.core.hf_config`:
per-layer ``layer_types`` / ``layers_block_type``, per-layer configs, class defaults such as Gemma-2's head_dim 256);
the published values are validated here with their JSON paths. Families transformers lacks and what a family's
modeling code sets beyond its configuration are the cited rules of :mod:`pipeline.core.layer_rules`. Nothing is
guessed: an unknown ``model_type`` is ``unknown_architecture``, attention we do not compute (sparse / indexed layers,
ALiBi, cross-attention, a window no class says where to apply) is ``unsupported_attention_feature``, both exit 3.

Layers that are not softmax attention over a KV cache (linear attention, mamba, MoE- or MLP-only blocks, NAS no-op
blocks) are kept in ``ModelSpec.layer_types`` with their ids, form no :class:`LayerKind` and get no KV cache.
Attention layers that differ in heads, dims, scale, sinks or K = V get their own ``ModelSpec.layer_shapes`` entries
and so their own kind.

Bad input raises :class:`pipeline.core.errors.ModelConfigError` (exit code 3) with the JSON path of the
offending key; an unreadable file, one that is not a regular file (a FIFO, ``/dev/zero``) or one
over :data:`MAX_CONFIG_BYTES` raises :class:`pipeline.core.errors.UsageError` (exit code 2) before
reading more than that. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections import ChainMap
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core.config_reader import (  # noqa: F401 (MAX_CONFIG_BYTES … re-exported: this module held them)
    DEFAULT_UPPER, MAX_CONFIG_BYTES, MAX_INT_DIGITS, MSCALE_RANGE, PRE_ATTN_SCALAR_RANGE, ROPE_THETA_RANGE,
    SOFTCAP_RANGE, UPPER, YARN_FACTOR_RANGE, _Cfg, _choice, _in_range, _read_json, _show,
)
from pipeline.core import hf_config
from pipeline.core.errors import ModelConfigError, UsageError
from pipeline.core.layer_rules import (
    LAYER_TYPE_NAMES, OWN_FAMILIES, SLIDES_EVERY_LAYER, SPARSE_LAYER_TYPES, modeling_overrides, nas_kv_heads,
)
from pipeline.core.spec import (  # noqa: F401 (layer_kinds … re-exported: this module held them)
    ATTENTION_LAYER_TYPES, CONFIG_REMEDY, LayerShape, MLADims, ModelSpec, attention_layer_ids, attention_prefix,
    format_layer_ids, layer_kinds, layers_covering_every_kind,
)
from pipeline.core.validation import is_text

BUNDLED_CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "data" / "configs"
DEFAULT_MODEL_CONFIG = BUNDLED_CONFIG_DIR / "llama-3.1-8b.json"

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


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


def _head_dims(c: _Cfg, hidden: int, heads: int, mla: MLADims | None, allow_v: bool = False) -> tuple[int, int]:
    """(qk head dim, v head dim) of the un-absorbed model; a v dim of its own outside MLA only where transformers'
    class has one (``allow_v``: MiMo-V2-Flash's 192 / 128)."""
    if mla is not None:
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
    raw = c.data.maps[0] if isinstance(c.data, ChainMap) else c.data
    derived = raw.get("head_dim") is None and c.get("head_dim") == hidden // heads
    # transformers derived it as hidden_size // num_attention_heads: checked as computed here
    head_dim = None if derived else c.integer("head_dim")
    if head_dim is None:  # computed as HF's LlamaConfig does: hidden_size // num_attention_heads
        if hidden % heads or (hidden // heads) % 2 or hidden // heads > UPPER["head_dim"]:
            raise _computed_head_dim(c, hidden, heads)
        head_dim = hidden // heads
    if head_dim % 2:
        raise c.bad("head_dim", head_dim, "an even integer", "must be even (rotary embeddings rotate pairs of dims)")
    v_dim = c.integer("v_head_dim", head_dim)
    if v_dim != head_dim and not allow_v:  # only MLA has its own v dim (HF configs of other decoders have one head_dim)
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
    """``rope_theta`` (top level, else in a RoPE block — transformers 5's ``rope_parameters``, per layer type the full
    layers' —; default 10000) in ``ROPE_THETA_RANGE``, low end exclusive (config_reader says why), else
    ModelConfigError at its JSON path."""
    theta, at = c.num("rope_theta"), c
    for key in ("rope_scaling", "rope_parameters"):
        block = c.get(key)
        if theta is not None or not isinstance(block, Mapping):
            continue
        at = _Cfg(block, c.at(key))
        if isinstance(block.get("full_attention"), Mapping):
            at = _Cfg(block["full_attention"], at.at("full_attention"))
        theta = at.num("rope_theta")
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


# Substrings of config keys that can bear on attention: an unknown family's error names the ones present.
_ATTENTION_HINTS = ("window", "pattern", "layer_types", "block_type", "per_layer", "sparse", "index", "alibi",
                    "linear", "mamba", "ssm", "heads", "head_dim", "kv_lora", "attn", "attention", "chunk", "sink",
                    "softcap", "block_configs", "cross")
_FEATURE_REMEDY = ("none in attn-setup yet: the file is valid as published, but no attn-setup backend computes this "
                   "attention (docs/models.md lists what is served)")


def _feature(c: _Cfg, field: str, value: Any, ids: list[int], why: str) -> ModelConfigError:
    """``unsupported_attention_feature``: ``field`` changes what layers ``ids`` compute and nothing here honours it."""
    return ModelConfigError(
        f"{c.at(field)}={_show(value)} changes attention on layers {format_layer_ids(ids)}: {why}; attn-setup does "
        "not compute it, and serving the model as if it were absent would be wrong", code="unsupported_attention_feature",
        json_path=c.at(field), flags=[(field, value), ("layer_ids", format_layer_ids(ids))],
        allowed=["a model whose attention attn-setup computes"], remedy=_FEATURE_REMEDY)


def _unknown(c: _Cfg, model_type: str) -> ModelConfigError:
    present = [k for k, v in c.data.items()
               if v is not None and not k.startswith("_") and not k.endswith(("_bias", "_dropout"))
               and any(h in k for h in _ATTENTION_HINTS)]
    ver = hf_config.transformers_version()
    return ModelConfigError(
        f"model_type {_show(model_type)} is known neither to transformers {ver} nor to attn-setup's own rules, so "
        "which layers attend and how cannot be read without guessing; attention-relevant fields present: "
        f"{', '.join(present) or 'none'}", code="unknown_architecture", json_path=c.at("model_type"),
        flags=[("model_type", model_type)] + [(k, c.get(k)) for k in present[:12]],
        allowed=sorted(OWN_FAMILIES) + ["a model_type transformers' CONFIG_MAPPING_NAMES holds"],
        remedy="none for this file: attn-setup does not read this family yet (docs/models.md says how one is added)")


def _hf_types(c: _Cfg, hf: hf_config.Reading, hfd: Mapping[str, Any], model_type: str, n: int) -> list[str]:
    """Per-layer types from transformers' config: ``layer_types``, else ``layers_block_type`` (a property on some
    classes), else every layer full, or sliding for :data:`SLIDES_EVERY_LAYER` when ``sliding_window`` is set."""
    raw = c.data.maps[0] if isinstance(c.data, ChainMap) else c.data
    if raw.get("attn_type_list") is not None and raw.get("layer_types") is None:
        flags = raw["attn_type_list"]  # MiniMax: 1 softmax, 0 lightning (linear) attention; MiniMaxConfig ignores it
        if not isinstance(flags, list) or len(flags) != n or any(isinstance(f, bool) or f not in (0, 1) for f in flags):
            raise c.bad("attn_type_list", flags, f"a list of {n} entries, each 0 or 1",
                        "must give each layer 1 (softmax attention) or 0 (linear attention)")
        return ["full" if f else "linear_attention" for f in flags]
    key, listed = hf.layers_key, hf.layers
    if listed is None:
        ids = _when_set(_Cfg(hfd, c.path), "cross_attention_layers", f"a list of layer ids in [0, {n - 1}]",
                        lambda v: isinstance(v, list) and all(_is_int(i, 0, n - 1) for i in v))
        if ids:
            raise _feature(c, "cross_attention_layers", ids, ids, "cross-attention to the vision encoder's states")
        window = _when_set(_Cfg(hfd, c.path), "sliding_window", f"an integer in [1, {UPPER['sliding_window']}]",
                           lambda v: _is_int(v, 1, UPPER["sliding_window"]))
        if window:
            if model_type in SLIDES_EVERY_LAYER:
                return ["sliding"] * n
            raise _feature(c, "sliding_window", window, list(range(n)),
                           f"transformers' {hf.cls} lists no layer_types, so its configuration does not "
                           "say which layers slide")
        return ["full"] * n
    if not isinstance(listed, list) or len(listed) != n:
        raise c.bad(key, listed, f"a list of {n} layer types", f"must list one type per layer (num_hidden_layers={n})")
    odd: dict[str, list[int]] = {}
    for i, t in enumerate(listed):
        if t not in LAYER_TYPE_NAMES:
            odd.setdefault(str(t), []).append(i)
    for t, ids in odd.items():
        raise _feature(c, key, t, ids, SPARSE_LAYER_TYPES.get(t, f"layer type {t!r} is not one attn-setup knows"))
    out = [LAYER_TYPE_NAMES[t] for t in listed]
    if "chunked" in out and c.get("attention_chunk_size") is None:  # no chunk: transformers' mask and sglang are causal
        out = ["full" if t == "chunked" else t for t in out]
    return out


# Where a per-layer value of transformers' per-layer config (Gemma-4) comes from in the file.
_PER_LAYER_SOURCES = {"num_attention_heads": ("num_attention_heads",),
                      "num_key_value_heads": ("num_key_value_heads", "num_global_key_value_heads"),
                      "head_dim": ("head_dim", "global_head_dim")}


def _per_layer(c: _Cfg, hf: Optional[hf_config.Reading], i: int, n: int, key: str, default: int) -> tuple[int, str]:
    """Layer ``i``'s ``key`` and its JSON path: transformers' per-layer config (Gemma-4), a ``<key>_per_layer`` list
    of ``n`` entries, else ``default``. Checked as the global key is (an integer in [1, UPPER[key]], a head dim even),
    else ModelConfigError ``model_config_invalid`` naming the path and value."""
    if hf is not None and hf.per_layer is not None:
        v = hf.per_layer[i].get(key)
        if v is None:
            return default, c.at(key)
        path = next((c.at(k) for k in _PER_LAYER_SOURCES[key] if c.get(k) == v and type(c.get(k)) is type(v)),
                    f"{c.at(key)} (layer {i} of transformers' {hf.cls})")
    else:
        listed = c.get(f"{key}_per_layer")
        if listed is None:
            return default, c.at(key)
        if not isinstance(listed, list) or len(listed) != n:
            raise _malformed(c.at(f"{key}_per_layer"), listed, f"a list of {n} integers (num_hidden_layers={n})")
        v, path = listed[i], f"{c.at(key + '_per_layer')}[{i}]"
    hi = UPPER[key]
    if type(v) is not int or not 1 <= v <= hi or (key == "head_dim" and v % 2):
        raise _malformed(path, v, f"an {'even ' if key == 'head_dim' else ''}integer in [1, {hi}] (as {key})")
    return v, path


def _malformed(path: str, v: Any, allowed: str) -> ModelConfigError:
    return ModelConfigError(f"{path}={_show(v)} is not {allowed}", code="model_config_invalid", json_path=path,
                            flags=[(path.rsplit(".", 1)[-1], v)], allowed=[allowed], remedy=CONFIG_REMEDY)


def _shapes(c: _Cfg, hf: Optional[hf_config.Reading], hfd: Mapping[str, Any], model_type: str, kinds: list[str], uniform: LayerShape,
            mla: MLADims | None) -> list[LayerShape | None] | None:
    """Each attention layer's :class:`LayerShape`; None when all equal ``uniform`` (the spec's own fields)."""
    out: list[LayerShape | None] = []
    qpas = c.num("query_pre_attn_scalar")
    for i, t in enumerate(kinds):
        if t not in ATTENTION_LAYER_TYPES:
            out.append(None)
            continue
        ov = modeling_overrides(model_type, hfd, t)
        if mla is not None:
            out.append(msgspec.structs.replace(uniform, has_sinks=ov.get("has_sinks", uniform.has_sinks)))
            continue
        n = len(kinds)
        heads, heads_at = _per_layer(c, hf, i, n, "num_attention_heads", uniform.num_heads)
        if model_type == "nemotron-nas":
            kv, kv_at = nas_kv_heads(c, i, heads), c.at(f"block_configs[{i}].attention.n_heads_in_group")
        else:
            kv, kv_at = _per_layer(c, hf, i, n, "num_key_value_heads", uniform.num_kv_heads)
            kv *= ov.get("kv_factor", 1)
        qk = _per_layer(c, hf, i, n, "head_dim", uniform.head_dim_qk)[0]
        v = qk if qk != uniform.head_dim_qk else uniform.head_dim_v
        if heads % kv:
            at = heads_at if heads_at != c.at("num_attention_heads") else kv_at
            raise ModelConfigError(
                f"layer {i}: {heads_at}={heads} attention heads is not a multiple of {kv_at}={kv} kv heads",
                code="model_config_invalid", json_path=at, flags=[(heads_at, heads), (kv_at, kv)],
                allowed=[f"kv heads dividing {heads}"], remedy=CONFIG_REMEDY)
        scale = ov.get("scaling", uniform.scaling if qk == uniform.head_dim_qk else (qpas or qk) ** -0.5)
        out.append(LayerShape(num_heads=heads, num_kv_heads=kv, head_dim_qk=qk, head_dim_v=v, scaling=scale,
                              has_sinks=ov.get("has_sinks", False), k_eq_v=ov.get("k_eq_v", False)))
    attn = [s for s in out if s is not None]
    return None if all(s == uniform for s in attn) else out


def _check_raw(c: _Cfg) -> None:
    """The file's own values checked as :func:`_build` reads them (raises the first bad one with its JSON path)."""
    n = c.integer("num_hidden_layers")
    _check_lists(c, n)
    for key in _PER_LAYER_SOURCES:  # Laguna's num_attention_heads_per_layer, …: length and entries
        for i in range(n or 0) if c.get(f"{key}_per_layer") is not None else ():
            _per_layer(c, None, i, n, key, 0)
    for key in ("sliding_window", "attention_chunk_size", "max_position_embeddings", "vocab_size"):
        c.integer(key)
    _in_range(c, "query_pre_attn_scalar", c.num("query_pre_attn_scalar"), PRE_ATTN_SCALAR_RANGE,
              "the softmax scale is its inverse square root")
    for key in ("torch_dtype", "dtype"):
        if c.get(key) is not None:
            _choice(c.get(key), _DTYPES, c.at(key), key, "bfloat16, float16 or float32", "is not a supported model dtype")
    period, offset = c.integer("attn_layer_period", 8), c.integer("attn_layer_offset", 4, lo=0)
    if offset >= period:
        raise c.bad("attn_layer_offset", offset, f"an integer in [0, {period - 1}]",
                    f"must be smaller than attn_layer_period={period} (transformers' JambaConfig checks the same)")
    c.integer("full_attention_interval")
    if "hidden_size" in c.data and "num_attention_heads" in c.data:  # a null one too: the class refused it
        hidden, _, heads, _ = _heads(_Cfg(ChainMap(dict(c.data), {"num_hidden_layers": n or 1}), c.path))
        _head_dims(c, hidden, heads, _mla(c), allow_v=True)


def _check_lists(c: _Cfg, n: int | None, names: bool = True) -> None:
    """The file's per-layer lists: one entry per layer, each a string (``names``: one attn-setup knows — where
    transformers' class refused the file; a name the class took is read or refused as a feature by
    :func:`_hf_types`), ``no_rope_layers`` entries 0 or 1."""
    for key in ("layer_types", "layers_block_type"):
        listed = c.get(key)
        if listed is None:
            continue
        if not isinstance(listed, list) or (n is not None and len(listed) != n):
            raise c.bad(key, listed, f"a list of {n} layer types", f"must list one type per layer (num_hidden_layers={n})")
        for i, t in enumerate(listed):
            if not isinstance(t, str) or names and t not in LAYER_TYPE_NAMES and t not in SPARSE_LAYER_TYPES:
                raise ModelConfigError(f"{c.at(key)}[{i}]={_show(t)} is not a layer type transformers knows",
                                       flags=[(f"{key}[{i}]", t)], json_path=f"{c.at(key)}[{i}]",
                                       allowed=sorted(LAYER_TYPE_NAMES), remedy=CONFIG_REMEDY)
    flags = c.get("no_rope_layers")
    if flags and (not isinstance(flags, list) or len(flags) < (n or 0)
                  or any(isinstance(f, bool) or f not in (0, 1) for f in flags)):
        raise c.bad("no_rope_layers", flags, f"a list of at least {n} entries, each 0 or 1",
                    f"must give each of the {n} layers 0 (NoPE, full attention) or 1 (RoPE, chunked attention)")


def _identify(top: _Cfg) -> tuple[_Cfg, str, Any, Any, Mapping[str, Any]]:
    """(text config view, model_type, own rule or None, transformers' text config or None, its fields): the file's
    values first, then the class's defaults and derived fields. Raises ``unknown_architecture``."""
    c = _text_cfg(top)
    model_type = c.text("model_type") or top.text("model_type")
    if model_type is None:
        raise ModelConfigError(
            "the file names no model_type, so it is not a Hugging Face transformers config.json (a training "
            "framework's config, say): which layers attend cannot be read from it", code="unknown_architecture",
            json_path=top.at("model_type"), flags=[("model_type", None)],
            allowed=["a config.json with model_type"],
            remedy="pass the model's Hugging Face configuration (the file transformers reads: it has model_type)")
    own = OWN_FAMILIES.get(model_type)
    if own is not None:
        return c, model_type, own, None, {}
    top_type = top.text("model_type") or model_type
    try:
        hf = hf_config.read(top.data, top_type)
        if hf is None and top_type != model_type:
            hf = hf_config.read(c.data, model_type)
    except ModelConfigError:
        _check_raw(c)  # a bad published value is named by its JSON path; else the class's own refusal
        raise
    if hf is None:
        raise _unknown(c, model_type)
    hfd = hf.fields
    return _Cfg(ChainMap({k: v for k, v in c.data.items() if v is not None}, hfd), c.path), model_type, None, hf, hfd


def _when_set(c: _Cfg, key: str, allowed: str, ok: Any, *, boolean: bool = False) -> Any:
    """A field that changes attention and is refused when set: None when absent, null or 0 (``boolean``: false);
    the value when ``ok(value)``; any other value (20.0, "20", NaN, a list, out of range) is ModelConfigError
    ``model_config_invalid`` at its JSON path, never read as absent."""
    v = c.get(key)
    if v is None or (type(v) is int and v == 0) or (boolean and v is False):
        return None
    if not ok(v):
        raise ModelConfigError(
            f"{c.at(key)}={_show(v)} is not {allowed}: it changes attention, so a value that cannot be read is "
            "refused, never served as if absent", code="model_config_invalid", json_path=c.at(key),
            flags=[(key, v)], allowed=[allowed], remedy=CONFIG_REMEDY)
    return v


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _refuse_unhonoured(c: _Cfg, own: Any, n_layers: int, kinds: list[str]) -> None:
    """``unsupported_attention_feature`` for a field that changes attention and that nothing here computes; a value
    of such a field that is neither unset nor readable is ``model_config_invalid`` (:func:`_when_set`)."""
    attn_ids = [i for i, t in enumerate(kinds) if t in ATTENTION_LAYER_TYPES]
    if own is not None and own.alibi(c):
        raise _feature(c, "hidden_size", c.get("hidden_size"), attn_ids, f"ALiBi position biases ({own.cite})")
    for key in ("alibi", "use_alibi"):
        if _when_set(c, key, "true or false", lambda v: v is True, boolean=True):
            raise _feature(c, key, c.get(key), attn_ids, "ALiBi position biases")
    pos = _when_set(c, "position_embedding_type", "a string", lambda v: isinstance(v, str))
    if isinstance(pos, str) and pos.strip().lower() == "alibi":
        raise _feature(c, "position_embedding_type", pos, attn_ids, "ALiBi position biases")
    if _when_set(c, "index_topk", "an integer >= 1", lambda v: _is_int(v, 1, DEFAULT_UPPER)) and attn_ids:
        raise _feature(c, "index_topk", c.get("index_topk"), attn_ids, SPARSE_LAYER_TYPES["indexed_attention"])
    # Gemma-3: true (every query also sees later tokens); Gemma-4: "all" or "vision" (among image tokens only)
    bidi = _when_set(c, "use_bidirectional_attention", 'true, false, null, "all" or "vision"',
                     lambda v: v is True or v in ("all", "vision"), boolean=True)
    if bidi is True or bidi == "all":
        raise _feature(c, "use_bidirectional_attention", bidi, attn_ids,
                       "every query also attends to later tokens (not causal)")
    shared = _when_set(c, "num_kv_shared_layers", f"an integer in [0, {n_layers - 1}] (num_hidden_layers={n_layers})",
                       lambda v: _is_int(v, 1, n_layers - 1))
    if shared:
        # modeling_gemma4.Gemma4TextAttention: layers >= num_hidden_layers - num_kv_shared_layers read the KV of the
        # last earlier layer of their type and write none
        raise _feature(c, "num_kv_shared_layers", shared, [i for i in attn_ids if i >= n_layers - shared],
                       "these layers reuse an earlier layer's KV cache and write none, while attn-setup sizes and "
                       "writes a KV cache per attention layer")


def _build(top: _Cfg, source: str) -> ModelSpec:
    archs = top.get("architectures")
    archs = [] if archs is None else archs  # absent or null; any other falsy value (0, "", {}) is refused
    if not isinstance(archs, list) or not all(is_text(a) for a in archs):
        raise top.bad("architectures", archs, "a list of strings", "must be a list of strings")
    c, model_type, own, hf, hfd = _identify(top)
    n_layers = c.integer("num_hidden_layers", required=True)
    _check_lists(_Cfg(c.data.maps[0], c.path) if isinstance(c.data, ChainMap) else c, n_layers, names=own is not None)
    kinds = own.layers(c, n_layers) if own is not None else _hf_types(c, hf, hfd, model_type, n_layers)
    _refuse_unhonoured(c, own, n_layers, kinds)
    hidden, _, heads, kv = _heads(c)
    mla = _mla(c)
    # a v head dim of its own only where the class has the field (MiMoV2FlashConfig); others' models ignore the key
    head_dim, v_dim = _head_dims(c, hidden, heads, mla, allow_v=hf is not None and hf.has_v_field)
    window = c.integer("sliding_window", required=True) if "sliding" in kinds else None
    chunk = c.integer("attention_chunk_size", required=True) if "chunked" in kinds else None
    dtype, dtype_missing = _dtype(c, top)
    scaling = _scaling(c, head_dim, mla)
    uniform = LayerShape(num_heads=heads, num_kv_heads=1 if mla else kv,
                         head_dim_qk=mla.absorbed_qk_dim if mla else head_dim,
                         head_dim_v=mla.absorbed_v_dim if mla else v_dim, scaling=scaling)
    shapes = _shapes(c, hf, hfd, model_type, kinds, uniform, mla)
    sinks = shapes is not None and all(s.has_sinks for s in shapes if s is not None)
    if sinks:
        shapes = _shapes(c, hf, hfd, model_type, kinds, msgspec.structs.replace(uniform, has_sinks=True), mla)
    return ModelSpec(
        model_type=model_type, architectures=list(archs), source=source, hidden_size=hidden,
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, v_head_dim=v_dim, scaling=scaling, layer_types=kinds,
        sliding_window=window,
        logit_softcap=_in_range(c, "attn_logit_softcapping", c.num("attn_logit_softcapping"), SOFTCAP_RANGE,
                                "logits become cap * tanh(logit / cap)"),
        has_attention_sinks=sinks, mla=mla, layer_shapes=shapes,
        is_encoder_decoder=top.flag("is_encoder_decoder") or c.flag("is_encoder_decoder"),
        dtype=dtype, dtype_missing=dtype_missing, rope_theta=_rope_theta(c),
        max_position_embeddings=c.integer("max_position_embeddings", 4096),
        vocab_size=c.integer("vocab_size", 32000), attention_chunk_size=chunk)
