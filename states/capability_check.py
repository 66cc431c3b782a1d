"""Checks of one backend's capability record against the device, the model and the flags.

Details: docs/internals.md, ``states.capability_check``.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

from pipeline.backends import packages
from pipeline.backends.capability import MODEL_FEATURES, Capability

from pipeline.core.contracts import AttentionArgs, DeviceFacts, ModelSpec, SpeculativeParams
from pipeline.core.speculative import chain_fix, decide_speculative
from pipeline.core.dtypes import kv_dtype, model_dtype
from pipeline.core.model_spec import format_layer_ids

PACKAGE_REASON_PREFIX = "package "
UNSUPPORTED_FLAG = "unsupported_package"


class Reason(NamedTuple):
    """One reason a backend cannot serve a request: the text, the request flags it concerns and, where one field
    change removes it, that change (``fix``: ``(field, value)`` pairs of ``AttentionArgs``, e.g.
    ``(("speculative_eagle_topk", 1),)``). :class:`states.remedies.Remedies` offers a backend's fixes as the remedy
    only after trying them on the whole request."""

    text: str
    flags: tuple[tuple[str, Any], ...] = ()
    fix: tuple[tuple[str, Any], ...] = ()

    @property
    def is_package(self) -> bool:
        """True for a "package X is not installed" or "package X is at an unsupported version" reason (installing a
        supported version would remove the reason)."""
        return self.text.startswith(PACKAGE_REASON_PREFIX)

    @property
    def is_version(self) -> bool:
        """True for a "package X is at a version attn-setup does not support" reason
        (``package_version_unsupported``)."""
        return bool(self.flags) and self.flags[0][0] == UNSUPPORTED_FLAG


def _list(values: Any) -> str:
    """``a, b, c`` for a message (never a Python list repr)."""
    return ", ".join(str(v) for v in values)


def _layers(ids: list[int]) -> str:
    return f"layers {format_layer_ids(ids)}"


def _model_flag(model: ModelSpec) -> tuple[str, Any]:
    return ("model", model.source or model.model_type)


def model_features(model: ModelSpec) -> list[str]:
    """The model features (:data:`~pipeline.backends.capability.MODEL_FEATURES`) the model's attention layers use."""
    kinds = model.layer_kinds()
    used = {"mla" if model.is_mla else "mha"}
    used |= {"sliding_window" for k in kinds if k.sliding_window is not None}
    used |= {"logit_softcap" for k in kinds if k.logit_softcap is not None}
    used |= {"attention_sinks" for k in kinds if k.has_sinks}
    used |= {"chunked_local_attention" for k in kinds if k.attention_chunk_size is not None}
    used |= {"encoder_decoder"} if model.is_encoder_decoder else set()
    return [f for f in MODEL_FEATURES if f in used]


def model_reasons_with_flags(cap: Capability, model: ModelSpec) -> list[Reason]:
    """Reasons from the model's attention layer kinds (head dims, MLA, window, softcap, sinks, enc-dec)."""
    out: list[Reason] = []
    mf = _model_flag(model)
    if model.is_mla and not cap.has("mla"):
        out.append(Reason("MLA models are not supported", (mf,)))
    if not model.is_mla and not cap.has("mha"):
        out.append(Reason("MHA/GQA (non-MLA) models are not supported; this backend is MLA-only", (mf,)))
    if model.is_encoder_decoder and not cap.has("encoder_decoder"):
        out.append(Reason("encoder-decoder (cross attention) is not supported", (mf,)))
    lay = model.shard
    off, stage = (lay.layer_range[0], f" of pipeline stage {lay.pp_rank}") if lay and lay.pp_size > 1 else (0, "")
    for k in model.layer_kinds():
        where = f"{k.kind} layers ({_layers([i + off for i in k.layer_ids])}{stage})"
        if k.is_mla and cap.mla_head_dims is not None:
            if [k.head_dim_qk, k.head_dim_v] not in cap.mla_head_dims:
                out.append(Reason(f"MLA head dims {k.head_dim_qk}/{k.head_dim_v} (qk/v, absorbed) of {where} are not "
                                  f"supported (supports {_list(f'{a}/{b}' for a, b in cap.mla_head_dims)})",
                                  (mf, (f"{k.kind}.head_dim_qk", k.head_dim_qk),
                                   (f"{k.kind}.head_dim_v", k.head_dim_v))))
        elif cap.head_dims_qk is not None and k.head_dim_qk not in cap.head_dims_qk:
            out.append(Reason(f"qk head dim {k.head_dim_qk} of {where} is not supported "
                              f"(supports {_list(cap.head_dims_qk)})", (mf, (f"{k.kind}.head_dim_qk", k.head_dim_qk))))
        if not (k.is_mla and cap.mla_head_dims is not None) and cap.head_dims_v is not None \
                and k.head_dim_v not in cap.head_dims_v:
            out.append(Reason(f"v head dim {k.head_dim_v} of {where} is not supported "
                              f"(supports {_list(cap.head_dims_v)})", (mf, (f"{k.kind}.head_dim_v", k.head_dim_v))))
        if k.sliding_window is not None and not cap.has("sliding_window"):
            out.append(Reason(f"sliding window ({k.sliding_window}) of {where} is not supported",
                              (mf, (f"{k.kind}.sliding_window", k.sliding_window))))
        if k.logit_softcap is not None and not cap.has("logit_softcap"):
            out.append(Reason(f"logit softcap ({k.logit_softcap}) of {where} is not supported",
                              (mf, (f"{k.kind}.logit_softcap", k.logit_softcap))))
        if k.has_sinks and not cap.has("attention_sinks"):
            out.append(Reason(f"attention sinks of {where} are not supported", (mf, (f"{k.kind}.has_sinks", True))))
        if k.attention_chunk_size is not None and not cap.has("chunked_local_attention"):
            out.append(Reason(f"chunked local attention (chunk {k.attention_chunk_size}) of {where} is not supported",
                              (mf, (f"{k.kind}.attention_chunk_size", k.attention_chunk_size))))
    return list(dict.fromkeys(out))


def model_reasons(cap: Capability, model: ModelSpec) -> list[str]:
    """:func:`model_reasons_with_flags` as plain strings."""
    return [r.text for r in model_reasons_with_flags(cap, model)]


def _device_reasons(cap: Capability, device: DeviceFacts, installed: Mapping[str, bool]) -> list[Reason]:
    out: list[Reason] = []
    if device.type not in cap.devices:
        out.append(Reason(f"device type {device.type!r} is not supported (supports {_list(cap.devices)})",
                          (("device", device.type),)))
    elif cap.archs is not None and device.arch not in cap.archs:
        out.append(Reason(f"arch {device.arch} is not supported (supports {_list(cap.archs)})",
                          (("device.arch", device.arch),)))
    for pkg in cap.packages:
        have = installed.get(pkg, False)
        if not have:
            out.append(Reason(f"{PACKAGE_REASON_PREFIX}{pkg!r} is not installed ({packages.install_hint(pkg)})",
                              (("missing_package", pkg),)))
        elif (version := packages.unsupported(pkg, have)) is not None:
            out.append(version_reason(pkg, version))
    return out


def version_reason(pkg: str, version: str) -> Reason:
    """The reason a backend needing ``pkg`` cannot serve when ``version`` of it is installed, outside the range
    attn-setup supports: names both versions and the pip command that installs a supported one."""
    want = packages.requirement(pkg)
    return Reason(f"{PACKAGE_REASON_PREFIX}{pkg!r} is {version}, a version attn-setup does not support (it supports "
                  f"{want}: {packages.install_hint(pkg)})",
                  ((UNSUPPORTED_FLAG, pkg), ("installed_version", f"{pkg} {version}"), ("supported_versions", want)))


def _kv_auto(args: AttentionArgs) -> tuple[tuple[str, Any], ...]:
    """The fix of a KV-cache dtype reason: ``kv_cache_dtype='auto'`` (the model dtype), unless it already is."""
    return () if args.kv_cache_dtype == "auto" else (("kv_cache_dtype", "auto"),)


def _speculative_reasons(cap: Capability, args: AttentionArgs, model: ModelSpec, is_draft_worker: bool,
                         spec: Optional[SpeculativeParams]) -> list[Reason]:
    """Speculative decoding (a draft worker or ``speculative_algorithm``), EAGLE trees (top-k > 1, of ``spec``, the
    settled shape — never the unset flag, the fault of sglang#36554, where a draft worker chose its backend before
    top-k was filled in), trees at ``page_size > 1`` (sglang: flashinfer, fa3 and triton only) and the model features
    a backend serves under a tree (``tree_features``)."""
    if not (args.speculative_algorithm or is_draft_worker):
        return []
    flags: tuple[tuple[str, Any], ...] = tuple(
        f for f in (("speculative_algorithm", args.speculative_algorithm),
                    ("is_draft_worker", True) if is_draft_worker else None) if f and f[1] is not None)
    if not cap.has("speculative"):
        return [Reason("speculative decoding is not supported", flags)]
    if spec is None or not spec.is_tree:
        return []
    topk = (("speculative_eagle_topk", spec.topk),)
    fix = chain_fix(args, spec)
    if not cap.has("speculative_tree"):
        return [Reason(f"tree verification (speculative_eagle_topk={spec.topk} > 1, a custom tree mask) is not "
                       "supported", topk, fix)]
    out = []
    if args.page_size > 1 and not cap.has("speculative_tree_paged"):
        out.append(Reason(f"speculative_eagle_topk={spec.topk} > 1 with page_size {args.page_size} > 1 is not supported",
                          topk + (("page_size", args.page_size),), (("page_size", 1),)))
    if cap.tree_features is not None:
        for f in model_features(model):
            if f not in cap.tree_features and cap.has(f):
                out.append(Reason(f"tree verification (speculative_eagle_topk={spec.topk} > 1) is not supported with "
                                  f"{f.replace('_', ' ')} layers (trees are served with {_list(cap.tree_features)} "
                                  "layers only)", topk + (_model_flag(model),), fix))
    return out


def _flag_reasons(cap: Capability, args: AttentionArgs, model: ModelSpec, is_draft_worker: bool,
                  spec: Optional[SpeculativeParams] = None) -> list[Reason]:
    out: list[Reason] = []
    qd, kd = model_dtype(args, model), kv_dtype(args, model)
    if qd not in cap.q_dtypes:
        out.append(Reason(f"dtype {qd} is not supported (supports {_list(cap.q_dtypes)})", (("dtype", qd),)))
    if kd not in cap.kv_dtypes:
        out.append(Reason(f"kv_cache_dtype {kd} is not supported (supports {_list(cap.kv_dtypes)})",
                          (("kv_cache_dtype", kd),), _kv_auto(args)))
    elif kd.startswith("fp8") and cap.fp8_kv_features is not None:
        for f in model_features(model):
            if f not in cap.fp8_kv_features and cap.has(f):
                out.append(Reason(f"kv_cache_dtype {kd} is not supported with {f.replace('_', ' ')} layers (an fp8 KV "
                                  f"cache is served with {_list(cap.fp8_kv_features)} layers only)",
                                  (("kv_cache_dtype", kd), _model_flag(model)), _kv_auto(args)))
    if cap.kv_dtype_matches_q and kd != qd and not kd.startswith("fp8") and kd in cap.kv_dtypes \
            and qd in cap.q_dtypes:
        out.append(Reason(f"kv_cache_dtype {kd} differs from dtype {qd}; this backend needs them equal",
                          (("kv_cache_dtype", kd), ("dtype", qd)), _kv_auto(args)))
    if cap.page_sizes is not None and args.page_size not in cap.page_sizes:
        out.append(Reason(f"page_size {args.page_size} is not supported (supports {_list(cap.page_sizes)})",
                          (("page_size", args.page_size),)))
    out += _speculative_reasons(cap, args, model, is_draft_worker, spec)
    if args.enable_two_batch_overlap and not is_draft_worker and not cap.has("tbo"):
        out.append(Reason("two-batch overlap is not supported", (("enable_two_batch_overlap", True),),
                          (("enable_two_batch_overlap", False),)))
    if args.enable_pdmux and not cap.has("pdmux"):
        out.append(Reason("PD-multiplexing is not supported", (("enable_pdmux", True),), (("enable_pdmux", False),)))
    return out


def reasons_with_flags(cap: Capability, *, args: AttentionArgs, model: ModelSpec, device: DeviceFacts,
                       installed: Mapping[str, bool], is_draft_worker: bool,
                       spec: Optional[SpeculativeParams] = None) -> list[Reason]:
    """Every reason ``cap`` cannot serve this request (empty when it can), with the flags involved.

    Parameters
    ----------
    cap : the backend's capability record.
    args, model, device : the request's attention flags, the served model, the device facts.
    installed : distribution name (``torch``, ``triton``, ``flashinfer-python``) → presence
        (:data:`pipeline.backends.packages.Presence`: False, True, or the installed version, checked against the
        supported range).
    is_draft_worker : a speculative-decoding draft worker (implies speculative support is needed;
        TBO is not required there because build-mode downgrades it, as sglang does).
    spec : the settled speculative shape (:func:`pipeline.core.speculative.decide_speculative`, from the *target*
        model); None with ``speculative_algorithm`` set: settled here from ``model``.
    """
    if spec is None and args.speculative_algorithm is not None:
        spec = decide_speculative(args, model)
    return (_device_reasons(cap, device, installed) + model_reasons_with_flags(cap, model)
            + _flag_reasons(cap, args, model, is_draft_worker, spec))


def reasons(cap: Capability, *, args: AttentionArgs, model: ModelSpec, device: DeviceFacts,
            installed: Mapping[str, bool], is_draft_worker: bool,
            spec: Optional[SpeculativeParams] = None) -> list[str]:
    """Every reason ``cap`` cannot serve this request, as strings; empty when it can."""
    return [r.text for r in reasons_with_flags(cap, args=args, model=model, device=device, installed=installed,
                                               is_draft_worker=is_draft_worker, spec=spec)]
