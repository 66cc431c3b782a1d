"""Our reading of a model and our backend against the model's own implementation in transformers.

:func:`check_model` builds the transformers model from a published ``config.json`` with random weights — its layers
cut to the fewest leading ones that hold every attention kind, MLP / vocabulary / experts / hidden size shrunk, the
attention fields (heads, kv heads, head dims, window, chunk, scale inputs, softcap, sinks) untouched — and runs it once
with an attention function registered through ``transformers.AttentionInterface``. For each attention call that
function gets the layer's q, k, v, mask and the kwargs the model passes (``scaling``, ``sliding_window``, ``softcap``,
``s_aux`` …), computes the model's own eager attention (its modeling module's ``eager_attention_forward``) and ours:
the built backend run over a paged KV pool with **our** layer kind's heads, dims, scale, window, chunk, softcap and
sinks (the sink values are the module's). A wrong reading shows as a shape mismatch or an output error.

MLA layers are compared un-absorbed (transformers computes MLA as MHA over nope+rope / v dims): the kind the oracle
runs then has our scale and dims with one kv head per head; the absorbed kernels are checked against float64 by
``attn-setup run``. Results: one :class:`LayerCheck` per attention layer run.
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import msgspec
import torch

from pipeline.backends.base import AttentionLayer
from pipeline.backends.records import REFERENCE_BACKEND
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.core.contracts import ForwardMode, LayerKind, ModelSpec
from pipeline.core.errors import AttnSetupError
from pipeline.core.model_spec import load_model_spec
from pipeline.core.spec import attention_prefix, layers_covering_every_kind
from pipeline.runtime.reference import rel_err

# Shrunk sizes (never attention fields): what only the MLP, MoE and embeddings are sized by.
_SHRINK = {"intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
           "expert_intermediate_size": 32, "vocab_size": 512, "vocab_size_per_layer_input": 512,
           "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "num_experts_per_token": 2, "routed_expert_hidden_size": 32,
           "top_k_experts": 2, "n_group": 1, "topk_group": 1, "moe_latent_size": None,
           # Gated DeltaNet (Qwen3-Next / Qwen3.5) linear-attention layers: not the layers we serve
           "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
           "linear_value_head_dim": 32}
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
_NAME = "attn_setup_oracle"


@dataclass
class LayerCheck:
    """One attention layer: what the model computed vs our kind (``mismatch``: the first field that differs) and
    the relative error of our backend's output vs the model's eager attention (``max|ours-ref| / max|ref|``)."""

    layer_id: int
    kind: str
    seq: int
    rel_err: float
    tol: float
    mismatch: Optional[str] = None

    @property
    def passed(self) -> bool:
        return self.mismatch is None and self.rel_err <= self.tol


def _text(data: Mapping[str, Any]) -> dict[str, Any]:
    return dict(data["text_config"]) if isinstance(data.get("text_config"), Mapping) else dict(data)


def oracle_config(data: Mapping[str, Any], spec: ModelSpec, *, num_attention_layers: int,
                  shrink_hidden: bool = True) -> dict[str, Any]:
    """The text config cut to the layers holding the first ``num_attention_layers`` attention layers, with the
    non-attention sizes shrunk. ``head_dim`` is written out (as the class derives it) before ``hidden_size`` shrinks,
    so the attention shapes stay those of the published model."""
    text = copy.deepcopy(_text(data))
    text.setdefault("model_type", spec.model_type)
    text.pop("quantization_config", None)
    n_old = spec.num_hidden_layers
    n = attention_prefix(spec, num_attention_layers)
    for k, v in list(text.items()):
        if isinstance(v, list) and len(v) == n_old:
            text[k] = v[:n]
    lin = text.get("linear_attn_config")
    if isinstance(lin, Mapping):  # KimiLinearConfig: 1-based layer ids of the KDA and full layers
        lin = {k: [i for i in v if i <= n] if isinstance(v, list) and k.endswith("_layers") else v
               for k, v in lin.items()}
        text["linear_attn_config"] = {**lin, "num_heads": min(2, lin.get("num_heads", 2))}  # KDA heads: not ours
    text["num_hidden_layers"] = n
    for k, v in _SHRINK.items():
        if k in text and text[k] is not None:
            text[k] = min(text[k], v) if v is not None else None
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # token ids inside the shrunk vocabulary (class
        text[k] = 0  # defaults too: Phi3Config's pad_token_id is 32000)
    from transformers.activations import ACT2FN

    if isinstance(text.get("hidden_act"), str) and text["hidden_act"] not in ACT2FN:
        text["hidden_act"] = "silu"  # an MLP activation this transformers lacks (Kimi-K3's "situ"): MLP only
    if shrink_hidden and spec.mla is None and text.get("head_dim") is None:
        text["head_dim"] = spec.head_dim
    if shrink_hidden:  # MLA: hidden_size only feeds q_a_proj / kv_a_proj, the ranks and head dims stay
        text["hidden_size"] = 8 * spec.num_attention_heads
    return text


def _kind_of(spec: ModelSpec) -> dict[int, LayerKind]:
    return {lid: k for k in spec.layer_kinds() for lid in k.layer_ids}


def _unabsorbed(kind: LayerKind, spec: ModelSpec) -> LayerKind:
    """An MLA kind as transformers computes it: MHA with nope+rope qk dims, v dims, one kv head per head."""
    m = spec.mla
    return LayerKind(kind=kind.kind, num_heads=kind.num_heads, num_kv_heads=kind.num_heads,
                     head_dim_qk=m.qk_nope_head_dim + m.qk_rope_head_dim, head_dim_v=m.v_head_dim,
                     scaling=kind.scaling, sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap,
                     has_sinks=kind.has_sinks, layer_ids=kind.layer_ids)


def _mismatch(kind: LayerKind, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kwargs: Mapping[str, Any]) -> Optional[str]:
    """The first field where our kind differs from what the model passes its attention: shapes, sinks, and the
    ``scaling`` / ``sliding_window`` / ``softcap`` kwargs (checked exactly, whatever the prompt length)."""
    scale = kwargs.get("scaling")
    got = {"num_heads": q.shape[1], "num_kv_heads": k.shape[1], "head_dim_qk": q.shape[-1],
           "head_dim_v": v.shape[-1], "has_sinks": getattr(module, "sinks", None) is not None,
           "scaling": q.shape[-1] ** -0.5 if scale is None else float(scale)}
    if "sliding_window" in kwargs:
        got["sliding_window"] = kwargs["sliding_window"]
    if "softcap" in kwargs:
        got["logit_softcap"] = kwargs["softcap"]
    for f, have in got.items():
        ours = getattr(kind, f)
        same = (math.isclose(ours, have, rel_tol=1e-6) if f in ("scaling", "logit_softcap") and None not in (ours, have)
                else ours == have)
        if not same:
            return f"{f}: ours {ours}, the model's {have}"
    return None


def _ours(backend: str, kind: LayerKind, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          sinks: Optional[torch.Tensor], page_size: int = 16) -> torch.Tensor:
    """Our backend over a paged pool, one extend of the whole sequence: q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv]
    → [T, H, Dv]."""
    from pipeline.runtime.spec_check import backend_over

    t, dev = q.shape[0], q.device
    slots = (t // page_size + 2) * page_size
    r2t = ReqToTokenPool(2, slots, dev)
    kv = KVPool(slots, page_size, [(kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v)], q.dtype, dev)
    alloc = PageAllocator(r2t, slots, page_size)
    kind = msgspec.structs.replace(kind, layer_ids=[0])
    be = backend_over(backend, kind, (r2t, kv), device=str(dev), dtype=str(q.dtype)[6:])
    try:
        fb = make_forward_batch(ForwardMode.EXTEND, [0], [t], alloc, kv)
        be.init_forward_metadata(fb)
        layer = AttentionLayer(layer_id=0, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                               head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                               sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap,
                               sinks=None if sinks is None else sinks.float(),
                               attention_chunk_size=kind.attention_chunk_size)
        return be.forward(q.contiguous(), k.contiguous(), v.contiguous(), layer, fb).reshape(t, kind.num_heads,
                                                                                          kind.head_dim_v)
    finally:
        be.close()


def _attention_fn(spec: ModelSpec, backend: str, run_dtype: torch.dtype, out: list[LayerCheck]) -> Any:
    kinds = _kind_of(spec)

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               **kwargs: Any) -> tuple[torch.Tensor, Any]:
        eager = sys.modules[type(module).__module__].eager_attention_forward
        ref, weights = eager(module, query, key, value, attention_mask, **kwargs)
        lid = module.layer_idx
        kind = kinds[lid] if not kinds[lid].is_mla else _unabsorbed(kinds[lid], spec)
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        bad = _mismatch(kind, module, query, key, value, kwargs)
        err = math.inf
        if bad is None:
            sinks = getattr(module, "sinks", None)
            ours = _ours(backend, kind, *(x.to(run_dtype) for x in (q, k, v)),
                         None if sinks is None else sinks.detach())
            err = rel_err(ours, ref[0])
        out.append(LayerCheck(layer_id=lid, kind=kind.kind, seq=q.shape[0], rel_err=err, tol=TOL[run_dtype],
                              mismatch=bad))
        return ref, weights

    return attend


def check_model(src: Any, backend: str = REFERENCE_BACKEND, *, dtype: torch.dtype = torch.float32,
                device: str = "cpu", seq: Optional[int] = None, max_seq: int = 1200, seed: int = 0,
                num_attention_layers: Optional[int] = None, spec: Optional[ModelSpec] = None,
                backend_dtype: Optional[torch.dtype] = None) -> list[LayerCheck]:
    """Run the model's own attention (in ``dtype``) and ``backend`` side by side (see the module text), the backend's
    q, k, v and KV pool in ``backend_dtype`` (default: ``dtype``; Triton and FlashInfer take bfloat16 / float16; the
    tolerance is that dtype's); ``seq``: prompt length
    (default: one past the largest window or chunk, at most ``max_seq``, at least 16); ``spec``: the reading to
    check (default: :func:`load_model_spec` of ``src``). A model whose code ties other sizes to ``hidden_size`` (RoPE
    factor lists, M-RoPE sections) is run again at its published hidden size."""
    import json

    from pipeline.core import hf_config
    from pipeline.core.layer_rules import OWN_FAMILIES

    hf_config.forget_torchless()
    data = json.loads(open(src).read()) if not isinstance(src, Mapping) else src
    spec = spec or load_model_spec(data)
    n_attn = num_attention_layers or layers_covering_every_kind(spec, minimum=1)
    spans = [k.sliding_window or k.attention_chunk_size or 0 for k in spec.layer_kinds()]
    seq = seq or max(16, min(max_seq, max(spans) + 8))
    own = OWN_FAMILIES.get(spec.model_type)
    args = (data, spec, backend, dtype, backend_dtype or dtype, device, seq, seed, n_attn)
    try:
        return _run(*args, True, own and own.reference)
    except AttnSetupError:
        raise
    except Exception:  # noqa: BLE001 - the class or the model code refuses the shrunk hidden size: run it as published
        return _run(*args, False, own and own.reference)


def _run(data: Mapping[str, Any], spec: ModelSpec, backend: str, dtype: torch.dtype, run_dtype: torch.dtype,
         device: str, seq: int, seed: int, n_attn: int, shrink_hidden: bool,
         reference: Optional[str]) -> list[LayerCheck]:
    from transformers import AttentionInterface, AutoModel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from pipeline.core.hf_config import build

    text = oracle_config(data, spec, num_attention_layers=n_attn, shrink_hidden=shrink_hidden)
    if reference:  # an own family: the transformers family whose code computes the same layers
        cfg = build(CONFIG_MAPPING[reference], {k: v for k, v in text.items() if k != "model_type"})
    elif isinstance(data.get("text_config"), Mapping) and data.get("model_type") in CONFIG_MAPPING:  # via its wrapper
        cfg = build(CONFIG_MAPPING[data["model_type"]], {**data, "text_config": text}).get_text_config()
    else:  # a flat config (a flat multimodal one too: its text part)
        cfg = build(CONFIG_MAPPING[text["model_type"]], {k: v for k, v in text.items() if k != "model_type"})
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    results: list[LayerCheck] = []
    AttentionInterface.register(_NAME, _attention_fn(spec, backend, run_dtype, results))
    AttentionMaskInterface.register(_NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # the masks eager attention takes
    torch.manual_seed(seed)
    model = AutoModel.from_config(cfg, attn_implementation=_NAME, dtype=dtype).to(device).eval()
    ids = torch.randint(0, int(text.get("vocab_size", 512)), (1, seq), device=device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    want = [i for i in range(text["num_hidden_layers"]) if i in _kind_of(spec)]
    seen = [r.layer_id for r in results]
    for lid in want:
        if lid not in seen:
            results.append(LayerCheck(layer_id=lid, kind=spec.layer_types[lid], seq=seq, rel_err=math.inf,
                                      tol=TOL[run_dtype], mismatch="the model never called attention on this layer"))
    for lid in seen:
        if lid not in want:
            results.append(LayerCheck(layer_id=lid, kind="?", seq=seq, rel_err=math.inf, tol=TOL[run_dtype],
                                      mismatch="the model attends here; our reading says not attention"))
    return sorted(results, key=lambda r: r.layer_id)
