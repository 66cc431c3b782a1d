"""The ``flashinfer`` and ``fa3`` backends' own rules, torch-free (docs/internals.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, TYPE_CHECKING

from pipeline.backends.capability import BackendRules, WorkspaceQuery, decode_output_only
from pipeline.core.contracts import AttentionArgs, ModelSpec
from pipeline.core.errors import ConfigError
from pipeline.core.numbers import largest_fitting, REMEDY_MAX_BS
from pipeline.core.settings import explicit_or_env, Setting, setting, Source

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.backends.flashinfer.jit import Variant


MiB = 1 << 20
DEFAULT_WORKSPACE_BYTES = 384 * MiB
FLOAT_BYTES = 4
ALIGN_BYTES = 16
MAX_DECODE_BLOCKS_PER_SM = 16
PREFILL_CTAS_PER_SM = 2
MLA_CTA_TILE_Q = 64
MLA_OUT_BYTES = 2  # FlashInfer's MLAPlan sizes partial outputs for a 16-bit output dtype

# Tensor-core decode pays once GQA group and batch are large enough (H200, benchmarks/RESULTS.md).
TENSOR_CORE_MIN_GROUP = 4
TENSOR_CORE_MIN_BATCH = 8
TENSOR_CORE_ALWAYS_GROUP = 8
# GQA groups FlashInfer's CUDA-core decode kernel is compiled for (``DISPATCH_GQA_GROUP_SIZE``); any other group decodes
# on the tensor-core kernel.
CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 8})


@dataclass(frozen=True)
class HeadShape:
    """One layer kind's heads: q ``H``, kv ``Hkv``, v head dim ``Dv``; ``sinks`` (decode runs the prefill kernel),
    ``mla``."""

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


# fp8 KV decode path per GQA group; groups absent use tensor cores (as sglang). Measured: benchmarks/RESULTS.md
# "fp8_decode".
FP8_DECODE_PATH: dict[int, str] = {1: "cuda_core"}


def is_fp8_name(kv_dtype: str) -> bool:
    """True for an fp8 KV dtype name, ours (``fp8_e4m3``) or torch's (``float8_e4m3fn``)."""
    return kv_dtype.startswith(("fp8", "float8"))


def use_tensor_core_decode(group: int, batch_size: int, kv_dtype: str = "bfloat16") -> bool:
    """Whether decode runs FlashInfer's prefill (tensor-core) kernel instead of CUDA cores.

    ``group``: q heads per kv head; ``kv_dtype``: ours or torch's name. Groups outside :data:`CUDA_CORE_DECODE_GROUPS`
    always use tensor cores; fp8 follows :data:`FP8_DECODE_PATH`; bf16/fp16 from :data:`TENSOR_CORE_ALWAYS_GROUP`, or
    from :data:`TENSOR_CORE_MIN_GROUP` at :data:`TENSOR_CORE_MIN_BATCH` requests (H200 measurements:
    benchmarks/RESULTS.md).
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


def fa2_graph_decode_bytes(shape: HeadShape, num_sms: int, batch_size: int, qo_len: int = 1) -> int:
    """Exact FA2 scratch of a tensor-core decode plan captured at ``batch_size`` requests of ``qo_len`` rows, bounded as
    FlashInfer's CUDA-graph planner bounds its tiles from the total rows."""
    rows = batch_size * qo_len
    tile = cta_tile_q((rows - batch_size + 1) * shape.group, shape.head_dim_vo)
    split_tiles = PREFILL_CTAS_PER_SM * num_sms // shape.num_kv_heads
    q_tiles = -(-rows * shape.group // tile) + batch_size - 1
    return _tmp_bytes(shape.num_qo_heads, _partial_rows(max(split_tiles, q_tiles), tile, shape.group),
                      shape.head_dim_vo)


def mla_bytes(shape: HeadShape, num_sms: int) -> int:
    """Float scratch of an MLA plan (fa2 or fa3 MLA wrapper, eager or graph, any batch): see docs/internals.md, ``pipeline.backends.flashinfer.rules``."""
    rows = 2 * MLA_CTA_TILE_Q * num_sms
    return rows * shape.head_dim_vo * MLA_OUT_BYTES + rows * FLOAT_BYTES + 2 * ALIGN_BYTES


def workspace_need(shapes: Iterable[HeadShape], *, num_sms: int, max_batch_size: int,
                   cuda_graph_max_bs: int = 0, prefill_backend: str = "fa2", graph_mode: str = "decode",
                   graph_tokens: int = 1) -> WorkspaceNeed:
    """Float-workspace bytes (:class:`WorkspaceNeed`, ``parts`` naming the largest term per path) for the largest batch.
    ``num_sms`` > 0; ``max_batch_size``: max of ``max_reqs`` and the graph sizes; ``cuda_graph_max_bs``: 0 without
    graphs; ``prefill_backend``: ``"fa2"`` or ``"fa3"`` (no float scratch); ``graph_mode``/``graph_tokens``: what the
    graphs capture (``decode``, ``target_verify`` or ``draft_decode`` with that many rows per request)."""
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
        if graph_mode == "target_verify":  # the paged prefill kernel, graph_tokens rows per request
            if bs > 0:
                parts["fa2_graph_decode"] = max(parts["fa2_graph_decode"],
                                                fa2_graph_decode_bytes(s, num_sms, bs, graph_tokens))
            continue
        rows = bs * graph_tokens if graph_mode == "draft_decode" else bs
        tc = use_tensor_core_decode(s.group, rows) or use_tensor_core_decode(s.group, rows, "fp8")  # either KV dtype
        if rows > 0 and (s.sinks or tc):
            parts["fa2_graph_decode"] = max(parts["fa2_graph_decode"], fa2_graph_decode_bytes(s, num_sms, rows))
    return WorkspaceNeed(bytes=max(parts.values()), parts=parts)


WORKSPACE_FIELD = "flashinfer_workspace_size"
WORKSPACE_ENV = "SGLANG_FLASHINFER_WORKSPACE_SIZE"


def check_workspace_size(size_bytes: int, need: WorkspaceNeed, *, field_name: str = WORKSPACE_FIELD,
                         state: str = "build-mode", graph_fix: str = "", env_var: str = "",
                         raise_fits: bool = True, field_given: bool = False) -> None:
    """Raise :class:`ConfigError` (``workspace_too_small``) when ``size_bytes < need.bytes``. Names ``field_name`` (or
    ``env_var`` first when the value came from it) and ``needed_bytes``; the remedy raises the field/variable only when
    ``raise_fits``, else offers ``graph_fix``."""
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
        remedy=", or ".join(([f"set {field_name}{'' if field_given else f' (or {WORKSPACE_ENV})'} to at least "
                              f"{need.bytes}"] if raise_fits else [])
                            + ([graph_fix] if graph_fix else [])),
    )


def shapes_of(kinds: Iterable[Any]) -> list[HeadShape]:
    """The :class:`HeadShape` of each :class:`~pipeline.core.contracts.LayerKind` (heads, kv heads, v dim, sinks, MLA)."""
    return [HeadShape(k.num_heads, k.num_kv_heads, k.head_dim_v, k.has_sinks, bool(getattr(k, "is_mla", False)))
            for k in kinds]


def backend_need(q: WorkspaceQuery, *, backend: str) -> int:
    """Bytes of workspace :func:`check_backend_workspace` needs (its ``need``: the least it accepts) for the query's
    kinds served by ``backend`` (``"flashinfer"`` or ``"fa3"``)."""
    return workspace_need(shapes_of(q.kinds), cuda_graph_max_bs=q.graph_max_bs, num_sms=max(q.num_sms, 1),
                          max_batch_size=q.max_reqs, prefill_backend="fa3" if backend == "fa3" else "fa2",
                          graph_mode=q.graph_mode, graph_tokens=q.graph_tokens).bytes


def check_backend_workspace(size_bytes: int, q: WorkspaceQuery, *, backend: str, state: str = "build-mode") -> None:
    """The one workspace check (build-mode, ``plan``, ``run``'s preflight): ``size_bytes`` against the need of ``q``.
    ``backend``: ``"flashinfer"`` or ``"fa3"``. Raises ConfigError ``workspace_too_small`` whose every remedy passes: a
    larger workspace (<= ``min(max_bytes, MAX_BYTES)``, fitting), a smaller largest captured batch (<=
    :data:`REMEDY_MAX_BS`), both, or ``disable_cuda_graph=True``."""
    from pipeline.core.validation import MAX_BYTES

    shapes, fits = shapes_of(q.kinds), q.fits
    kw = dict(num_sms=max(q.num_sms, 1), max_batch_size=q.max_reqs,
              prefill_backend="fa3" if backend == "fa3" else "fa2", graph_mode=q.graph_mode, graph_tokens=q.graph_tokens)
    need = workspace_need(shapes, cuda_graph_max_bs=q.graph_max_bs, **kw)
    if size_bytes >= need.bytes:
        return
    cap = min(q.max_bytes, MAX_BYTES) if q.max_bytes > 0 else MAX_BYTES
    room = (lambda ws, bs: ws <= cap and fits(ws, bs)) if fits is not None else (lambda ws, bs: ws <= cap)  # noqa: E731
    need_at = lambda bs: workspace_need(shapes, cuda_graph_max_bs=bs, **kw).bytes  # noqa: E731
    raise_fits = room(need.bytes, q.graph_max_bs)
    fix = _graph_fix(size_bytes, need_at, room, top=min(q.graph_max_bs, q.max_reqs, REMEDY_MAX_BS + 1) - 1,
                     graphs=q.graph_max_bs > 0,
                     sizes=_sizes_wording(q.graph_bs_given or bool(q.graph_bs), q.graph_bs, q.max_bs_given),
                     name=q.env_var or WORKSPACE_FIELD, raise_fits=raise_fits)
    check_workspace_size(size_bytes, need, state=state, graph_fix=fix, env_var=q.env_var, raise_fits=raise_fits,
                         field_given=q.field_given)


def _sizes_wording(list_given: bool, graph_bs: Sequence[int], max_bs_given: bool) -> Callable[[int], str]:
    """The change making ``n`` the largest captured batch (``set cuda_graph_max_bs=n`` or ``use only sizes up to n in
    cuda_graph_bs``), or "" when the list keeps no size."""
    def sizes(n: int) -> str:
        if not list_given:
            return f"set cuda_graph_max_bs={n}"
        m = max((b for b in graph_bs if b <= n), default=0) if graph_bs else n
        if not m:
            return ""
        return (f"use only sizes up to {m} in cuda_graph_bs and set cuda_graph_max_bs={m}" if max_bs_given
                else f"use only sizes up to {n} in cuda_graph_bs")
    return sizes


def _graph_fix(size_bytes: int, need_at: Callable[[int], int], room: Callable[[int, int], bool], *, top: int,
               graphs: bool, sizes: Callable[[int], str], name: str, raise_fits: bool) -> str:
    """The remedy's captured-size alternative, or "": the largest ``N`` fitting the workspace as is, else (unless
    ``raise_fits``) a workspace of the need at ``N`` and that ``N``, else no graphs; each search is
    :func:`~pipeline.core.numbers.largest_fitting` (needs grow with ``N``)."""
    fits = largest_fitting(range(1, top + 1), lambda bs: need_at(bs) <= size_bytes and room(size_bytes, bs))
    if fits is not None and sizes(fits):
        return sizes(fits)
    if raise_fits:
        return ""
    both = largest_fitting(range(1, top + 1), lambda bs: room(need_at(bs), bs))
    if both is not None and sizes(both):
        return f"set {name}={need_at(both)} and {sizes(both).removeprefix('set ')}"
    eager = max(need_at(0), size_bytes)
    if graphs and room(eager, 0):
        return ("set disable_cuda_graph=True" if eager == size_bytes
                else f"set {name}={eager} and disable_cuda_graph=True")
    return ""


MiB = 1 << 20
FLASHINFER_WORKSPACE_DEFAULT = 384 * MiB
FLASHINFER_WORKSPACE_QWEN = 512 * MiB
# sglang's FlashInferAttnBackend raises the workspace to 512 MiB for these ``architectures`` names only; here an
# explicit field > env var > this default.
WORKSPACE_512_MIB_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM",
                                   "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
FIELD = "flashinfer_workspace_size"


def flashinfer_workspace_size(args: AttentionArgs, model: ModelSpec,
                              env: Mapping[str, str] = os.environ) -> tuple[int, Source]:
    """Bytes of the FlashInfer workspace and their source: the field, else ``SGLANG_FLASHINFER_WORKSPACE_SIZE``, else
    sglang's default (512 MiB for :data:`WORKSPACE_512_MIB_ARCHITECTURES`, 384 MiB otherwise). Raises ConfigError for an
    env value that is not a byte count."""
    given = explicit_or_env(args, FIELD, env)
    if given is not None:
        return given
    big = any(a in WORKSPACE_512_MIB_ARCHITECTURES for a in model.architectures)
    return (FLASHINFER_WORKSPACE_QWEN if big else FLASHINFER_WORKSPACE_DEFAULT), "default"


def workspace(args: AttentionArgs, model: ModelSpec, env: Mapping[str, str]) -> Setting:
    """The workspace one ``flashinfer``/``fa3`` instance gets, as the :class:`Setting` that is logged."""
    return setting(FIELD, *flashinfer_workspace_size(args, model, env))


def _checker(kernel: str) -> Any:
    return lambda nbytes, query: check_backend_workspace(nbytes, query, backend=kernel)


def _need(kernel: str) -> Any:
    return lambda query: backend_need(query, backend=kernel)


def _variants(prefill: str) -> Any:
    def variants(kinds: Sequence[Any], q_dtype: str, kv_dtype: str, arch: str) -> list["Variant"]:
        from pipeline.backends.flashinfer.jit import variants_for  # its module imports multiprocessing: not for plan

        return variants_for(kinds, prefill, q_dtype, kv_dtype, arch)
    return variants


# Every FlashInfer wrapper allocates its own 8 MiB int workspace before capture; prefill-class wrappers also a 32768
# int32 ``_kv_lens_buffer``.
FI_INT_WORKSPACE_BYTES = 8 * MiB
FI_KV_LENS_BYTES = 32768 * 4


def graph_state_allocs(kinds: Sequence[Any], batch_sizes: Sequence[int], *, max_context_len: int, page_size: int,
                       num_sms: int, mode: str = "decode", tokens_per_req: int = 1) -> list[tuple[int, int]]:
    """``[(bs, nbytes)]`` graph capture allocates outside the graph pool, bs 0 first: :class:`GraphState`'s buffers,
    then per size and kind the capture wrapper's 8 MiB int workspace and buffers (as sglang), plus the verify mask
    buffers or the draft rows' buffers for ``target_verify`` / ``draft_decode`` (``tokens_per_req`` rows)."""
    mb = max(batch_sizes)
    pages = -(-max_context_len // max(page_size, 1))
    out = [(0, (mb + 1) * 4), (0, mb * pages * 4), (0, mb * 4), (0, (mb + 1) * 4), (0, mb * 4)]
    n, sizes = tokens_per_req, sorted(set(batch_sizes), reverse=True)
    if mode == "target_verify":
        out += [(0, (mb + 1) * 4), (0, mb * (-(-n * max_context_len // 8) + 1)), (0, (mb + 1) * 4)]
        return out + [(bs, b) for bs in sizes for _ in kinds for b in (FI_INT_WORKSPACE_BYTES, FI_KV_LENS_BYTES)]
    if mode == "draft_decode":
        rows = mb * n
        out += [(0, (rows + 1) * 4), (0, rows * max_context_len * 4), (0, rows * 4), (0, (rows + 1) * 4), (0, rows * 4)]
        return out + [a for bs in sizes for a in _wrapper_allocs(kinds, bs * n, bs)]
    return out + [a for bs in sizes for a in _wrapper_allocs(kinds, bs, bs)]


def _wrapper_allocs(kinds: Sequence[Any], rows: int, bs: int) -> list[tuple[int, int]]:
    """Per layer kind, what the ``use_cuda_graph`` decode-class wrapper for ``rows`` query rows allocates (recorded
    under size ``bs``)."""
    out = []
    for k in kinds:
        out.append((bs, FI_INT_WORKSPACE_BYTES))
        if k.has_sinks and not k.is_mla:
            out.append((bs, FI_KV_LENS_BYTES))
        elif not k.is_mla and use_tensor_core_decode(k.num_heads // k.num_kv_heads, rows):
            out.append((bs, (rows + 1) * 4))
    return out


# Decode allocates only its output inside a capture; split scratch lives in the workspace.
FLASHINFER_RULES = BackendRules(workspace=workspace, check_workspace=_checker("flashinfer"),
                                workspace_need=_need("flashinfer"),
                                jit_variants=_variants("fa2"), graph_decode_allocs=decode_output_only,
                                graph_state_allocs=graph_state_allocs)
FA3_RULES = BackendRules(workspace=workspace, check_workspace=_checker("fa3"), workspace_need=_need("fa3"),
                         jit_variants=_variants("fa3"),
                         graph_decode_allocs=decode_output_only, graph_state_allocs=graph_state_allocs)

