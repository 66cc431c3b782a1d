"""Hand-written resolve table: profile × bundled config × flags → expected pair and rules, or the error.

Every row was written by reading the capability records (pipeline/backends/records.py), the
precedence and auto-priority rules (states/resolve.py docstring, backend-rules.md) and
the configs (examples/configs/README.md) — never by running the resolver. Each row cites its rule.

Facts used (from the records): torch_native: every device type, any head dim, q bf16/fp16/fp32,
KV also fp8, MLA/window/softcap/sinks/speculative/TBO/PD-mux, no CUDA graphs. flashinfer:
cuda sm80/86/89/90, head dims 64/128/256 and MLA 576/512, bf16/fp16 q, KV bf16/fp16 (equal to q) or
fp8 e4m3/e5m2 for plain MHA/GQA layers only (no window, softcap, sinks or MLA with fp8),
window/softcap/sinks/graphs/speculative/TBO/PD-mux. fa3: sm90 only, head dim 128, no sinks, no
speculative, no MLA, no fp8. triton: cuda sm80-sm90, head dims 64/96/128/256 and MLA 576/512,
bf16/fp16 (KV equal to q), window/softcap/sinks/graphs/speculative/TBO/PD-mux, packages torch+triton.
Auto priority on cuda: flashinfer > fa3 > triton > torch_native; for an MLA model on sm90 the measured
MLA table (capabilities.MLA_DECODE_US: flashinfer 136 µs < triton 416 µs) puts flashinfer, triton first,
then fa3, torch_native; else torch_native. PD-mux SM table: sm80/86/89/90/100. Models: llama/qwen/qwen3 128 full bf16;
mistral 128 all sliding; gemma-2 256, sliding+full, softcap 50, *float32* (auto: bfloat16, sglang's
Gemma rule); deepseek-v2-lite MLA (absorbed 576/512); gpt-oss 64, sliding+full, sinks; qwen3-next
256, 12 full + 36 linear-attention layers; llama-4-scout 128, 36 chunked (8192) + 12 full;
gemma-3-12b 256, 40 sliding (1024) + 8 full. dtype rule (pipeline/dtypes.py): auto keeps a bf16/fp16
checkpoint, float32 -> bfloat16 for gemma* and the float16-refused types, else float16. These rows
need the triton/flashinfer/fa3 records to be registered: without them the GPU rows fail
(BackendUnknown), they never skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import msgspec
import pytest

from pipeline.cli.plan import plan_report
from pipeline.core.contracts import AttentionArgs, ModelSpec, PoolFacts, SetupRequest
from pipeline.core.errors import BackendUnavailable, BackendUnknown, CapabilityMismatch, ConfigError, ConflictingOptions
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.profiles import PROFILES

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
ALL, NOFI, TORCH, NONE = "torch,triton,flashinfer-python", "torch,triton", "torch", ""
PDMUX_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100")

# Gemma-style: 256-dim local (sliding) layers, 512-dim global (full) layers.
GEMMA_STYLE = dict(model_type="gemma_style", hidden_size=2560, num_hidden_layers=6, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, v_head_dim=256, global_head_dim=512, scaling=256 ** -0.5,
                   layer_types=["sliding"] * 5 + ["full"], sliding_window=1024, dtype="bfloat16",
                   source="gemma-style")
ENC_DEC = dict(model_type="t5_like", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=16, head_dim=64, v_head_dim=64, scaling=0.125, layer_types=["full"] * 4,
               is_encoder_decoder=True, dtype="bfloat16", source="enc-dec")
LLAMA_LIKE = dict(model_type="llama", hidden_size=4096, num_hidden_layers=4, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, v_head_dim=128, scaling=128 ** -0.5, layer_types=["full"] * 4)
CUSTOM = {"gemma-style": GEMMA_STYLE, "enc-dec": ENC_DEC,
          "llama-fp32": dict(LLAMA_LIKE, dtype="float32", source="llama-fp32"),
          "glm4-fp32": dict(LLAMA_LIKE, model_type="glm4", dtype="float32", source="glm4-fp32"),
          "gemma3-fp16": dict(LLAMA_LIKE, model_type="gemma3_text", head_dim=256, v_head_dim=256, scaling=1 / 16,
                              dtype="float16", source="gemma3-fp16"),
          "all-linear": dict(LLAMA_LIKE, layer_types=["linear_attention"] * 4, dtype="bfloat16", source="all-linear")}


@dataclass(frozen=True)
class Row:
    id: str
    rule: str
    profile: str
    config: str
    flags: dict = field(default_factory=dict)
    installed: str = ALL
    draft: bool = False
    draft_config: Optional[str] = None
    pair: Optional[tuple[str, str]] = None
    rules: Optional[tuple[str, str]] = None
    rejected: Optional[tuple[tuple[str, ...], tuple[str, ...]]] = None  # (prefill, decode) backend names
    skips: Optional[tuple[str, ...]] = None     # skip "what"s, npu_lazy_mem left out
    mode: Optional[str] = None
    error: Optional[type] = None
    code: Optional[str] = None
    err_flags: tuple[str, ...] = ()              # flag names the error must carry
    allowed: Optional[tuple[str, ...]] = None    # exact allowed list
    text: tuple[str, ...] = ()                   # substrings of message + remedy
    dtype: Optional[tuple[str, str]] = None      # (resolved dtype, source)
    not_attention: tuple[tuple[str, int], ...] = ()  # (kind, number of layers) no backend serves


def ok(id, rule, profile, config, pair, rules, **kw) -> Row:
    return Row(id=id, rule=rule, profile=profile, config=config, pair=pair, rules=rules, **kw)


def err(id, rule, profile, config, error, **kw) -> Row:
    return Row(id=id, rule=rule, profile=profile, config=config, error=error, **kw)


TN, FI, FA3, TR = "torch_native", "flashinfer", "fa3", "triton"
AA, AUTO, GF, PF, DO = ("auto", "auto"), "auto", "global_flag", "phase_flag", "draft_override"
SPEC = {"speculative_algorithm": "EAGLE"}  # a Llama target: sglang's defaults, 5 steps of top-k 4, 8 draft tokens
CHAIN = {**SPEC, "speculative_num_steps": 3, "speculative_eagle_topk": 1}
TREE = {**SPEC, "speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
A2A = {"moe_a2a_backend": "deepep"}  # an expert-parallel all-to-all: what sglang's TBO needs (or attention DP)

ROWS: list[Row] = [
    # --- auto-selection per device ---------------------------------------------
    ok("cpu-llama", "auto: CPU -> torch_native", "cpu", "llama-3.1-8b", (TN, TN), AA, rejected=((), ()),
       skips=("cuda_graph",), mode="normal"),
    ok("cpu-gemma2", "auto: CPU -> torch_native (softcap+window)", "cpu", "gemma-2-9b", (TN, TN), AA),
    ok("cpu-deepseek", "auto: CPU -> torch_native (MLA)", "cpu", "deepseek-v2-lite", (TN, TN), AA),
    ok("cpu-gptoss", "auto: CPU -> torch_native (sinks)", "cpu", "gpt-oss-20b", (TN, TN), AA),
    ok("h200-llama", "auto: sm90 -> flashinfer when installed", "h200", "llama-3.1-8b", (FI, FI), AA,
       rejected=((), ()), skips=(), mode="normal"),
    ok("h200-llama-nofi", "auto: sm90 -> triton when flashinfer missing (fa3 too)", "h200", "llama-3.1-8b",
       (TR, TR), AA, installed=NOFI, rejected=((FI, FA3), (FI, FA3)), skips=()),
    ok("h100-qwen3", "auto: sm90 -> flashinfer", "h100", "qwen3-8b", (FI, FI), AA),
    ok("a100-llama", "auto: sm80 -> flashinfer", "a100", "llama-3.1-8b", (FI, FI), AA, rejected=((), ())),
    ok("a100-llama-nofi", "auto: sm80 -> triton; fa3 rejected (arch+package)", "a100", "llama-3.1-8b", (TR, TR),
       AA, installed=NOFI, rejected=((FI, FA3), (FI, FA3))),
    ok("l40s-mistral", "auto: sm89 -> flashinfer (sliding window claimed)", "l40s", "mistral-7b-v0.1", (FI, FI), AA),
    ok("l40s-mistral-nofi", "auto: sm89 -> triton", "l40s", "mistral-7b-v0.1", (TR, TR), AA, installed=NOFI),
    ok("b200-llama", "auto: sm100 -> as records allow: only torch_native", "b200", "llama-3.1-8b", (TN, TN), AA,
       rejected=((FI, FA3, TR), (FI, FA3, TR)), skips=("cuda_graph",)),
    ok("rtxpro-qwen25", "auto: sm120 -> torch_native", "rtx-pro-6000", "qwen2.5-7b", (TN, TN), AA,
       rejected=((FI, FA3, TR), (FI, FA3, TR))),
    ok("mi300x-llama", "auto: ROCm gfx942 (sm94) in no CUDA-arch list -> torch_native", "mi300x", "llama-3.1-8b",
       (TN, TN), AA, rejected=((FI, FA3, TR), (FI, FA3, TR))),
    ok("ascend-llama", "auto: npu -> torch_native; CUDA graphs skipped", "ascend-910b", "llama-3.1-8b", (TN, TN), AA,
       rejected=((), ()), skips=("cuda_graph",)),
    ok("h200-gemma2-fp32", "explicit --dtype float32 is outside the GPU q_dtypes -> torch_native", "h200",
       "gemma-2-9b", (TN, TN), AA, flags={"dtype": "float32"}, rejected=((FI, FA3, TR), (FI, FA3, TR)),
       dtype=("float32", "field")),
    ok("h200-gemma2-bf16", "auto: --dtype bfloat16 -> flashinfer (256, softcap, window)", "h200", "gemma-2-9b",
       (FI, FI), AA, flags={"dtype": "bfloat16"}),
    ok("h200-gemma2-bf16-nofi", "auto: triton serves head dim 256 + softcap", "h200", "gemma-2-9b", (TR, TR), AA,
       flags={"dtype": "bfloat16"}, installed=NOFI),
    ok("h200-deepseek", "auto: MLA on sm90 -> the measured fastest, flashinfer (fa3 MLA kernels)", "h200",
       "deepseek-v2-lite", (FI, FI), AA, rejected=((), ()), skips=()),
    ok("h200-deepseek-v3", "auto: DeepSeek-V3 (128 heads, 576/512) -> flashinfer", "h200", "deepseek-v3", (FI, FI),
       AA, rejected=((), ()), skips=()),
    ok("h200-deepseek-nofi", "auto: MLA without flashinfer -> triton, next in the measured MLA order (before fa3)",
       "h200", "deepseek-v2-lite", (TR, TR), AA, installed=NOFI, rejected=((FI,), (FI,)), skips=()),
    ok("a100-deepseek", "auto: MLA on sm80 (no measured table) -> AUTO_PRIORITY: flashinfer (fa2 MLA)", "a100",
       "deepseek-v2-lite", (FI, FI), AA, rejected=((), ())),
    ok("h200-deepseek-fp8", "auto: fp8 KV on MLA layers -> no GPU record serves it -> torch_native", "h200",
       "deepseek-v2-lite", (TN, TN), AA, flags={"kv_cache_dtype": "fp8_e4m3"},
       rejected=((FI, TR, FA3), (FI, TR, FA3)), skips=("cuda_graph",)),
    ok("h200-gptoss", "auto: sinks -> flashinfer claims sinks", "h200", "gpt-oss-20b", (FI, FI), AA),
    ok("h200-gptoss-nofi", "auto: sinks, no flashinfer -> triton (fa3 has no sinks anyway)", "h200", "gpt-oss-20b",
       (TR, TR), AA, installed=NOFI),
    ok("h200-kvfp8", "auto: fp8 KV (e4m3) on GQA layers -> flashinfer (fa2 / CUDA-core kernels)", "h200",
       "llama-3.1-8b", (FI, FI), AA, flags={"kv_cache_dtype": "fp8_e4m3"}, rejected=((), ()), skips=()),
    ok("h200-kvfp8-e5m2", "auto: fp8 KV (e5m2) -> flashinfer", "h200", "qwen3-8b", (FI, FI), AA,
       flags={"kv_cache_dtype": "fp8_e5m2"}, rejected=((), ())),
    ok("h200-kvfp8-window", "auto: fp8 KV with sliding windows -> not flashinfer's fp8 features -> triton (fp8 "
       "in its decode/extend kernels, windows included)", "h200", "mistral-7b-v0.1", (TR, TR), AA,
       flags={"kv_cache_dtype": "fp8_e4m3"}, rejected=((FI, FA3), (FI, FA3))),
    ok("h200-fp16", "auto: float16 is in every GPU record", "h200", "llama-3.1-8b", (FI, FI), AA,
       flags={"dtype": "float16"}),
    ok("h200-page64", "auto: no record limits page sizes", "h200", "llama-3.1-8b", (FI, FI), AA,
       flags={"page_size": 64}),
    ok("a100-spec", "auto: chain speculative is an extend flashinfer serves -> flashinfer", "a100", "llama-3.1-8b",
       (FI, FI), AA, flags=SPEC),
    ok("h200-spec", "auto: speculative on sm90 -> flashinfer (first in priority, claims it)", "h200",
       "llama-3.1-8b", (FI, FI), AA, flags=SPEC),
    ok("h200-spec-nofi", "auto: speculative, flashinfer missing -> fa3 skipped (package + no speculative) -> triton",
       "h200", "llama-3.1-8b", (TR, TR), AA, flags=SPEC, installed=NOFI, rejected=((FI, FA3), (FI, FA3))),
    ok("h200-spec-torchonly", "auto: speculative, only torch installed -> torch_native", "h200", "llama-3.1-8b",
       (TN, TN), AA, flags=SPEC, installed=TORCH, rejected=((FI, FA3, TR), (FI, FA3, TR)), skips=("cuda_graph",)),
    ok("h200-spec-tree", "auto: an EAGLE tree (top-k 4) on sm90 -> flashinfer (custom tree mask)", "h200",
       "llama-3.1-8b", (FI, FI), AA, flags=TREE),
    ok("h200-spec-tree-page16", "auto: a tree with page_size 16 -> flashinfer (sglang: flashinfer/fa3/triton only)",
       "h200", "llama-3.1-8b", (FI, FI), AA, flags={**TREE, "page_size": 16}),
    ok("h200-spec-tree-gemma2", "auto: a tree over sliding-window layers -> flashinfer refused (window) -> triton",
       "h200", "gemma-2-9b", (TR, TR), AA, flags=TREE, rejected=((FI, FA3), (FI, FA3))),
    err("h200-fa3-spec-tree", "explicit: fa3 has no speculative decoding -> refused, tree backends allowed", "h200",
        "llama-3.1-8b", CapabilityMismatch, flags={"attention_backend": FA3, **TREE},
        err_flags=("attention_backend", "speculative_algorithm"), allowed=(FI, TN, TR), text=("speculative",)),
    err("cpu-encdec", "validation: encoder-decoder claimed by no backend", "cpu", "enc-dec", CapabilityMismatch,
        allowed=(), text=("encoder-decoder",)),
    # --- explicit choices: passed or refused, never replaced (§2-3) -------------------
    ok("cpu-tn-global", "precedence: global flag", "cpu", "llama-3.1-8b", (TN, TN), (GF, GF),
       flags={"attention_backend": TN}, rejected=((), ())),
    err("cpu-triton", "explicit: triton has no cpu device -> refused, allowed = working", "cpu", "llama-3.1-8b",
        CapabilityMismatch, flags={"attention_backend": TR}, err_flags=("attention_backend",), allowed=(TN,),
        text=("device type 'cpu'",)),
    err("cpu-flashinfer", "explicit: flashinfer is cuda-only", "cpu", "llama-3.1-8b", CapabilityMismatch,
        flags={"attention_backend": FI}, allowed=(TN,)),
    err("a100-fa3", "explicit: fa3 on sm80 refused with its arches and working backends", "a100", "llama-3.1-8b",
        CapabilityMismatch, flags={"attention_backend": FA3}, err_flags=("attention_backend", "device.arch"),
        allowed=(FI, TN, TR), text=("sm80", "(supports sm90)")),
    err("b200-fa3", "explicit: fa3 on sm100 refused", "b200", "llama-3.1-8b", CapabilityMismatch,
        flags={"attention_backend": FA3}, err_flags=("attention_backend", "device.arch"), allowed=(TN,),
        text=("sm100", "(supports sm90)")),
    ok("h200-fa3", "explicit: fa3 on sm90 passes", "h200", "llama-3.1-8b", (FA3, FA3), (GF, GF),
       flags={"attention_backend": FA3}, skips=()),
    ok("h200-fi-spec", "explicit + speculative: flashinfer claims chain verify", "h200", "llama-3.1-8b",
       (FI, FI), (GF, GF), flags={"attention_backend": FI, **SPEC}),
    err("h200-fa3-spec", "explicit + speculative: fa3 refused naming both options", "h200", "llama-3.1-8b",
        CapabilityMismatch, flags={"attention_backend": FA3, **SPEC},
        err_flags=("attention_backend", "speculative_algorithm"), allowed=(FI, TN, TR), text=("speculative",)),
    ok("h200-triton-spec", "explicit + speculative: triton claims it", "h200", "llama-3.1-8b", (TR, TR), (GF, GF),
       flags={"attention_backend": TR, **SPEC}),
    err("h200-fa3-sinks", "explicit: fa3 lacks attention sinks (both layer kinds named)", "h200", "gpt-oss-20b",
        CapabilityMismatch, flags={"attention_backend": FA3}, err_flags=("sliding.has_sinks", "full.has_sinks"),
        allowed=(FI, TN, TR), text=("attention sinks of sliding layers", "attention sinks of full layers")),
    ok("h200-triton-mla", "explicit: triton claims MLA 576/512 (its absorbed-MLA kernels)", "h200",
       "deepseek-v2-lite", (TR, TR), (GF, GF), flags={"attention_backend": TR}, skips=()),
    err("h200-fa3-mla", "explicit: fa3 serves no MLA", "h200", "deepseek-v3", CapabilityMismatch,
        flags={"attention_backend": FA3}, allowed=(FI, TN, TR), text=("MLA models are not supported",)),
    err("h200-fi-mla-fp8", "explicit: flashinfer + MLA + fp8 KV refused (no scale input in the MLA wrapper)",
        "h200", "deepseek-v2-lite", CapabilityMismatch, flags={"attention_backend": FI, "kv_cache_dtype": "fp8_e4m3"},
        err_flags=("kv_cache_dtype",), allowed=(TN,), text=("fp8_e4m3 is not supported with mla layers",)),
    err("h200-triton-mla-fp8", "explicit: triton has no fp8 KV", "h200", "deepseek-v3", CapabilityMismatch,
        flags={"attention_backend": TR, "kv_cache_dtype": "fp8_e5m2"}, err_flags=("kv_cache_dtype",), allowed=(TN,)),
    err("h200-fi-gemmastyle", "explicit: head dim 512 of full layers refused, naming dim and kind", "h200",
        "gemma-style", CapabilityMismatch, flags={"attention_backend": FI}, err_flags=("full.head_dim_qk",),
        allowed=(TN,), text=("qk head dim 512 of full layers",)),
    err("h200-triton-gemmastyle", "explicit: triton lacks head dim 512 (global layers)", "h200", "gemma-style",
        CapabilityMismatch, flags={"attention_backend": TR}, err_flags=("full.head_dim_qk", "full.head_dim_v"),
        allowed=(TN,), text=("512 of full layers",)),
    ok("h200-gemmastyle-auto", "auto: 512-dim global layers -> torch_native", "h200", "gemma-style", (TN, TN), AA,
       rejected=((FI, FA3, TR), (FI, FA3, TR))),
    ok("h200-fi-fp8", "explicit: flashinfer serves fp8 KV (e5m2) with a bf16 q", "h200", "llama-3.1-8b", (FI, FI),
       (GF, GF), flags={"attention_backend": FI, "kv_cache_dtype": "fp8_e5m2"}, skips=()),
    err("h200-fa3-fp8", "explicit: fa3 with fp8 KV (no compile in FlashInfer 0.6.13, unverified in 0.7.2) -> refused",
        "h200",
        "llama-3.1-8b", CapabilityMismatch, flags={"attention_backend": FA3, "kv_cache_dtype": "fp8_e4m3"},
        err_flags=("kv_cache_dtype",), allowed=(FI, TN, TR), text=("kv_cache_dtype fp8_e4m3 is not supported",)),
    err("h200-fi-fp8-softcap", "explicit: flashinfer + fp8 KV + softcap/window layers refused", "h200", "gemma-2-9b",
        CapabilityMismatch, flags={"attention_backend": FI, "kv_cache_dtype": "fp8_e4m3", "dtype": "bfloat16"},
        err_flags=("kv_cache_dtype",), allowed=(TN, TR),
        text=("with sliding window layers", "with logit softcap layers")),
    ok("cpu-fp8", "explicit-free: fp8 KV on CPU in torch_native", "cpu", "llama-3.1-8b", (TN, TN), AA,
       flags={"kv_cache_dtype": "fp8_e4m3"}),
    err("h200-triton-fp32", "explicit: triton q dtypes are bf16/fp16", "h200", "llama-3.1-8b", CapabilityMismatch,
        flags={"attention_backend": TR, "dtype": "float32"}, err_flags=("dtype",), allowed=(TN,)),
    err("h200-fi-missing", "explicit: package missing -> refused, not replaced", "h200", "llama-3.1-8b",
        CapabilityMismatch, flags={"attention_backend": FI}, installed=NOFI, allowed=(TN, TR),
        text=("flashinfer-python",)),
    # --- --dtype auto as sglang does it; float16 refused as vLLM does ------------
    ok("h100-gemma2-auto", "dtype auto: a float32 Gemma checkpoint runs in bfloat16 (sglang) -> flashinfer", "h100",
       "gemma-2-9b", (FI, FI), AA, rejected=((), ()), dtype=("bfloat16", "auto:float32_to_bfloat16")),
    ok("h200-llama-fp32-auto", "dtype auto: a float32 non-Gemma checkpoint runs in float16 (sglang)", "h200",
       "llama-fp32", (FI, FI), AA, dtype=("float16", "auto:float32_to_float16")),
    ok("h200-glm4-fp32-auto", "dtype auto: float16 is refused for glm4, so float32 -> bfloat16", "h200", "glm4-fp32",
       (FI, FI), AA, dtype=("bfloat16", "auto:float32_to_bfloat16")),
    ok("h200-gemma3-fp16-auto", "dtype auto: a float16 gemma3 checkpoint runs in bfloat16 (vLLM)", "h200",
       "gemma3-fp16", (FI, FI), AA, dtype=("bfloat16", "auto:float16_refused_to_bfloat16")),
    ok("h200-llama-ckpt", "dtype auto: the bfloat16 checkpoint is kept", "h200", "llama-3.1-8b", (FI, FI), AA,
       dtype=("bfloat16", "auto:checkpoint")),
    ok("h200-llama-fp16-field", "dtype: an explicit choice is kept", "h200", "llama-3.1-8b", (FI, FI), AA,
       flags={"dtype": "float16"}, dtype=("float16", "field")),
    err("h200-gemma2-fp16", "dtype: float16 refused for gemma2 (vLLM _FLOAT16_NOT_SUPPORTED_MODELS)", "h200",
        "gemma-2-9b", ConfigError, flags={"dtype": "float16"}, code="dtype_refused", err_flags=("dtype", "model_type"),
        allowed=("bfloat16", "float32", "auto"), text=("'gemma2'", "dtype='bfloat16'")),
    err("cpu-gemma3-half", "dtype: 'half' is float16, refused for gemma3_text", "cpu", "gemma-3-12b-it", ConfigError,
        flags={"dtype": "half"}, code="dtype_refused", err_flags=("dtype",), text=("gemma3_text",)),
    # --- layers that are not softmax attention over the whole context ----------
    ok("h200-qwen3next", "hybrid: the 12 full layers are served; 36 linear-attention layers need no backend", "h200",
       "qwen3-next-80b-a3b-instruct", (FI, FI), AA, rejected=((), ()), not_attention=(("linear_attention", 36),)),
    ok("cpu-qwen3next", "hybrid on CPU -> torch_native", "cpu", "qwen3-next-80b-a3b-instruct", (TN, TN), AA,
       not_attention=(("linear_attention", 36),)),
    ok("h200-llama4", "chunked: flashinfer and fa3 lack chunked_local_attention -> triton", "h200",
       "llama-4-scout-17b-16e-instruct", (TR, TR), AA, rejected=((FI, FA3), (FI, FA3)), skips=()),
    ok("h200-llama4-torchonly", "chunked: triton missing -> torch_native claims it", "h200",
       "llama-4-scout-17b-16e-instruct", (TN, TN), AA, installed=TORCH, rejected=((FI, FA3, TR), (FI, FA3, TR))),
    ok("h200-triton-llama4", "explicit: triton serves chunked local attention", "h200",
       "llama-4-scout-17b-16e-instruct", (TR, TR), (GF, GF), flags={"attention_backend": TR}),
    ok("cpu-llama4", "chunked on CPU -> torch_native", "cpu", "llama-4-scout-17b-16e-instruct", (TN, TN), AA),
    err("h200-fi-llama4", "explicit: flashinfer refused naming the chunked kind, chunk and layer ids", "h200",
        "llama-4-scout-17b-16e-instruct", CapabilityMismatch, flags={"attention_backend": FI},
        err_flags=("attention_backend", "chunked.attention_chunk_size"), allowed=(TN, TR),
        text=("chunked local attention (chunk 8192) of chunked layers", "0..2, 4..6", "attention_backend")),
    err("h200-fa3-llama4-decode", "explicit decode half: fa3 refused for chunked layers", "h200",
        "llama-4-scout-17b-16e-instruct", CapabilityMismatch, flags={"decode_attention_backend": FA3},
        err_flags=("decode_attention_backend",), allowed=(TN, TR), text=("chunked local attention",)),
    ok("h200-gemma3", "per-layer sliding: 40 sliding (1024) + 8 full layers, head dim 256 -> flashinfer", "h200",
       "gemma-3-12b-it", (FI, FI), AA, dtype=("bfloat16", "auto:checkpoint")),
    err("cpu-all-linear", "no attention layer at all: refused naming the layer type and ids", "cpu", "all-linear",
        CapabilityMismatch, code="no_attention_layers", err_flags=("linear_attention.layer_ids",),
        text=("linear_attention layers 0..3 (4)",)),
    # --- precedence per half ---------------------------------------------------
    ok("h200-decode-only", "precedence: only decode flag -> prefill from auto, recorded", "h200", "llama-3.1-8b",
       (FI, TR), (AUTO, PF), flags={"decode_attention_backend": TR}, rejected=((), ()), mode="normal"),
    ok("h200-decode-only-nofi", "precedence: prefill auto records rejected candidates", "h200", "llama-3.1-8b",
       (TR, TR), (AUTO, PF), flags={"decode_attention_backend": TR}, installed=NOFI, rejected=((FI, FA3), ())),
    ok("cpu-decode-only", "precedence: decode flag on cpu, prefill auto", "cpu", "llama-3.1-8b", (TN, TN), (AUTO, PF),
       flags={"decode_attention_backend": TN}),
    ok("h200-prefill-only", "precedence: only prefill flag -> decode from auto", "h200", "llama-3.1-8b", (FA3, FI),
       (PF, AUTO), flags={"prefill_attention_backend": FA3}),
    ok("h200-both-phase", "precedence: both phase flags", "h200", "llama-3.1-8b", (FA3, FI), (PF, PF),
       flags={"prefill_attention_backend": FA3, "decode_attention_backend": FI}),
    ok("h200-phase-over-global", "precedence: phase flag > global flag", "h200", "llama-3.1-8b", (FI, TR), (PF, GF),
       flags={"attention_backend": TR, "prefill_attention_backend": FI}),
    ok("h200-decode-over-global", "precedence: decode phase flag > global flag", "h200", "llama-3.1-8b", (TR, TN),
       (GF, PF), flags={"attention_backend": TR, "decode_attention_backend": TN}, skips=("cuda_graph",)),
    # --- names attn-setup knows but does not implement --------------------------
    err("unknown-name", "registry: unknown name lists registered ones", "h200", "llama-3.1-8b", BackendUnknown,
        flags={"attention_backend": "flashattn9"}, code="backend_unknown", err_flags=("attention_backend",)),
    err("trtllm-mha", "registry: known sglang name -> unavailable, allowed = working here", "h200", "llama-3.1-8b",
        BackendUnavailable, flags={"attention_backend": "trtllm_mha"}, code="backend_unavailable",
        allowed=(FA3, FI, TN, TR), text=("not available in attn-setup",)),
    err("aiter-mi300x", "registry: aiter known, unavailable; torch_native works on ROCm", "mi300x", "llama-3.1-8b",
        BackendUnavailable, flags={"attention_backend": "aiter"}, allowed=(TN,)),
    err("flashmla-decode", "registry: decode flag with a known name", "h200", "deepseek-v2-lite", BackendUnavailable,
        flags={"decode_attention_backend": "flashmla"}, err_flags=("decode_attention_backend",), allowed=(FI, TN, TR)),
    err("ascend-name", "registry: ascend known, unavailable", "ascend-910b", "llama-3.1-8b", BackendUnavailable,
        flags={"attention_backend": "ascend"}, allowed=(TN,)),
    # --- draft worker (§4) -------------------------------------------------------
    ok("draft-override", "precedence: draft override > everything on a draft worker", "h200", "llama-3.1-8b",
       (TR, TR), (DO, DO), flags={**SPEC, "attention_backend": FI, "speculative_draft_attention_backend": TR},
       draft=True),
    ok("draft-inherits", "precedence: draft worker without override inherits the global flag", "h200",
       "llama-3.1-8b", (TR, TR), (GF, GF), flags={**SPEC, "attention_backend": TR}, draft=True),
    ok("target-ignores-draft", "precedence: draft override ignored on the target worker", "h200", "llama-3.1-8b",
       (TR, TR), (GF, GF), flags={**SPEC, "attention_backend": TR, "speculative_draft_attention_backend": TN}),
    err("draft-mla-inherited", "validation: draft model's own shapes vs inherited backend -> draft flag remedy",
        "h200", "llama-3.1-8b", CapabilityMismatch, flags={**CHAIN, "attention_backend": FA3}, draft=True,
        draft_config="deepseek-v2-lite", allowed=(FI, TN, TR), text=("speculative_draft_attention_backend", "MLA")),
    ok("draft-mla-override", "precedence: draft override serves the MLA draft model", "h200", "llama-3.1-8b",
       (TN, TN), (DO, DO), flags={**SPEC, "attention_backend": FA3, "speculative_draft_attention_backend": TN},
       draft=True, draft_config="deepseek-v2-lite"),
    ok("draft-mla-inherits-triton", "draft worker: triton serves the MLA draft model (a chain: top-k 1)",
       "h200", "llama-3.1-8b", (TR, TR), (GF, GF), flags={**CHAIN, "attention_backend": TR}, draft=True,
       draft_config="deepseek-v2-lite"),
    err("draft-mla-tree-from-target", "draft worker: top-k comes from the Llama target (4), not unset "
        "(sglang#36554) -> triton refused for the MLA draft model's tree", "h200", "llama-3.1-8b",
        CapabilityMismatch, flags={**SPEC, "attention_backend": TR}, draft=True, draft_config="deepseek-v2-lite",
        err_flags=("attention_backend", "speculative_eagle_topk"), allowed=(TN,), text=("tree verification", "mla")),
    ok("draft-auto", "auto on a draft worker needs speculative -> flashinfer claims it", "h200", "llama-3.1-8b",
       (FI, FI), AA, flags=SPEC, draft=True),
    ok("draft-tbo", "downgrade: TBO on a draft worker -> normal + skip", "h200", "llama-3.1-8b", (TR, TR), (GF, GF),
       flags={**SPEC, **A2A, "attention_backend": TR, "enable_two_batch_overlap": True}, draft=True,
       mode="normal", skips=("two_batch_overlap",)),
    err("draft-fa3", "validation: draft worker with a backend lacking speculative", "h200", "llama-3.1-8b",
        CapabilityMismatch, flags={"attention_backend": FA3}, draft=True,
        err_flags=("attention_backend", "is_draft_worker"), allowed=(FI, TN, TR)),
    # --- modes -----------------------------------------------------------------
    err("pdmux-tbo", "validation: PD-mux with TBO refused", "h200", "llama-3.1-8b", ConflictingOptions,
        flags={"enable_pdmux": True, "enable_two_batch_overlap": True}, code="conflicting_options",
        err_flags=("enable_pdmux", "enable_two_batch_overlap")),
    err("pdmux-cpu", "validation: PD-mux on CPU refused", "cpu", "llama-3.1-8b", CapabilityMismatch,
        flags={"enable_pdmux": True}, allowed=PDMUX_ARCHS, err_flags=("enable_pdmux",)),
    err("pdmux-sm120", "validation: PD-mux on an arch missing from the SM table lists supported arches",
        "rtx-pro-6000", "llama-3.1-8b", CapabilityMismatch, flags={"enable_pdmux": True}, allowed=PDMUX_ARCHS,
        err_flags=("enable_pdmux", "device.arch"), text=("sm120",)),
    err("pdmux-mi300x", "validation: PD-mux on gfx942 (sm94) refused", "mi300x", "llama-3.1-8b",
        CapabilityMismatch, flags={"enable_pdmux": True}, allowed=PDMUX_ARCHS),
    err("pdmux-npu", "validation: PD-mux on npu refused", "ascend-910b", "llama-3.1-8b", CapabilityMismatch,
        flags={"enable_pdmux": True}, allowed=PDMUX_ARCHS),
    ok("pdmux-h200", "mode: PD-mux on sm90 with flashinfer", "h200", "llama-3.1-8b", (FI, FI), AA,
       flags={"enable_pdmux": True}, mode="pdmux", skips=()),
    ok("pdmux-b200", "mode: PD-mux on sm100 (in the table) with torch_native", "b200", "llama-3.1-8b", (TN, TN), AA,
       flags={"enable_pdmux": True}, mode="pdmux", skips=("cuda_graph",)),
    ok("tbo-h200", "mode: TBO on the target worker (with an EP all-to-all)", "h200", "llama-3.1-8b", (FI, FI), AA,
       flags={"enable_two_batch_overlap": True, **A2A}, mode="tbo", skips=()),
    err("tbo-no-dp", "validation: TBO without attention DP or an EP all-to-all refused (sglang)", "h200",
        "llama-3.1-8b", ConflictingOptions, flags={"enable_two_batch_overlap": True}, code="conflicting_options",
        err_flags=("enable_two_batch_overlap", "attn_dp_size", "moe_a2a_backend")),
    # --- CUDA-graph downgrade ----------------------------------------------------
    ok("graph-off", "downgrade: none when graphs are disabled", "h200", "llama-3.1-8b", (TN, TN), (GF, GF),
       flags={"attention_backend": TN, "disable_cuda_graph": True}, skips=()),
    ok("graph-tn", "downgrade: torch_native decode cannot be captured", "h200", "llama-3.1-8b", (TN, TN), (GF, GF),
       flags={"attention_backend": TN}, skips=("cuda_graph",)),
    ok("graph-hybrid-ok", "downgrade: decode backend decides (flashinfer captures)", "h200", "llama-3.1-8b",
       (TN, FI), (PF, PF), flags={"prefill_attention_backend": TN, "decode_attention_backend": FI}, skips=()),
    ok("graph-hybrid-tn", "downgrade: torch_native decode half -> skip", "h200", "llama-3.1-8b", (FI, TN), (PF, PF),
       flags={"prefill_attention_backend": FI, "decode_attention_backend": TN}, skips=("cuda_graph",)),
    # --- the only capable backend not installed (cases) --------------------------------
    err("softcap-cpu-notorch", "not installed: one error saying so, no advice to use the missing backend", "cpu",
        "gemma-2-9b", CapabilityMismatch, installed=NONE, allowed=(), text=("only torch_native could", "torch")),
    err("softcap-b200-notorch", "not installed: sm100 leaves only torch_native, torch missing", "b200", "gemma-2-9b",
        CapabilityMismatch, installed="triton,flashinfer-python", allowed=(), text=("only torch_native could",)),
    err("softcap-explicit-notorch", "not installed: explicit torch_native without torch", "cpu", "gemma-2-9b",
        CapabilityMismatch, flags={"attention_backend": TN}, installed=NONE, allowed=(),
        err_flags=("attention_backend", "missing_package"), text=("not installed", "install torch")),
]


def _model(name: str) -> ModelSpec:
    if name in CUSTOM:
        return msgspec.convert(CUSTOM[name], ModelSpec)
    return load_model_spec(CONFIGS / f"{name}.json")


def _run(row: Row) -> dict[str, Any]:
    args = AttentionArgs(**row.flags)
    draft = _model(row.draft_config) if row.draft_config else None
    req = SetupRequest(args=args, model=_model(row.config), draft_model=draft, is_draft_worker=row.draft,
                       device="cpu", pool=PoolFacts(page_size=args.page_size, num_token_slots=64 * args.page_size))
    installed = {p: p in row.installed.split(",") for p in ("torch", "triton", "flashinfer-python")}
    return plan_report(req, PROFILES[row.profile], installed)


def test_table_is_large_and_unique():
    """At least 60 rows, unique ids, every row cites a rule."""
    assert len(ROWS) >= 60 and len({r.id for r in ROWS}) == len(ROWS)
    assert all(r.rule for r in ROWS)


@pytest.mark.parametrize("row", [r for r in ROWS if r.error is None], ids=lambda r: r.id)
def test_resolved_rows(row: Row):
    """The pair, rules, rejected candidates, mode and skips are the hand-written ones."""
    out = _run(row)
    res = out["resolved"]
    assert (res["prefill"], res["decode"]) == row.pair, row.rule
    assert (res["rules"]["prefill"], res["rules"]["decode"]) == row.rules, row.rule
    assert res["is_draft_override"] == (row.rules[0] == DO)
    if row.rejected is not None:
        got = tuple(tuple(r["backend"] for r in out["rejected"][h]) for h in ("prefill", "decode"))
        assert got == row.rejected, row.rule
        assert all(r["reasons"] for h in ("prefill", "decode") for r in out["rejected"][h])
    if row.skips is not None:
        assert tuple(s["what"] for s in out["skips"] if s["what"] != "npu_lazy_mem") == row.skips, row.rule
    if row.mode is not None:
        assert out["plan"]["mode"] == row.mode
    assert out["plan"]["hybrid"] == (row.pair[0] != row.pair[1])
    if row.dtype is not None:
        assert (res["dtype"]["value"], res["dtype"]["source"]) == row.dtype, row.rule
    assert tuple((g["kind"], len(g["layer_ids"])) for g in res["not_attention"]) == row.not_attention


@pytest.mark.parametrize("row", [r for r in ROWS if r.error is not None], ids=lambda r: r.id)
def test_refused_rows(row: Row):
    """The error class, code, flags, allowed backends/arches and key words are the hand-written ones."""
    with pytest.raises(row.error) as ei:
        _run(row)
    info = ei.value.info
    assert type(ei.value) is row.error and ei.value.exit_code == 3
    assert info.state == "resolve"
    if row.code:
        assert info.code == row.code
    names = [f.name for f in info.flags]
    for f in row.err_flags:
        assert f in names, (f, names)
    if row.allowed is not None:
        assert sorted(info.allowed) == sorted(row.allowed), row.rule
    blob = info.message + " | " + info.remedy
    for t in row.text:
        assert t in blob, (t, blob)
    assert info.remedy


def test_missing_backend_is_not_advised():
    """When the only capable backend is not installed, neither allowed nor remedy advise using it."""
    row = next(r for r in ROWS if r.id == "softcap-cpu-notorch")
    with pytest.raises(CapabilityMismatch) as ei:
        _run(row)
    info = ei.value.info
    assert info.allowed == [] and "torch_native" not in info.remedy and "install torch" in info.remedy
