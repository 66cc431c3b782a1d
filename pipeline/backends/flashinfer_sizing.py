"""FlashInfer workspace sizing and kernel-choice rules, as pure arithmetic (no torch).

FlashInfer's ``plan()`` carves its split-KV scratch (partial outputs ``tmp_v`` and partial
log-sum-exps ``tmp_s``, both float32) out of the caller-owned *float* workspace buffer and fails
with "Out of workspace memory" when it does not fit. The amount depends only on the head shape,
the SM count and — under CUDA-graph capture — the captured batch size, so the bytes a backend
can ever need are known at build time. build-mode calls :func:`workspace_need` and
:func:`check_workspace_size` to refuse a too-small ``flashinfer_workspace_size`` before anything
is allocated, instead of failing later during graph capture (a reported sglang pain point).

The formulas mirror FlashInfer 0.6.13's scheduler (``include/flashinfer/attention/scheduler.cuh``):

- CUDA-core decode (``DecodePlan``): KV is split only while ``batch * num_kv_heads`` is below the
  grid the kernel fills (``blocks_per_sm * num_sms``), so at most ``grid / num_kv_heads`` split
  rows exist; we bound ``blocks_per_sm`` by 16 (>= 128 threads per CTA, 2048 threads per SM).
  Bytes: ``H * rows * (Dv + 1) * 4``.
- FA2 prefill / tensor-core decode (``PrefillPlan``): eager plans split into at most
  ``2 * num_sms // num_kv_heads`` work tiles of ``cta_tile_q`` rows; a CUDA-graph plan pads to
  ``max(that, ceil(bs * G / cta_tile_q) + bs - 1)`` tiles. Bytes: ``H * tiles * cta_tile_q * (Dv + 1) * 4``.
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
from typing import Any, Iterable, Optional

from pipeline.core.errors import ConfigError

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
# GQA group sizes FlashInfer's CUDA-core decode kernel is compiled for (``DISPATCH_GQA_GROUP_SIZE`` in
# include/flashinfer/utils.cuh, 0.6.13: 1, 2, 3, 4, 8); any other group ("Unsupported group_size: 7" for
# Qwen2.5-7B's 28 q / 4 kv heads) must decode on the tensor-core (prefill) kernel, which takes any group.
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


def fa2_eager_bytes(shape: HeadShape, num_sms: int) -> int:
    """Upper bound of FA2 prefill / tensor-core decode scratch for an eager plan (any batch)."""
    tiles = PREFILL_CTAS_PER_SM * num_sms // shape.num_kv_heads
    tile = 128 if shape.head_dim_vo < 256 else 64
    return _tmp_bytes(shape.num_qo_heads, tiles * tile, shape.head_dim_vo)


def fa2_graph_decode_bytes(shape: HeadShape, num_sms: int, batch_size: int) -> int:
    """Exact FA2 scratch of a tensor-core decode plan captured at ``batch_size`` requests."""
    tile = cta_tile_q(shape.group, shape.head_dim_vo)
    split_tiles = PREFILL_CTAS_PER_SM * num_sms // shape.num_kv_heads
    q_tiles = -(-batch_size * shape.group // tile) + batch_size - 1
    return _tmp_bytes(shape.num_qo_heads, max(split_tiles, q_tiles) * tile, shape.head_dim_vo)


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


WORKSPACE_FIELD = "flashinfer_workspace_size"
WORKSPACE_ENV = "SGLANG_FLASHINFER_WORKSPACE_SIZE"


def check_workspace_size(size_bytes: int, need: WorkspaceNeed, *, field_name: str = WORKSPACE_FIELD,
                         state: str = "build-mode", graph_fix: str = "", env_var: str = "",
                         raise_fits: bool = True) -> None:
    """Raise :class:`ConfigError` (``workspace_too_small``) when ``size_bytes < need.bytes``.

    The one check of the workspace size, whichever source set it. The error names ``field_name`` and its
    value — or, when the value came from the environment (``env_var``, e.g.
    ``SGLANG_FLASHINFER_WORKSPACE_SIZE=1000``), that variable with its value first and the field after it
    (value None), as :func:`pipeline.core.validation.check_size` names a variable — the minimum this backend can
    use (``needed_bytes``: the bytes its largest planned batch needs, and the kernel path that needs them) and
    the remedy: set the field or the variable to at least that — only when ``raise_fits`` (that size is a value the
    flag takes and the device can hold) —, or ``graph_fix`` (a change to the captured batch sizes that then
    passes) when given.
    """
    if size_bytes >= need.bytes:
        return
    worst = max(need.parts, key=need.parts.get) if need.parts else "plan"
    if env_var:
        raise ConfigError(
            f"environment variable {env_var}={size_bytes} sets a FlashInfer workspace smaller than the {need.bytes} "
            f"bytes the largest planned batch needs ({worst}): the least this backend can use here",
            code="workspace_too_small", state=state,
            flags=[(env_var, size_bytes), (field_name, None), ("needed_bytes", need.bytes)],
            allowed=[f">= {need.bytes}"],
            remedy=", or ".join(([f"set {env_var} to at least {need.bytes}"] if raise_fits else [])
                               + ([graph_fix] if graph_fix else [])),
        )
    raise ConfigError(
        f"the FlashInfer workspace of {size_bytes} bytes is smaller than the {need.bytes} bytes the "
        f"largest planned batch needs ({worst})",
        code="workspace_too_small", state=state,
        flags=[(field_name, size_bytes), ("needed_bytes", need.bytes)],
        allowed=[f">= {need.bytes}"],
        remedy=", or ".join(([f"set {field_name} (or {WORKSPACE_ENV}) to at least {need.bytes}"] if raise_fits else [])
                            + ([graph_fix] if graph_fix else [])),
    )


def shapes_of(kinds: Iterable[Any]) -> list[HeadShape]:
    """The :class:`HeadShape` of each :class:`~pipeline.core.contracts.LayerKind` (heads, kv heads, v dim, sinks, MLA)."""
    return [HeadShape(k.num_heads, k.num_kv_heads, k.head_dim_v, k.has_sinks, bool(getattr(k, "is_mla", False)))
            for k in kinds]


def _largest_fitting_bs(fits: Any, top: int) -> Optional[int]:
    """The largest ``bs`` in ``1..top`` with ``fits(bs)``, or None: a binary search, O(log top) calls, valid because
    the need grows with the captured batch (:func:`fa2_graph_decode_bytes` is nondecreasing in ``batch_size``, and
    :func:`use_tensor_core_decode` only turns on as the batch grows). A linear scan from ``top`` down hung on a
    ``max_reqs`` of 2**31 - 1."""
    if top < 1 or not fits(1):
        return None
    lo, hi = 1, top  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


# A remedy never names a largest captured batch above this: its series (1, 2, 4, 8, 16, 24, … 8192: 1027 sizes) plans
# in seconds, while a workspace fitting 2**48 bytes (the flag's limit) would fit ~850M captured requests, a series no
# plan or capture gets through (t6verify's remedy named --cuda-graph-max-bs 852334595, and that plan ran out of memory).
REMEDY_MAX_BS = 8192


def check_backend_workspace(size_bytes: int, kinds: Iterable[Any], *, backend: str, num_sms: int, max_reqs: int,
                            graph_max_bs: int, graph_bs_given: bool = False, state: str = "build-mode",
                            env_var: str = "", max_bytes: int = 0) -> None:
    """The one workspace check (build-mode, ``plan`` and ``run``'s preflight call it, through the registry entry).

    ``size_bytes``: the workspace the backend gets; ``kinds``: the layer kinds it serves;
    ``backend``: ``"flashinfer"`` (fa2 kernels) or ``"fa3"``; ``num_sms``: the device's SMs;
    ``max_reqs``: rows of ``req_to_token`` (the largest eager batch); ``graph_max_bs``: the
    largest captured decode batch (:func:`states.graphs.graph_max_bs`, 0 without graphs);
    ``graph_bs_given``: the sizes came from ``cuda_graph_bs`` (so the remedy names that list);
    ``env_var``: the environment variable the size came from ("" when the field or the default set it), named by
    the error; ``max_bytes``: the largest workspace this device can hold (0: unknown), see below.
    Raises ConfigError ``workspace_too_small``.

    Every alternative of the remedy then passes this check with a value the flags take:

    - a larger workspace, only when the need is at most ``min(max_bytes, MAX_BYTES)`` (``MAX_BYTES`` = 2**48, the
      ``--flashinfer-workspace-size`` domain);
    - a smaller largest captured batch that fits the workspace as it is (``cuda_graph_max_bs=N``, or the list's
      sizes up to N), N at most :data:`REMEDY_MAX_BS`;
    - when neither alone can work (the workspace cannot be raised enough and fits not even one captured request),
      both: a workspace of the need at such an N and that N;
    - when no captured batch fits at all, ``disable_cuda_graph=True`` if the eager need fits the workspace.
    """
    from pipeline.core.validation import MAX_BYTES

    shapes = shapes_of(kinds)
    kw = dict(num_sms=max(num_sms, 1), max_batch_size=max_reqs, prefill_backend="fa3" if backend == "fa3" else "fa2")
    need = workspace_need(shapes, cuda_graph_max_bs=graph_max_bs, **kw)
    if size_bytes >= need.bytes:
        return
    cap = min(max_bytes, MAX_BYTES) if max_bytes > 0 else MAX_BYTES
    need_at = lambda bs: workspace_need(shapes, cuda_graph_max_bs=bs, **kw).bytes  # noqa: E731
    top = min(graph_max_bs, max_reqs, REMEDY_MAX_BS + 1) - 1  # a smaller captured batch than now, and practical
    fits = _largest_fitting_bs(lambda bs: need_at(bs) <= size_bytes, top)
    fix = ""
    if fits is not None:
        fix = (f"use only sizes up to {fits} in cuda_graph_bs" if graph_bs_given
               else f"set cuda_graph_max_bs={fits}")
    elif need.bytes > cap:
        both = _largest_fitting_bs(lambda bs: need_at(bs) <= cap, top)
        if both is not None:
            sizes = f"use only sizes up to {both} in cuda_graph_bs" if graph_bs_given else f"cuda_graph_max_bs={both}"
            fix = f"set {env_var or WORKSPACE_FIELD}={need_at(both)} and {sizes}"
        elif graph_max_bs and need_at(0) <= size_bytes:
            fix = "set disable_cuda_graph=True"
    check_workspace_size(size_bytes, need, state=state, graph_fix=fix, env_var=env_var, raise_fits=need.bytes <= cap)
