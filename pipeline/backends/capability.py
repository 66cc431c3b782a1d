"""The record types of a backend (torch-free): its capability record and its rules, shared by the registry
and the records module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)

FEATURES = ("mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention",
            "encoder_decoder", "speculative", "speculative_tree", "speculative_tree_paged", "cuda_graph", "tbo", "pdmux")
# The features a model's layers use (the rest are flags or build modes); see ``fp8_kv_features``.
MODEL_FEATURES = ("mha", "mla", "sliding_window", "logit_softcap", "attention_sinks", "chunked_local_attention",
                  "encoder_decoder")


class Capability(msgspec.Struct, **_STRUCT):
    """What a backend can serve; resolve refuses any request outside it, with the reason.

    ``devices``; ``archs`` (``"sm90"``; None = any); ``head_dims_qk`` / ``head_dims_v`` (None = any); ``q_dtypes`` /
    ``kv_dtypes`` (torch names); ``features`` (:data:`FEATURES`); ``page_sizes`` (None = any >= 1); ``packages``;
    ``workspace_bytes`` (0 = none); ``kv_dtype_matches_q``: a 16/32-bit KV dtype must equal q's (fp8 KV listed in
    ``kv_dtypes`` is dequantized with the layer's scales); ``mla_head_dims``: absorbed ``[qk, v]`` pairs (``[[576,
    512]]``; None: checked like any kind); ``fp8_kv_features``: model features (:data:`MODEL_FEATURES`) served with fp8
    KV (None = all); ``source``.
    """

    devices: list[str]
    archs: Optional[list[str]] = None
    head_dims_qk: Optional[list[int]] = None
    head_dims_v: Optional[list[int]] = None
    q_dtypes: list[str] = msgspec.field(default_factory=lambda: ["bfloat16", "float16", "float32"])
    kv_dtypes: list[str] = msgspec.field(default_factory=lambda: ["bfloat16", "float16", "float32"])
    features: list[str] = []
    page_sizes: Optional[list[int]] = None
    packages: list[str] = []
    workspace_bytes: int = 0
    kv_dtype_matches_q: bool = False
    mla_head_dims: Optional[list[list[int]]] = None
    fp8_kv_features: Optional[list[str]] = None
    tree_features: Optional[list[str]] = None
    source: str = ""

    def has(self, feature: str) -> bool:
        return feature in self.features


@dataclass(frozen=True)
class BackendRules:
    """A backend's own torch-free decisions beyond its record (None = none).

    ``workspace(args, model, env) -> Setting``; ``check_workspace(nbytes, query)`` (ConfigError
    ``workspace_too_small``); ``workspace_need(query) -> int``; ``jit_variants(kinds, q_dtype, kv_dtype, arch) ->
    list``; ``graph_decode_allocs(kind, bs, q_elem_bytes) -> [(nbytes, is_output)]``: a decode forward's device tensors
    for one layer, in order (None: :func:`decode_output_only`); ``graph_state_allocs(kinds, batch_sizes, *,
    max_context_len, page_size, num_sms) -> [(bs, nbytes)]``: kept outside the graph pool (``bs`` 0:
    ``init_cuda_graph_state``).
    """

    workspace: Optional[Callable[..., Any]] = None
    check_workspace: Optional[Callable[..., None]] = None
    workspace_need: Optional[Callable[..., int]] = None
    jit_variants: Optional[Callable[..., list[Any]]] = None
    graph_decode_allocs: Optional[Callable[..., list[tuple[int, bool]]]] = None
    graph_state_allocs: Optional[Callable[..., list[tuple[int, int]]]] = None


class WorkspaceQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What a workspace check asks of one backend's workspace (build-mode, ``plan``, ``run``'s preflight). ``kinds``,
    ``num_sms``, ``max_reqs``, ``graph_max_bs`` (0: no graphs); for the remedy: ``graph_bs`` / ``graph_bs_given``,
    ``max_bs_given``, ``env_var`` (""), ``field_given``, ``max_bytes`` (0: unknown), ``fits(ws, bs)``
    (:func:`pipeline.memory.fits.fits_beside`; None: ``max_bytes`` alone); ``graph_mode`` / ``graph_tokens``."""

    kinds: Any
    num_sms: int
    max_reqs: int
    graph_max_bs: int
    graph_mode: str = "decode"
    graph_tokens: int = 1
    graph_bs: tuple[int, ...] = ()
    graph_bs_given: bool = False
    max_bs_given: bool = False
    env_var: str = ""
    field_given: bool = False
    max_bytes: int = 0
    fits: Optional[Callable[[int, int], bool]] = None


def decode_output_only(kind: Any, bs: int, q_elem_bytes: int) -> list[tuple[int, bool]]:
    """A decode forward allocating only its output ``[bs, H, Dv]`` in q's dtype, scratch in buffers made before capture
    (FlashInfer's ``run``, our Triton launchers)."""
    return [(bs * kind.num_heads * kind.head_dim_v * q_elem_bytes, True)]
