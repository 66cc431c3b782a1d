"""Capability records of the built-in backends, as data, with each one's rules, the reference backend, the
auto-selection order and the packages they need.

They live in one torch-free module (instead of inside each backend module) so that resolve and
``attn-setup plan`` can read them without importing torch, triton or flashinfer; each record names
its factory, which sits in the backend's own module. ``tests/test_capabilities.py`` runs a real case
for every claim and checks resolve refuses everything unclaimed.
"""

from __future__ import annotations

from pipeline.backends.capability import BackendRules, Capability
from pipeline.backends.flashinfer_rules import FA3_RULES, FLASHINFER_RULES

MiB = 1 << 20

TORCH_NATIVE = Capability(
    devices=["cpu", "cuda", "musa", "npu", "xpu", "mps"],
    archs=None,
    head_dims_qk=None,
    head_dims_v=None,
    q_dtypes=["bfloat16", "float16", "float32"],
    kv_dtypes=["bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"],
    features=["mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention",
              "speculative", "tbo", "pdmux"],
    page_sizes=None,
    packages=["torch"],
    workspace_bytes=0,
    source="reference backend: per-request torch SDPA-style math in fp32; no CUDA graphs "
           "(sglang's torch_native also turns them off); no encoder-decoder (its forward is causal "
           "self-attention only); speculative = draft decode + chain (topk 1) target verify as extend. "
           "Every claim runs in tests/test_capabilities.py",
)

FLASHINFER = Capability(
    devices=["cuda"],
    archs=["sm80", "sm86", "sm89", "sm90"],
    head_dims_qk=[64, 128, 256],
    head_dims_v=[64, 128, 256],
    q_dtypes=["bfloat16", "float16"],
    kv_dtypes=["bfloat16", "float16"],
    features=["mha", "sliding_window", "logit_softcap", "attention_sinks", "cuda_graph", "speculative", "tbo",
              "pdmux"],
    page_sizes=None,
    packages=["torch", "flashinfer-python"],
    kv_dtype_matches_q=True,
    workspace_bytes=384 * MiB,
    source="sglang SGLANG_FLASHINFER_WORKSPACE_SIZE default; FlashInfer 0.6.13 wrappers (fa2 prefill, "
           "CUDA-core/tensor-core decode, attention-sink wrapper), verified on an H200 (sm90) only: "
           "see benchmarks/RESULTS.md",
)

FA3 = Capability(
    devices=["cuda"],
    archs=["sm90"],
    head_dims_qk=[128],
    head_dims_v=[128],
    q_dtypes=["bfloat16", "float16"],
    kv_dtypes=["bfloat16", "float16"],
    features=["mha", "cuda_graph", "tbo", "pdmux"],
    page_sizes=None,
    packages=["torch", "flashinfer-python"],
    kv_dtype_matches_q=True,
    workspace_bytes=384 * MiB,
    source="sglang SGLANG_FLASHINFER_WORKSPACE_SIZE default; FlashInfer 0.6.13 backend='fa3' (sm90) "
           "prefill kernels for extend and decode; only head dim 128 without window/softcap/sinks was "
           "compiled and verified on the H200 (each fa3 variant is a ~110 s compile): see benchmarks/RESULTS.md",
)

TRITON_CAP = Capability(
    devices=["cuda"],
    archs=["sm80", "sm86", "sm89", "sm90"],
    head_dims_qk=[64, 96, 128, 256],
    head_dims_v=[64, 96, 128, 256],
    q_dtypes=["bfloat16", "float16"],
    kv_dtypes=["bfloat16", "float16"],
    features=["mha", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention", "cuda_graph",
              "speculative", "tbo", "pdmux"],
    page_sizes=None,
    packages=["torch", "triton"],
    kv_dtype_matches_q=True,
    workspace_bytes=0,
    source="pipeline/backends/triton (our kernels): split-K paged decode + LSE merge, paged extend. Verified vs "
           "the float64 reference and torch_native on an H200 (sm90, triton 3.6: D 64/96/128/256, bf16/fp16, "
           "pages 1/16/64, GQA 1/4/8, B 1-256, ctx to 32k, window/softcap/sinks, CUDA-graph replay == eager) and "
           "under TRITON_INTERPRET=1 on CPU (CI). Chunked local attention (Llama-4): verified under the "
           "interpreter in CI; its H200 tests are tests/gpu/test_triton_gpu.py::test_chunked_local_attention*. "
           "sm80/86/89: portable Triton ops and configs sized for 99 KB of shared memory, not run. No MLA (D != Dv), no fp8/fp32, no encoder-decoder. Speculative: draft "
           "decode and chain (top-k 1) target verify as causal extend; tree verify (top-k > 1) would need a custom "
           "mask the extend kernel lacks. Only decode is graph-captured (as in sglang)",
)

# name, capability, "module:factory", rules (what the entry decides beyond its record)
BUILTINS: list[tuple[str, Capability, str, BackendRules]] = [
    ("torch_native", TORCH_NATIVE, "pipeline.backends.torch_native:create", BackendRules()),
    ("flashinfer", FLASHINFER, "pipeline.backends.flashinfer:create", FLASHINFER_RULES),
    ("fa3", FA3, "pipeline.backends.flashinfer:create_fa3", FA3_RULES),
    ("triton", TRITON_CAP, "pipeline.backends.triton.backend:create", BackendRules()),
]

# The reference backend: correct everywhere, slow, no CUDA graphs. Landing on it by auto-selection on an
# accelerator is a warning (refused under strict); choosing it explicitly is not.
REFERENCE_BACKEND = "torch_native"

# Auto-selection priority per device type (backend-rules.md: sglang prefers fa3/flashinfer on NVIDIA, then
# triton; vLLM SM 8-9: FLASH_ATTN > FLASHINFER > TRITON). The capability records prune the list per request:
# on sm80-sm90 flashinfer when installed, else triton; fa3 (sm90 only) is considered after flashinfer so an
# arch it lacks is recorded as its reason; sm100+/ROCm fall to what the records allow.
AUTO_PRIORITY: dict[str, list[str]] = {
    "cuda": ["flashinfer", "fa3", "triton", "torch_native"],
}
DEFAULT_PRIORITY = ["torch_native"]

# Every package a record lists: distribution → (import name, how to install it).
PACKAGES: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install torch"),
    "triton": ("triton", "pip install 'attn-setup[cuda]'"),
    "flashinfer-python": ("flashinfer", "pip install 'attn-setup[cuda]'"),
}
