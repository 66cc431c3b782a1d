"""Capability records of the built-in backends as torch-free data, with their rules, the reference backend, the
auto-selection order and the packages they need (tests/test_capabilities.py checks every claim)."""

from __future__ import annotations

from typing import Any

from pipeline.backends.capability import BackendRules, Capability, decode_output_only
from pipeline.backends.flashinfer.rules import FA3_RULES, FLASHINFER_RULES

MiB = 1 << 20

TORCH_NATIVE = Capability(
    devices=["cpu", "cuda", "musa", "npu", "xpu"],
    archs=None,
    head_dims_qk=None,
    head_dims_v=None,
    q_dtypes=["bfloat16", "float16", "float32"],
    kv_dtypes=["bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2"],
    features=["mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention",
              "speculative", "speculative_tree", "speculative_tree_paged", "tbo", "pdmux"],
    page_sizes=None,
    packages=["torch"],
    workspace_bytes=0,
    source="reference backend: per-request torch SDPA-style math in fp32; no CUDA graphs "
           "(sglang's torch_native also turns them off); no encoder-decoder (its forward is causal "
           "self-attention only); speculative: target verify with the tree mask applied exactly (ancestors "
           "of each draft token, positions prefix + depth), draft extend, draft decode of top-k branches, every "
           "layer kind and page size. Every claim runs in tests/test_capabilities.py",
)

FLASHINFER = Capability(
    devices=["cuda"],
    archs=["sm80", "sm86", "sm89", "sm90"],
    head_dims_qk=[64, 128, 256],
    head_dims_v=[64, 128, 256],
    q_dtypes=["bfloat16", "float16"],
    kv_dtypes=["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"],
    features=["mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "cuda_graph", "speculative",
              "speculative_tree", "speculative_tree_paged", "tbo", "pdmux"],
    page_sizes=None,
    packages=["torch", "flashinfer-python"],
    kv_dtype_matches_q=True,
    mla_head_dims=[[576, 512]],
    fp8_kv_features=["mha"],
    tree_features=["mha", "logit_softcap"],
    workspace_bytes=384 * MiB,
    source="sglang SGLANG_FLASHINFER_WORKSPACE_SIZE default; FlashInfer 0.7.2 (the one supported version, "
           "sglang 0.5.23's pin) wrappers: fa2 prefill, CUDA-core/tensor-core decode, the attention-sink variant "
           "built under our own complete module name (0.7.2's sink wrapper still names it without head dims or KV "
           "dtype), the MLA wrapper's canonical plan(metadata=MLAPlanMetadata.csr(...))/run(query=, kv_cache=). "
           "Verified on an H200 (sm90) only, with 0.6.13 (see benchmarks/RESULTS.md; 0.7.2's run: tests/gpu and "
           "the 0.7.2 tables there). fp8 KV (e4m3/e5m2, per-layer k_scale/v_scale passed to run()) with a "
           "bf16/fp16 q: CUDA-core and tensor-core decode and fa2 paged prefill, all within 6.9e-3 of float64 "
           "over the dequantized stored K/V on the H200 (RESULTS.md, 'fp8 KV and MLA facts'), for plain MHA/GQA "
           "layers only: with windows, softcaps or sinks the fp8 variants were not compiled or verified, nor was fp8 "
           "MLA (0.7.2's MLA wrapper takes e4m3 with per-tensor ckv/kpe scales on sm90 and a bf16 q; not wired "
           "here), so those are refused with fp8 (fp8_kv_features). MLA (absorbed, 576/512 = DeepSeek-V2/V3, Kimi-K2): "
           "flashinfer.mla.BatchMLAPagedAttentionWrapper, backend fa3 on sm90 and fa2 elsewhere, decode and causal "
           "extend, 16 and 128 heads, pages 1/16/64, within 5.4e-3 on the H200. Speculative (sglang's "
           "flashinfer_backend.py): target verify = the paged prefill wrapper with FlashInfer's packed custom mask "
           "(prefix columns set, the tree's ancestor mask after them; the fa2 kernels: fa3 has no custom mask), draft "
           "decode of top-k branches = the decode wrapper over a page-size-1 view of the pool with token-level "
           "indices (prefix then the branch's draft slots: any page size, no prefix-tail copy), both CUDA-graph "
           "captured. Trees only for MHA/GQA layers with or without softcap: FlashInfer's window counts KV indices, "
           "not tree positions, the sink wrapper and the MLA wrapper take no custom mask",
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
    source="sglang SGLANG_FLASHINFER_WORKSPACE_SIZE default; FlashInfer 0.7.2 backend='fa3' (sm90) "
           "prefill kernels for extend and decode; only head dim 128 without window/softcap/sinks was "
           "compiled and verified on the H200 (each fa3 variant is a ~110 s compile; with 0.6.13, see "
           "benchmarks/RESULTS.md). No fp8 KV: backend='fa3' with a bf16 q and an fp8 (e4m3) KV cache failed to "
           "compile in FlashInfer 0.6.13 (ninja build failure on the H200, RESULTS.md 'fp8 KV and MLA facts') and "
           "was not tried with 0.7.2; e5m2 likewise (neither compiled nor verified); use flashinfer (fa2 kernels) "
           "for fp8 KV. No MLA (the MLA wrapper is the flashinfer backend's). No speculative decoding: FlashInfer's "
           "fa3 prefill has no custom mask (its dispatcher falls back to fa2 for one), so target verify of EAGLE "
           "trees is the flashinfer backend's (sglang's fa3 backend is FlashAttention-3 from sgl-kernel, not "
           "FlashInfer's)",
)

TRITON_CAP = Capability(
    devices=["cuda"],
    archs=["sm80", "sm86", "sm89", "sm90"],
    head_dims_qk=[64, 96, 128, 256],
    head_dims_v=[64, 96, 128, 256],
    q_dtypes=["bfloat16", "float16"],
    kv_dtypes=["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"],
    fp8_kv_features=["mha", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention"],
    features=["mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention",
              "cuda_graph", "speculative", "speculative_tree", "speculative_tree_paged", "tbo", "pdmux"],
    page_sizes=None,
    packages=["torch", "triton"],
    kv_dtype_matches_q=True,
    mla_head_dims=[[576, 512]],
    tree_features=["mha", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention"],
    workspace_bytes=0,
    source="pipeline/backends/triton (our kernels): split-K paged decode + LSE merge, paged extend. Verified vs "
           "the float64 reference and torch_native on an H200 (sm90, triton 3.6: D 64/96/128/256, bf16/fp16, "
           "pages 1/16/64, GQA 1/4/8, B 1-256, ctx to 32k, window/softcap/sinks, CUDA-graph replay == eager) and "
           "under TRITON_INTERPRET=1 on CPU (CI). Chunked local attention (Llama-4): verified under the "
           "interpreter in CI; its H200 tests are tests/gpu/test_triton_gpu.py::test_chunked_local_attention*. "
           "sm80/86/89: portable Triton ops and configs sized for 99 KB of shared memory, not run. MLA (absorbed, "
           "576/512): launch_mla.py's paged decode (split-K, a block of heads per latent tile) and extend, verified "
           "under the interpreter in CI (tests/test_triton_mla_interpret.py) and on the H200 "
           "(tests/gpu/test_triton_mla_gpu.py; max rel err 4.0e-3 at 128 heads in benchmarks/mla_decode.py); bf16/fp16 "
           "KV for MLA. fp8 KV (e4m3/e5m2, per-layer k_scale/v_scale from the pool, upcast in registers) in the "
           "decode and extend kernels for MHA/GQA with windows, softcaps, sinks and chunks: H200 grid in "
           "tests/gpu/test_triton_gpu.py (fp8 vs torch_native over the dequantised pool and float64) and the "
           "accepted-config matrix (benchmarks/accepted_matrix.py); no fp8 MLA kernel. No fp32 KV, no encoder-decoder. "
           "Speculative (sglang's triton_backend.py): target verify = the extend kernel with a tree mask (per request "
           "[n, n] ancestor bits; positions prefix + depth for windows and chunks), draft decode of top-k branches = "
           "the decode kernel over a token table (prefix then the branch's draft slots), both CUDA-graph captured "
           "beside decode; trees for MHA/GQA kinds with windows, softcaps, sinks and chunks, not MLA (the MLA extend "
           "kernel has no tree mask)",
)

# Measured MLA decode step per arch (µs; DeepSeek-V3 dims, B=64 x 4096, page 16, graph replay; benchmarks/RESULTS.md
# "MLA decode"): auto-selection tries these first for MLA, fastest first. Re-measure with benchmarks/mla_decode.py.
MLA_DECODE_US: dict[str, dict[str, float]] = {
    "sm90": {"flashinfer": 136.4, "triton": 415.6},
}

# Stage-1 programs per SM of our Triton decode kernels (tests/test_graph_memory.py checks ``launch.DecodeConfig``).
TRITON_PROGRAMS_PER_SM = 8
_MLA_BLOCK_H = 64  # ``launch_mla.MLADecodeConfig.block_h``


def triton_graph_state_allocs(kinds: Any, batch_sizes: Any, *, max_context_len: int, page_size: int,
                              num_sms: int, mode: str = "decode", tokens_per_req: int = 1) -> list[tuple[int, int]]:
    """``[(0, nbytes)]`` of our Triton backend's ``init_cuda_graph_state``: ``req_pool_indices`` [max_bs] int64,
    ``seq_lens`` [max_bs] int32 and fp32 split scratch bounded for every size and kind; speculative modes add their
    buffers (target verify: rows, prefixes, positions, tree masks, indptrs; draft decode: token table, lengths, row ids
    and scratch for ``max_bs * n`` rows)."""
    mb = max(batch_sizes)
    out = [(0, mb * 8), (0, mb * 4), (0, _scratch_rows(kinds, mb, num_sms) * 4)]
    n = tokens_per_req
    if mode == "target_verify":
        out += [(0, mb * 8), (0, mb * 4), (0, mb * n * 8), (0, mb * n * n), (0, (mb + 1) * 4), (0, (mb + 1) * 4)]
    elif mode == "draft_decode":
        rows = mb * n
        out += [(0, rows * max_context_len * 4), (0, rows * 4), (0, rows * 8), (0, _scratch_rows(kinds, rows, num_sms) * 4)]
    return out


def _scratch_rows(kinds: Any, mb: int, num_sms: int) -> int:
    """fp32 elements of the Triton decode split scratch for batches up to ``mb`` rows (see
    :func:`triton_graph_state_allocs`)."""
    rows = 0
    for k in kinds:
        if k.is_mla:
            bs_s = max(mb, 2 * TRITON_PROGRAMS_PER_SM * num_sms // -(-k.num_heads // _MLA_BLOCK_H) + 1)
        else:
            bs_s = max(mb, TRITON_PROGRAMS_PER_SM * max(num_sms, 1) // k.num_kv_heads)
        rows = max(rows, bs_s * k.num_heads * (k.head_dim_v + 1))
    return rows


# name, capability, "module:factory", rules (what the entry decides beyond its record)
BUILTINS: list[tuple[str, Capability, str, BackendRules]] = [
    ("torch_native", TORCH_NATIVE, "pipeline.backends.torch_native:create", BackendRules()),
    ("flashinfer", FLASHINFER, "pipeline.backends.flashinfer.backend:create", FLASHINFER_RULES),
    ("fa3", FA3, "pipeline.backends.flashinfer.backend:create_fa3", FA3_RULES),
    # decode allocates its output [bs, H, Dv] only; the split scratch is init_cuda_graph_state's buffer
    ("triton", TRITON_CAP, "pipeline.backends.triton.backend:create",
     BackendRules(graph_decode_allocs=decode_output_only, graph_state_allocs=triton_graph_state_allocs)),
]

# The reference backend: correct everywhere, slow, no CUDA graphs; auto-selected on an accelerator it warns.
REFERENCE_BACKEND = "torch_native"

# Auto-selection priority per device type (backend-rules.md: sglang's and vLLM's orders), pruned per request by the
# capability records.
AUTO_PRIORITY: dict[str, list[str]] = {
    "cuda": ["flashinfer", "fa3", "triton", "torch_native"],
}
DEFAULT_PRIORITY = ["torch_native"]

# Every package a record lists: distribution → (import name, supported PEP 440 range, as pyproject.toml:
# tests/test_coinstall.py). Outside it resolve refuses ``package_version_unsupported``. FlashInfer 0.7.2 is sglang
# 0.5.23's pin.
PACKAGES: dict[str, tuple[str, str]] = {
    "torch": ("torch", ">=2.11,<2.16"),
    "triton": ("triton", ">=3.6,<3.10"),
    "flashinfer-python": ("flashinfer", "==0.7.2"),
}
