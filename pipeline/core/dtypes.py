"""The compute dtype (``dtype`` / ``--dtype``): the explicit choice, or the engines' rule for ``auto``
(docs/internals.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.core.contracts import DtypeChoice
from pipeline.core.errors import ConfigError
from pipeline.core.validation import DTYPE_SPELLINGS

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import AttentionArgs, ModelSpec

__all__ = ["AUTO_RULES", "FLOAT16_REFUSED", "norm_dtype", "resolve_dtype", "model_dtype", "kv_dtype"]

_ALIASES = {a: name for name, spellings in DTYPE_SPELLINGS.items() for a in spellings}  # one set for both flags

# model_type -> why float16 is refused (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS, same reason text).
FLOAT16_REFUSED: dict[str, str] = {
    t: "numerical instability (vLLM's _FLOAT16_NOT_SUPPORTED_MODELS)"
    for t in ("gemma2", "gemma3", "gemma3_text", "plamo2", "glm4")
}

# rule name (the ``auto:<rule>`` source) -> what it does.
AUTO_RULES: dict[str, str] = {
    "checkpoint": "the checkpoint's bfloat16/float16 dtype is kept (sglang, vLLM)",
    "float32_to_bfloat16": "a float32 checkpoint of the Gemma family (or of a model type float16 is refused for) "
                           "is downcast to bfloat16 (sglang _get_and_verify_dtype; vLLM _FLOAT16_NOT_SUPPORTED_MODELS)",
    "float32_to_float16": "a float32 checkpoint is downcast to float16 (sglang _get_and_verify_dtype)",
    "missing_torch_dtype_as_float32_to_bfloat16": "a config without torch_dtype/dtype is read as float32 and, for "
                                                  "the Gemma family (or a model type float16 is refused for), "
                                                  "downcast to bfloat16 (sglang _get_and_verify_dtype)",
    "missing_torch_dtype_as_float32_to_float16": "a config without torch_dtype/dtype is read as float32 and "
                                                 "downcast to float16 (sglang _get_and_verify_dtype)",
    "float16_refused_to_bfloat16": "a float16 checkpoint of a model type float16 is refused for runs in bfloat16 "
                                   "(vLLM _resolve_auto_dtype falls back to its preferred dtype)",
}


def norm_dtype(name: str) -> str:
    """Canonical dtype name (``bf16`` → ``bfloat16``, ``fp16``/``half`` → ``float16`` …)."""
    return _ALIASES.get(name, name)


def _refused(model_type: str) -> bool:
    return model_type in FLOAT16_REFUSED


def _auto(model: "ModelSpec") -> DtypeChoice:
    ckpt, mt = norm_dtype(model.dtype), model.model_type
    if ckpt == "float32":
        prefix = "auto:missing_torch_dtype_as_" if model.dtype_missing else "auto:"
        if mt.startswith("gemma") or _refused(mt):
            return DtypeChoice(value="bfloat16", source=prefix + "float32_to_bfloat16")
        return DtypeChoice(value="float16", source=prefix + "float32_to_float16")
    if ckpt == "float16" and _refused(mt):
        return DtypeChoice(value="bfloat16", source="auto:float16_refused_to_bfloat16")
    return DtypeChoice(value=ckpt, source="auto:checkpoint")


def resolve_dtype(args: "AttentionArgs", model: "ModelSpec") -> DtypeChoice:
    """The compute dtype of ``model`` under ``args.dtype`` (``auto`` or a name) and its rule: a
    :class:`~pipeline.core.contracts.DtypeChoice` (``value`` canonical, ``source`` ``"field"`` or ``"auto:<rule>"``).
    Raises ConfigError (``dtype_refused``, exit 3, state ``resolve``) for an explicit float16 on a model type in
    :data:`FLOAT16_REFUSED`."""
    if args.dtype == "auto":
        return _auto(model)
    value = norm_dtype(args.dtype)
    if value == "float16" and _refused(model.model_type):
        raise ConfigError(
            f"dtype={args.dtype!r} is refused for model_type {model.model_type!r}: "
            f"{FLOAT16_REFUSED[model.model_type]}",
            code="dtype_refused", state="resolve",
            flags=[("dtype", args.dtype), ("model_type", model.model_type)], allowed=["bfloat16", "float32", "auto"],
            remedy="set dtype='bfloat16' (or 'float32'), or leave dtype='auto', which picks bfloat16 for this model")
    return DtypeChoice(value=value, source="field")


def model_dtype(args: "AttentionArgs", model: "ModelSpec") -> str:
    """The compute dtype name: ``args.dtype``, or for ``auto`` the engines' rule (:func:`resolve_dtype`: a float32
    checkpoint becomes bfloat16 for the Gemma family, float16 otherwise). Raises its ConfigError."""
    return resolve_dtype(args, model).value


def kv_dtype(args: "AttentionArgs", model: "ModelSpec") -> str:
    """The KV-cache dtype name: ``kv_cache_dtype`` unless ``auto``, then the compute dtype."""
    return model_dtype(args, model) if args.kv_cache_dtype == "auto" else norm_dtype(args.kv_cache_dtype)
