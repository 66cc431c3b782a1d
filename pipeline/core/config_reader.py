"""The typed reader under :func:`pipeline.core.model_spec.load_model_spec`: a config file read with a size cap,
JSON integers too long to be config values kept as :class:`_HugeInt`, and :class:`_Cfg`, one JSON object with its
JSON path whose getters refuse a missing, mistyped, out-of-range or absurd value with a ModelConfigError naming
the key's JSON path. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Mapping

from pipeline.core.errors import ModelConfigError, UsageError
from pipeline.core.spec import CONFIG_REMEDY
from pipeline.core.validation import is_text


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
# RoPE's base, low end exclusive (1e-300 ran, then verification failed blaming the backend). The frequencies
# are theta ** (-2i / d), from 1 down to about 1 / theta: at theta = 1 every pair rotates alike, below 1 they
# exceed a radian per position (1e-20: 1e20 rad, beyond float32's resolution: the rotation is noise); above 1e30
# the lowest ones leave float32/bfloat16's normal range (1.2e-38) as d grows. Published: 100 (DINOv3 and Gemma
# vision towers), 1e4 (Llama-2), 5e5 (Llama-3), 1e6-1e7 (Qwen), ~3.6e9 (Gradient's 1M-context Llama-3).
ROPE_THETA_RANGE = (1.0, 1e30)


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


def _choice(v: Any, names: Mapping[str, str], path: str, flag: str, allowed: str, why: str) -> str:
    """``names[v]`` when ``v`` is one of the string keys; any other JSON value (a list, an object, a
    number) is refused naming ``path``, never looked up (a list or object is not even hashable)."""
    if isinstance(v, str) and v in names:
        return names[v]
    from pipeline.core.validation import nearest_name

    near = nearest_name(v, names) if isinstance(v, str) else None
    raise ModelConfigError(f"{path}={_show(v)} {why}" + (f"; did you mean {near!r}?" if near else ""),
                           flags=[(flag, v)], json_path=path, allowed=[allowed],
                           remedy=(f"set {path} to {near!r} in config.json, or " if near else "") + CONFIG_REMEDY)


def _show(v: Any) -> str:
    """A short JSON rendering of a config value for messages (never fails: huge ints, deep nesting)."""
    try:
        text = json.dumps(v, default=repr, ensure_ascii=True)
    except (ValueError, RecursionError):
        text = f"<a {type(v).__name__} too large to show>"
    return text if len(text) <= 60 else text[:57] + "..."
