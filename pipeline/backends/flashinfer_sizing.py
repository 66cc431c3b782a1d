"""FlashInfer workspace sizing and kernel-choice rules, as pure arithmetic (no torch).

FlashInfer's ``plan()`` carves its split-KV scratch (partial outputs ``tmp_v`` and partial
log-sum-exps ``tmp_s``, both float32) out of the caller-owned *float* workspace buffer and fails
with "Out of workspace memory" when it does not fit. The amount depends only on the head shape,
the SM count and — under CUDA-graph capture — the captured batch size, so the bytes a backend
can ever need are known at build time. build-mode calls :func:`workspace_need` and
:func:`pipeline.backends.flashinfer_workspace_check.check_workspace_size` to refuse a too-small
``flashinfer_workspace_size`` before anything is allocated, instead of failing later during graph capture (a reported sglang pain point).

The formulas mirror FlashInfer 0.7.2's scheduler (``include/flashinfer/attention/scheduler.cuh``):

- CUDA-core decode (``DecodePlan``): KV is split only while ``batch * num_kv_heads`` is below the
  grid the kernel fills (``blocks_per_sm * num_sms``), so at most ``grid / num_kv_heads`` split
  rows exist; we bound ``blocks_per_sm`` by 16 (>= 128 threads per CTA, 2048 threads per SM).
  Bytes: ``H * rows * (Dv + 1) * 4``.
- FA2 prefill / tensor-core decode (``PrefillPlan``): eager plans split into at most
  ``2 * num_sms // num_kv_heads`` work tiles of ``cta_tile_q`` packed (row, head) rows; a CUDA-graph plan pads to
  ``max(that, ceil(bs * G / cta_tile_q) + bs - 1)`` tiles. 0.7.2 sizes the partial outputs per query row, not
  per packed row: ``ceil(tiles * cta_tile_q / G)`` rows (0.6.13 reserved ``tiles * cta_tile_q``, G times more).
  Bytes: ``H * rows * (Dv + 1) * 4``.
- FA3 (``PrefillSM90Plan``) keeps no float scratch.
- MLA (``MLAPlan``, shared by the fa2 and fa3 MLA wrappers): partial outputs in the output dtype
  (2 bytes) and float32 partial LSEs for ``2 * num_clusters * cluster_tile_q`` rows, where
  ``num_clusters * cluster_tile_q`` is ``num_sms * 64`` (one 64-row CTA per cluster) or
  ``(num_sms // 2) * 128`` (two-CTA clusters) — at most ``64 * num_sms`` — whatever the batch:
  ``2 * 64 * num_sms * (2 * Dv + 4)`` bytes (17.4 MB for 132 SMs and Dv 512).

Every allocation is 16-byte aligned; we add 16 bytes per buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


MiB = 1 << 20
DEFAULT_WORKSPACE_BYTES = 384 * MiB
DEFAULT_WORKSPACE_SOURCE = "sglang SGLANG_FLASHINFER_WORKSPACE_SIZE default"
FLOAT_BYTES = 4
ALIGN_BYTES = 16
MAX_DECODE_BLOCKS_PER_SM = 16
PREFILL_CTAS_PER_SM = 2
MLA_CTA_TILE_Q = 64
MLA_OUT_BYTES = 2  # FlashInfer's MLAPlan sizes partial outputs for a 16-bit output dtype

# Tensor-core (prefill-kernel) decode pays once the GQA group and the batch are both large
# enough; measured on the H200 (see benchmarks/RESULTS.md, "FlashInfer backends").
TENSOR_CORE_MIN_GROUP = 4
TENSOR_CORE_MIN_BATCH = 8
TENSOR_CORE_ALWAYS_GROUP = 8
# GQA group sizes we decode on FlashInfer's CUDA-core kernel. It is compiled for 1, 2, 3, 4, 8 (0.6.13) and also 6
# and 16 (0.7.2: ``DISPATCH_GQA_GROUP_SIZE`` in include/flashinfer/utils.cuh); any other group ("Unsupported
# group_size: 7" for Qwen2.5-7B's 28 q / 4 kv heads) must decode on the tensor-core (prefill) kernel, which takes
# any group. 16 would take tensor cores anyway (>= TENSOR_CORE_ALWAYS_GROUP); 6 stays on tensor cores until the
# CUDA-core kernel is measured and verified for it.
CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 8})


@dataclass(frozen=True)
class HeadShape:
    """One layer kind's attention heads: q heads ``H``, kv heads ``Hkv``, v head dim ``Dv``.

    ``sinks``: the kind has attention sinks, so its decode also runs the prefill kernel.
    ``mla``: an absorbed-MLA kind, served by FlashInfer's MLA wrapper for decode and extend.
    """

    num_qo_heads: int
    num_kv_heads: int
    head_dim_vo: int
    sinks: bool = False
    mla: bool = False

    @property
    def group(self) -> int:
        """GQA group size ``H // Hkv``."""
        return self.num_qo_heads // self.num_kv_heads


@dataclass(frozen=True)
class WorkspaceNeed:
    """Bytes of float workspace needed, and the largest term per kernel path (for messages)."""

    bytes: int
    parts: dict[str, int] = field(default_factory=dict)


# Decode path for an fp8 KV cache (bf16/fp16 q), per GQA group: "cuda_core" or "tensor_core". The rule is
# this table; groups it lacks decode on tensor cores (as sglang always does for fp8). Measured on the H200
# (FlashInfer 0.6.13, D 128, page 16, CUDA-graph replay; ``python3 benchmarks/flashinfer_mla_fp8.py``, table
# "fp8_decode" in benchmarks/RESULTS.md): 32/8 heads — tensor cores 2133 µs (1.01x its bf16 step), CUDA cores
# 4880 µs (2.30x); 64/8 — tensor cores 1.03x, CUDA cores 4.55x; 32/32 (MHA, group 1) — CUDA cores 0.61x
# (e4m3) / 0.60x (e5m2), tensor cores 1.04x. So only group 1 decodes fp8 on CUDA cores (FlashInfer's CUDA-core
# kernel loads fp8 and upcasts in registers, which pays off when there is no head group to share a tile);
# every GQA group uses the tensor-core (prefill-kernel) path. Groups 2 and 3 were not measured: they follow
# group 4. On GQA fp8 halves the KV bytes but not the step time (47 % of the copy ceiling, see RESULTS.md).
FP8_DECODE_PATH: dict[int, str] = {1: "cuda_core"}


# FlashInfer MLA backend per arch: the sm90 (Hopper) fa3 MLA kernels are 2.1x faster than fa2 at 128 heads
# (H200, bf16, page 16, graph replay: B=64 ctx 4096 136.4 vs 289.0 µs; B=256 508 vs 1119; B=64 ctx 32768
# 1063 vs 2373 — benchmarks/RESULTS.md "fp8 KV and MLA facts"); FlashInfer's own ``backend="auto"``
# (``determine_mla_backend``) also picks fa3 where sm90a is supported. Other arches have only fa2.
MLA_FA3_ARCHS = ("sm90",)


def mla_backend(arch: str) -> str:
    """FlashInfer's MLA wrapper backend for ``arch`` (``"sm90"`` …): ``"fa3"`` on :data:`MLA_FA3_ARCHS`,
    else ``"fa2"``."""
    return "fa3" if arch in MLA_FA3_ARCHS else "fa2"


def is_fp8_name(kv_dtype: str) -> bool:
    """True for an fp8 KV dtype name, ours (``fp8_e4m3``) or torch's (``float8_e4m3fn``)."""
    return kv_dtype.startswith(("fp8", "float8"))


def use_tensor_core_decode(group: int, batch_size: int, kv_dtype: str = "bfloat16") -> bool:
    """Whether decode should run FlashInfer's prefill (tensor-core) kernel instead of CUDA cores.

    ``group``: q heads per kv head; ``batch_size``: requests in the decode batch; ``kv_dtype``: the
    KV-cache dtype name (ours or torch's). A GQA group the CUDA-core kernel is not compiled for
    (:data:`CUDA_CORE_DECODE_GROUPS`) always uses tensor cores. fp8 KV follows
    :data:`FP8_DECODE_PATH` (measured, see there). bf16/fp16: a group >=
    :data:`TENSOR_CORE_ALWAYS_GROUP` always uses tensor cores; a group >= :data:`TENSOR_CORE_MIN_GROUP`
    does from :data:`TENSOR_CORE_MIN_BATCH` requests on. Measured on the H200 (H=32, D=128, bf16,
    page 16): group 8 tc is never slower (1.0-2.7x faster), group 4 loses <= 2 µs below 8 requests at
    short contexts and wins up to 1.6x from there, group 1 is a tie (CUDA cores kept).

    :func:`workspace_need` sizes the graph term for tensor cores wherever either rule (16-bit or fp8)
    uses them, so the bound holds for every KV dtype however :data:`FP8_DECODE_PATH` is set.
    """
    if group not in CUDA_CORE_DECODE_GROUPS:
        return True
    if is_fp8_name(kv_dtype):
        return FP8_DECODE_PATH.get(group, "tensor_core") == "tensor_core"
    if group >= TENSOR_CORE_ALWAYS_GROUP:
        return True
    return group >= TENSOR_CORE_MIN_GROUP and batch_size >= TENSOR_CORE_MIN_BATCH


def cta_tile_q(packed_qo_len: int, head_dim_vo: int) -> int:
    """FlashInfer FA2's query tile (rows) for a packed query length (``qo_len * group``) on sm80+."""
    if packed_qo_len > 64 and head_dim_vo < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def _tmp_bytes(heads: int, rows: int, head_dim_vo: int) -> int:
    return heads * rows * head_dim_vo * FLOAT_BYTES + heads * rows * FLOAT_BYTES + 2 * ALIGN_BYTES


def cuda_core_decode_bytes(shape: HeadShape, num_sms: int) -> int:
    """Upper bound of the float scratch of CUDA-core decode (eager or graph, any batch size)."""
    rows = MAX_DECODE_BLOCKS_PER_SM * num_sms // shape.num_kv_heads
    return _tmp_bytes(shape.num_qo_heads, rows, shape.head_dim_vo)


def _partial_rows(tiles: int, tile: int, group: int) -> int:
    """Query rows of FA2's partial outputs for ``tiles`` work tiles of ``tile`` packed rows (0.7.2:
    ``max_partial_rows = ceil(padded_batch_size * cta_tile_q / gqa_group_size)``)."""
    return -(-tiles * tile // max(group, 1))


def fa2_eager_bytes(shape: HeadShape, num_sms: int) -> int:
    """Upper bound of FA2 prefill / tensor-core decode scratch for an eager plan (any batch)."""
    tiles = PREFILL_CTAS_PER_SM * num_sms // shape.num_kv_heads
    tile = 128 if shape.head_dim_vo < 256 else 64
    return _tmp_bytes(shape.num_qo_heads, _partial_rows(tiles, tile, shape.group), shape.head_dim_vo)


def fa2_graph_decode_bytes(shape: HeadShape, num_sms: int, batch_size: int) -> int:
    """Exact FA2 scratch of a tensor-core decode plan captured at ``batch_size`` requests."""
    tile = cta_tile_q(shape.group, shape.head_dim_vo)
    split_tiles = PREFILL_CTAS_PER_SM * num_sms // shape.num_kv_heads
    q_tiles = -(-batch_size * shape.group // tile) + batch_size - 1
    return _tmp_bytes(shape.num_qo_heads, _partial_rows(max(split_tiles, q_tiles), tile, shape.group),
                      shape.head_dim_vo)


def mla_bytes(shape: HeadShape, num_sms: int) -> int:
    """Float scratch of an MLA plan (fa2 or fa3 MLA wrapper, eager or graph, any batch): see the module docstring."""
    rows = 2 * MLA_CTA_TILE_Q * num_sms
    return rows * shape.head_dim_vo * MLA_OUT_BYTES + rows * FLOAT_BYTES + 2 * ALIGN_BYTES


def workspace_need(shapes: Iterable[HeadShape], *, num_sms: int, max_batch_size: int,
                   cuda_graph_max_bs: int = 0, prefill_backend: str = "fa2") -> WorkspaceNeed:
    """Float-workspace bytes a FlashInfer backend needs for the largest batch it will plan.

    Parameters
    ----------
    shapes: the head shapes of every layer kind the backend serves.
    num_sms: streaming multiprocessors of the device (``DeviceFacts.sm_count``), > 0.
    max_batch_size: the largest batch planned: max of the request pool (``max_reqs``) and the
        CUDA-graph batch sizes.
    cuda_graph_max_bs: largest captured batch size, 0 when CUDA graphs are off.
    prefill_backend: ``"fa2"`` (the ``flashinfer`` backend) or ``"fa3"`` (the ``fa3`` backend,
        whose SM90 kernels keep no float scratch).

    Returns a :class:`WorkspaceNeed`; ``parts`` names the largest term per path.
    """
    parts: dict[str, int] = {"cuda_core_decode": 0, "fa2_eager": 0, "fa2_graph_decode": 0, "mla": 0}
    for s in shapes:
        if s.mla:  # the MLA wrapper serves every step of an MLA kind
            parts["mla"] = max(parts["mla"], mla_bytes(s, num_sms))
            continue
        if prefill_backend == "fa3":
            continue
        parts["cuda_core_decode"] = max(parts["cuda_core_decode"], cuda_core_decode_bytes(s, num_sms))
        parts["fa2_eager"] = max(parts["fa2_eager"], fa2_eager_bytes(s, num_sms))
        bs = min(cuda_graph_max_bs, max_batch_size) if max_batch_size > 0 else cuda_graph_max_bs
        tc = use_tensor_core_decode(s.group, bs) or use_tensor_core_decode(s.group, bs, "fp8")  # either KV dtype
        if bs > 0 and (s.sinks or tc):
            parts["fa2_graph_decode"] = max(parts["fa2_graph_decode"], fa2_graph_decode_bytes(s, num_sms, bs))
    return WorkspaceNeed(bytes=max(parts.values()), parts=parts)
