"""Data contracts shared by every state, command and later feature: the inputs of a start (``AttentionArgs``,
``SetupRequest``, ``DeviceFacts``, ``PoolFacts``) and what its steps decide (``Resolution``, ``BuildPlan`` and their
parts), with the model's spec (:mod:`pipeline.core.spec`) and the errors' ``ErrorInfo``: import every contract
from this module.

All records are frozen, keyword-only msgspec Structs that reject unknown fields, so a typo in a
recorded trace or a config file is an error rather than a silently ignored key. Invariants are
checked in ``__post_init__`` and raise :class:`pipeline.core.errors.ConfigError` subclasses that carry
an :class:`ErrorInfo`. New values are made with ``msgspec.structs.replace``. The events embed the decisions
(``BackendsResolved``, ``BuildPlanned``), so a trace reads back into these types. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

# Every contract is importable from here: the model's spec and the errors' record are part of the contract.
from pipeline.core.errors import ErrorInfo, Flag  # noqa: F401
from pipeline.core.spec import (  # noqa: F401
    ATTENTION_LAYER_TYPES, NOT_ATTENTION_LAYER_TYPES, AttentionLayerType, LayerGroup, LayerKind, LayerType, MLADims,
    ModelSpec,
)
from pipeline.core.shard import served_shard
from pipeline.core.validation import check_attention_args, check_pool_facts, check_setup_request


_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


class Mode(str, enum.Enum):
    """Build mode, in sglang's order of checks (PD-mux, then TBO, then normal)."""

    NORMAL = "normal"
    TBO = "tbo"
    PDMUX = "pdmux"


Rule = Literal["draft_override", "phase_flag", "global_flag", "auto"]


class Rejection(msgspec.Struct, **_STRUCT):
    """A backend that was considered and refused, with every reason."""

    backend: str
    reasons: list[str]


class ResolvedAttentionBackendStr(msgspec.Struct, **_STRUCT):
    """The resolved backend names, with the seed's field names (never None after resolve)."""

    prefill: str
    decode: str
    is_draft_override: bool = False


class DtypeChoice(msgspec.Struct, **_STRUCT):
    """The compute dtype and the rule that set it (:func:`pipeline.core.dtypes.resolve_dtype`).

    ``source``: ``"field"`` (``--dtype`` given) or ``"auto:<rule>"`` (see
    :data:`pipeline.core.dtypes.AUTO_RULES`).
    """

    value: str
    source: str


class SpeculativeParams(msgspec.Struct, **_STRUCT):
    """The speculative-decoding shape a start serves, settled as sglang 0.5.23 settles it
    (:func:`pipeline.core.speculative.decide_speculative`).

    ``algorithm``: sglang's resolved name (``NEXTN`` is ``EAGLE``); ``num_steps``: draft decode steps per round;
    ``topk``: branches per draft step (EAGLE's ``speculative_eagle_topk``; > 1 makes the draft a tree);
    ``num_draft_tokens``: tokens per request in a target-verify batch (the tree's nodes, its root the bonus token);
    ``source``: ``"flags"`` (all given), ``"flags:topk1"`` (``num_draft_tokens`` derived as ``num_steps + 1``),
    ``"auto:<architecture>"`` (sglang's ``_auto_choose_speculative_params`` for the target model) or
    ``"ngram"`` (sglang's NGRAM defaults).
    """

    algorithm: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    source: str

    @property
    def is_tree(self) -> bool:
        """True when a draft step branches (top-k > 1): target verify needs a custom tree mask."""
        return self.topk > 1


class Evidence(msgspec.Struct, omit_defaults=True, **_STRUCT):
    """Why auto-selection put a backend first for one phase (:mod:`states.evidence`).

    ``kind``: ``measured`` (a row of the measured table matched: ``source`` is ``"<script>, <date>"``, ``device``
    the GPU it ran on, ``versions`` its packages, ``next`` the runner-up and ``ratio_vs_next`` its time over the
    chosen one's, ``layers`` the layer kind in words), ``unmeasured`` (the fixed priority stood; ``reason`` says
    why) or ``explicit`` (a flag chose).
    """

    kind: Literal["measured", "unmeasured", "explicit"]
    source: str = ""
    device: str = ""
    versions: dict[str, str] = {}
    next: str | None = None
    ratio_vs_next: float | None = None
    layers: str = ""
    reason: str = ""


class Resolution(msgspec.Struct, **_STRUCT):
    """Output of the resolve state: the pair, the rule per half, and what auto-selection refused.

    ``dtype``: the compute dtype and the rule that chose it; ``not_attention``: the model's layers
    that no attention backend computes (linear attention, mamba), left to the model's own kernels;
    ``speculative``: the speculative-decoding shape served (None without ``speculative_algorithm``);
    ``evidence``: per half, why auto put its backend first (:class:`Evidence`).
    """

    pair: ResolvedAttentionBackendStr
    rules: dict[str, Rule]
    rejected: dict[str, list[Rejection]] = {}
    skips: list["Skip"] = []
    dtype: DtypeChoice | None = None
    not_attention: list[LayerGroup] = []
    speculative: SpeculativeParams | None = None
    evidence: dict[str, Evidence] = {}


class Skip(msgspec.Struct, **_STRUCT):
    """A step or feature deliberately not done, and why (e.g. TBO on a draft worker).

    ``downgrade``: True when the feature exists here and is lost because of a choice (CUDA graphs
    off on a CUDA device because the decode backend cannot be captured; TBO dropped on a draft
    worker): logged as ``feature_downgraded`` (a warning; refused under ``strict``). False when it
    does not apply at all (CUDA graphs on a CPU): logged as ``step_skipped``.
    ``avoid``: the field assignments that avoid the downgrade (e.g. ``{"disable_cuda_graph": True}``).
    """

    what: str
    reason: str
    downgrade: bool = True
    avoid: dict[str, Any] = {}


class SetupWarning(msgspec.Struct, **_STRUCT):
    """One thing a start did that a user should know: the ``warnings`` list of ``run``/``plan --json``.

    ``code``: ``reference_fallback`` (auto-selection landed on ``torch_native`` on an accelerator)
    or ``feature_downgraded`` (a :class:`Skip` with ``downgrade=True``) or ``slow_phase`` (``run``: a startup phase above ``--slow-phase-s``; ``what`` is the phase,
    ``parent/name`` for a child such as ``startup/import torch``). ``what``: the halves that fell back (``prefill``/``decode``/``prefill+decode``) or the feature
    lost (``cuda_graph`` …).
    ``message``: one short sentence. ``avoid``: field assignments that accept or avoid it (what
    ``strict`` asks for). ``rejected``: for a fallback, every auto candidate refused per half, with
    its reasons.
    """

    code: Literal["reference_fallback", "feature_downgraded", "slow_phase"]
    what: str
    message: str
    avoid: dict[str, Any] = {}
    rejected: dict[str, list[Rejection]] = {}


class InstancePlan(msgspec.Struct, **_STRUCT):
    """One backend instance to build: its role, backend name and workspace id (or None)."""

    role: str
    backend: str
    workspace: str | None = None


class WorkspacePlan(msgspec.Struct, **_STRUCT):
    """One workspace buffer: id, owner role, size in bytes, and the roles sharing it."""

    id: str
    owner: str
    bytes: int
    shared_by: list[str] = []


class BuildPlan(msgspec.Struct, **_STRUCT):
    """Output of build-mode's decision: mode, whether hybrid, instances and workspaces."""

    mode: Mode
    hybrid: bool
    instances: list[InstancePlan]
    workspaces: list[WorkspacePlan]
    skips: list[Skip] = []

    @property
    def workspace_bytes(self) -> int:
        """Bytes of all planned workspaces together (what the memory checks count beside the pools and graphs)."""
        return sum(w.bytes for w in self.workspaces)


SCHEMA_VERSION = 1


class ForwardMode(str, enum.Enum):
    """What a forward batch does.

    ``EXTEND``: prefill with an optional cached prefix (causal among the new tokens). ``DECODE``: one new token per
    request. Speculative decoding (sglang's ``ForwardMode`` in ``model_executor/forward_batch_info.py``):
    ``TARGET_VERIFY``: the target model scores each request's tree of ``num_draft_tokens`` draft tokens, each token
    attending to the cached prefix and to its ancestors in the tree (a custom mask from the tree's parents);
    ``DRAFT_EXTEND``: the draft model's extend over the accepted tokens (causal, as ``EXTEND``; sglang's
    ``DRAFT_EXTEND_V2``); ``DRAFT_DECODE``: one draft step of ``topk`` branches per request, each branch row attending
    to the prefix and its own draft tokens so far (sglang runs it as ``DECODE`` with an ``EagleDraftInput`` through
    its multi-step draft backends).
    """

    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_DECODE = "draft_decode"

    @property
    def is_decode_like(self) -> bool:
        """One query row per request (decode) or per draft branch (draft decode): served by ``forward_decode``."""
        return self in (ForwardMode.DECODE, ForwardMode.DRAFT_DECODE)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


class AttentionArgs(msgspec.Struct, **_STRUCT):
    """The attention-related server arguments, with sglang's names and meanings.

    Backend names are the registry's (``attn-setup backends`` lists them, with what each serves);
    ``None`` means "not given". Resolution precedence per phase: draft override (draft worker
    only) > phase flag (``prefill_attention_backend`` / ``decode_attention_backend``) > global
    flag (``attention_backend``) > auto-selection — as sglang's ``_resolve_attention_backend_str``
    does, with auto-selection added where sglang leaves the string ``None``.

    Sizes are in bytes. ``zbal_local_mem_size`` and ``flashinfer_workspace_size`` follow the
    precedence explicit field > env var (``SGLANG_ZBAL_LOCAL_MEM_SIZE``,
    ``SGLANG_FLASHINFER_WORKSPACE_SIZE``) > default; see :mod:`pipeline.core.settings`.

    ``strict`` (not an sglang argument): refuse instead of warn. Auto-selection landing on
    ``torch_native`` (the reference backend) on an accelerator is refused as ``reference_fallback``
    and any downgrade (CUDA graphs off, TBO dropped on a draft worker) as ``downgrade_refused``,
    both in resolve before anything is allocated, naming the fields that accept or avoid it.

    Raises :class:`pipeline.core.errors.ConfigError` (``invalid_value``) from ``__post_init__`` for
    values outside their domain (``page_size < 1``, ``sm_group_num < 1``, negative sizes…) or
    of the wrong type (msgspec checks types only when decoding, so Python callers get it here).

    Fields
    ------
    (one line each; ``attn-setup``'s ``--help`` is generated from them)
    attention_backend: backend for both phases unless a phase flag overrides it; unset = auto-select
    prefill_attention_backend: backend for extend/prefill batches (wins over attention_backend)
    decode_attention_backend: backend for decode batches (wins over attention_backend)
    speculative_draft_attention_backend: on a draft worker, the backend for both phases (wins over all)
    speculative_algorithm: speculative decoding algorithm (case-insensitive; NEXTN is EAGLE); unset = none
    speculative_num_steps: draft decode steps per round; unset = sglang's default for the target model (Llama: 5, else 3), then speculative_eagle_topk and speculative_num_draft_tokens must be unset too
    speculative_eagle_topk: EAGLE branches per draft step (> 1: a tree verified with a custom mask); needs speculative_num_steps
    speculative_num_draft_tokens: tokens per request in a target verify batch (the tree's nodes); unset = speculative_num_steps + 1 when speculative_eagle_topk is 1
    enable_pdmux: PD-mux: one prefill backend on a private workspace, sm_group_num decode backends on one shared workspace (GPU only, not with TBO)
    sm_group_num: number of PD-mux decode backends (SM groups)
    enable_two_batch_overlap: TBO: a wrapper with a primary and two children, each serving half the batch (a recorded downgrade on a draft worker); needs attn_dp_size > 1 or moe_a2a_backend, as in sglang
    attn_dp_size: attention data parallel groups (sglang's attn_dp_size; a divisor of tp_size): attention heads are split over tp_size / attn_dp_size ranks; TBO reads it too
    tp_size: tensor parallel ranks (sglang's tp_size): each serves num_attention_heads / tp_size query heads and its kv heads (replicated when fewer than tp_size); unset = world_size / pp_size
    pp_size: pipeline parallel stages (sglang's pp_size): each serves its range of layers (sglang's get_pp_indices); tp_size x pp_size must equal world_size
    moe_a2a_backend: expert parallel all to all backend of the MoE layers (sglang's; none = off); only TBO reads it here
    kv_cache_dtype: storage dtype of the KV cache; auto = the model dtype
    page_size: tokens per KV-cache page
    disable_cuda_graph: capture no decode CUDA graphs
    cuda_graph_bs: decode batch sizes captured as CUDA graphs; unset = 1, 2, 4, 8, 16, 24, … up to cuda_graph_max_bs
    cuda_graph_max_bs: largest decode batch size captured; unset = max(cuda_graph_bs), else min(the request pool's
        rows, sglang's default for the device's memory: states.build_mode.graph_top)
    zbal_local_mem_size: bytes of NPU zbal lazy memory, 0 = off; unset = SGLANG_ZBAL_LOCAL_MEM_SIZE, else 0
    flashinfer_workspace_size: bytes of the FlashInfer workspace; unset = SGLANG_FLASHINFER_WORKSPACE_SIZE, else 384 MiB (512 MiB for sglang's Qwen2/Qwen3/MiMo architectures)
    dtype: model (activation) dtype; auto = the checkpoint's, a float32 checkpoint in bfloat16 (Gemma family) or float16 (a config without torch_dtype counts as float32, as in sglang)
    strict: refuse (exit 3) instead of warning when auto lands on the torch_native reference backend on an accelerator or a feature is downgraded
    """

    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    speculative_draft_attention_backend: str | None = None
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    enable_pdmux: bool = False
    sm_group_num: int = 3
    enable_two_batch_overlap: bool = False
    attn_dp_size: int = 1
    tp_size: int | None = None
    pp_size: int = 1
    moe_a2a_backend: str = "none"
    kv_cache_dtype: str = "auto"
    page_size: int = 1
    disable_cuda_graph: bool = False
    cuda_graph_bs: list[int] | None = None
    cuda_graph_max_bs: int | None = None
    zbal_local_mem_size: int | None = None
    flashinfer_workspace_size: int | None = None
    dtype: str = "auto"
    strict: bool = False

    def __post_init__(self) -> None:
        check_attention_args(self)


class DeviceFacts(msgspec.Struct, **_STRUCT):
    """Facts about the device one rank initializes on.

    ``type`` is torch's device type (``cpu``, ``cuda``, ``musa``, ``npu``, ``xpu``, ``rocm`` is
    reported as ``cuda`` with ``vendor="amd"``); ``compute_capability`` is (major, minor) for
    CUDA, None elsewhere; ``total_memory_bytes`` is the device memory in bytes (host RAM on CPU).
    ``source`` says where the facts came from (``torch.cuda``, ``profile:h200`` …).
    """

    type: Literal["cpu", "cuda", "musa", "npu", "xpu", "mps"]
    index: int = 0
    name: str = ""
    vendor: str = ""
    compute_capability: tuple[int, int] | None = None
    sm_count: int = 0
    total_memory_bytes: int = 0
    cuda_version: str | None = None
    source: str = ""

    @property
    def device_str(self) -> str:
        return "cpu" if self.type == "cpu" else f"{self.type}:{self.index}"

    @property
    def arch(self) -> str | None:
        """``"sm90"`` style name, or None without a compute capability."""
        if self.compute_capability is None:
            return None
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


class PoolFacts(msgspec.Struct, **_STRUCT):
    """Sizes of the engine's KV memory pools (made before the backends, as in sglang).

    ``max_reqs``: rows of ``req_to_token``; ``max_context_len``: its columns (tokens);
    ``num_token_slots``: rows of each per-layer K/V buffer; ``page_size``: tokens per page.
    """

    max_reqs: int = 16
    max_context_len: int = 4096
    num_token_slots: int = 16384
    page_size: int = 1

    def __post_init__(self) -> None:
        check_pool_facts(self)


class SetupRequest(msgspec.Struct, **_STRUCT):
    """Everything the pipeline needs, in one immutable record (the input of a run).

    ``device`` is ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (likewise musa/npu/xpu);
    ``device_spelled_as`` is how the user wrote it when that differs (``CUDA:0``, ``gpu``; None otherwise:
    :func:`pipeline.core.validation.device_spelling`), recorded in ``device_initialized`` and shown by ``run``.
    ``draft_model`` is the draft model's spec for a speculative-decoding draft worker
    (``is_draft_worker=True``); when None the draft worker uses ``model``.
    ``secrets`` names extra engine arguments that are secret (tokens, API keys); they are carried
    but always redacted in logs and traces.
    """

    args: AttentionArgs = msgspec.field(default_factory=AttentionArgs)
    model: ModelSpec
    draft_model: ModelSpec | None = None
    is_draft_worker: bool = False
    device: str = "auto"
    device_spelled_as: str | None = None
    rank: int = 0
    world_size: int = 1
    pool: PoolFacts = msgspec.field(default_factory=PoolFacts)
    run_id: str | None = None
    secrets: dict[str, str] = {}

    def __post_init__(self) -> None:
        check_setup_request(self)

    @property
    def whole_model(self) -> ModelSpec:
        """The model this worker serves, all heads and layers: the draft model on a draft worker when given."""
        if self.is_draft_worker and self.draft_model is not None:
            return self.draft_model
        return self.model

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks: ``args.tp_size``, unset ``world_size // args.pp_size`` (what sglang's defaults that
        scale with the launch, such as the largest CUDA-graph batch, read as ``tp_size``)."""
        return self.args.tp_size or max(self.world_size // self.args.pp_size, 1)

    @property
    def served_model(self) -> ModelSpec:
        """This rank's shard of :attr:`whole_model` (:mod:`pipeline.core.shard`: its heads and its stage's
        layers; the whole model at tp 1 x pp 1)."""
        a = self.args
        return served_shard(self.whole_model, tp_size=a.tp_size, pp_size=a.pp_size, rank=self.rank,
                            world_size=self.world_size, attn_dp_size=a.attn_dp_size)

