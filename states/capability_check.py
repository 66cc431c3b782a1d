"""Checks of one backend's capability record against the device, the model and the flags.

``reasons(...)`` returns every reason the backend cannot serve this request (empty = it can),
in the spirit of vLLM's ``validate_configuration``. Pure: no torch, no imports of backends.
"""

from __future__ import annotations

from typing import Mapping

from pipeline.backends.registry import Capability
from pipeline.contracts import AttentionArgs, DeviceFacts, ModelSpec

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}

PACKAGE_OF = {"flashinfer-python": "flashinfer-python", "triton": "triton", "torch": "torch"}


def norm_dtype(name: str) -> str:
    return _DTYPE_ALIASES.get(name, name)


def model_dtype(args: AttentionArgs, model: ModelSpec) -> str:
    """The compute dtype: ``args.dtype`` unless ``auto``, then the model's (float32 stays float32)."""
    return norm_dtype(model.dtype if args.dtype == "auto" else args.dtype)


def kv_dtype(args: AttentionArgs, model: ModelSpec) -> str:
    """The KV-cache dtype: ``kv_cache_dtype`` unless ``auto``, then the compute dtype."""
    return model_dtype(args, model) if args.kv_cache_dtype == "auto" else norm_dtype(args.kv_cache_dtype)


def _layers(ids: list[int]) -> str:
    return f"layers {ids[0]}..{ids[-1]} ({len(ids)})" if len(ids) > 3 else f"layers {ids}"


def model_reasons(cap: Capability, model: ModelSpec) -> list[str]:
    """Reasons from the model's attention layer kinds (head dims, MLA, window, softcap, sinks, enc-dec)."""
    out: list[str] = []
    if model.is_mla and not cap.has("mla"):
        out.append("MLA models are not supported")
    if not model.is_mla and not cap.has("mha"):
        out.append("MHA/GQA (non-MLA) models are not supported; this backend is MLA-only")
    if model.is_encoder_decoder and not cap.has("encoder_decoder"):
        out.append("encoder-decoder (cross attention) is not supported")
    for k in model.layer_kinds():
        where = f"{k.kind} layers ({_layers(k.layer_ids)})"
        if cap.head_dims_qk is not None and k.head_dim_qk not in cap.head_dims_qk:
            out.append(f"qk head dim {k.head_dim_qk} of {where} is not supported (supports {cap.head_dims_qk})")
        if cap.head_dims_v is not None and k.head_dim_v not in cap.head_dims_v:
            out.append(f"v head dim {k.head_dim_v} of {where} is not supported (supports {cap.head_dims_v})")
        if k.sliding_window is not None and not cap.has("sliding_window"):
            out.append(f"sliding window ({k.sliding_window}) of {where} is not supported")
        if k.logit_softcap is not None and not cap.has("logit_softcap"):
            out.append(f"logit softcap ({k.logit_softcap}) of {where} is not supported")
        if k.has_sinks and not cap.has("attention_sinks"):
            out.append(f"attention sinks of {where} are not supported")
    return list(dict.fromkeys(out))


def reasons(cap: Capability, *, args: AttentionArgs, model: ModelSpec, device: DeviceFacts,
            installed: Mapping[str, bool], is_draft_worker: bool) -> list[str]:
    """Every reason ``cap`` cannot serve this request; empty when it can."""
    out: list[str] = []
    if device.type not in cap.devices:
        out.append(f"device type {device.type!r} is not supported (supports {cap.devices})")
    elif cap.archs is not None and device.arch not in cap.archs:
        out.append(f"arch {device.arch} is not supported (supports {cap.archs})")
    for pkg in cap.packages:
        if not installed.get(pkg, False):
            out.append(f"package {pkg!r} is not installed (pip install 'attn-setup[cuda]')")
    out += model_reasons(cap, model)
    qd, kd = model_dtype(args, model), kv_dtype(args, model)
    if qd not in cap.q_dtypes:
        out.append(f"dtype {qd} is not supported (supports {cap.q_dtypes})")
    if kd not in cap.kv_dtypes:
        out.append(f"kv_cache_dtype {kd} is not supported (supports {cap.kv_dtypes})")
    if cap.page_sizes is not None and args.page_size not in cap.page_sizes:
        out.append(f"page_size {args.page_size} is not supported (supports {cap.page_sizes})")
    if (args.speculative_algorithm or is_draft_worker) and not cap.has("speculative"):
        out.append("speculative decoding is not supported")
    if args.enable_two_batch_overlap and not is_draft_worker and not cap.has("tbo"):
        out.append("two-batch overlap is not supported")
    if args.enable_pdmux and not cap.has("pdmux"):
        out.append("PD-multiplexing is not supported")
    return out
