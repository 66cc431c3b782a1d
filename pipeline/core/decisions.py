"""Data contracts of what the setup steps decide: the resolution (resolve) and the build plan (build-mode).

Frozen, keyword-only msgspec Structs that reject unknown fields, like the inputs in
:mod:`pipeline.core.contracts` (which re-exports every name here: import from there). The events embed them
(``BackendsResolved``, ``BuildPlanned``), so a trace reads back into these types. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from pipeline.core.spec import LayerGroup

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


class Resolution(msgspec.Struct, **_STRUCT):
    """Output of the resolve state: the pair, the rule per half, and what auto-selection refused.

    ``dtype``: the compute dtype and the rule that chose it; ``not_attention``: the model's layers
    that no attention backend computes (linear attention, mamba), left to the model's own kernels;
    ``speculative``: the speculative-decoding shape served (None without ``speculative_algorithm``).
    """

    pair: ResolvedAttentionBackendStr
    rules: dict[str, Rule]
    rejected: dict[str, list[Rejection]] = {}
    skips: list["Skip"] = []
    dtype: DtypeChoice | None = None
    not_attention: list[LayerGroup] = []
    speculative: SpeculativeParams | None = None


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
    or ``feature_downgraded`` (a :class:`Skip` with ``downgrade=True``) or ``layer_rule_default`` (a config's layers
    read by a default rule: its ``model_type`` has no layer rule and it lists no layer types; ``what`` is ``model`` or
    ``draft_model``) or ``slow_phase`` (``run``: a startup phase above ``--slow-phase-s``; ``what`` is the phase,
    ``parent/name`` for a child such as ``startup/import torch``). ``what``: the halves that fell back (``prefill``/``decode``/``prefill+decode``) or the feature
    lost (``cuda_graph`` …).
    ``message``: one short sentence. ``avoid``: field assignments that accept or avoid it (what
    ``strict`` asks for). ``rejected``: for a fallback, every auto candidate refused per half, with
    its reasons.
    """

    code: Literal["reference_fallback", "feature_downgraded", "layer_rule_default", "slow_phase"]
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
