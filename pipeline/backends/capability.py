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
    """What a backend can serve. Resolve refuses any request outside it, with the reason.

    ``devices``: device types; ``archs``: compute capabilities as ``"sm90"`` strings (None = any,
    e.g. CPU); ``head_dims_qk`` / ``head_dims_v``: supported dims (None = any);
    ``q_dtypes`` / ``kv_dtypes``: torch dtype names; ``features``: subset of :data:`FEATURES`
    (``chunked_local_attention``: Llama-4's chunked layers, a window that resets at chunk boundaries);
    ``page_sizes``: allowed page sizes (None = any >= 1); ``packages``: distributions that must
    be installed (checked by metadata at plan time, by import at run time);
    ``workspace_bytes``: default workspace size in bytes (0 = needs none); ``kv_dtype_matches_q``:
    a 16/32-bit KV-cache dtype must equal the q dtype (the kernels take one element type for both,
    e.g. FlashInfer's fa3 has no bf16×fp16 GMMA and its fa2 wrappers check ``k.dtype``); an fp8
    KV-cache dtype listed in ``kv_dtypes`` is exempt — it is stored as fp8 and dequantized with the
    layer's ``k_scale``/``v_scale`` into q's dtype (:mod:`pipeline.backends.memory`), as FlashInfer's fa2 and
    CUDA-core kernels do with ``q_data_type`` bf16/fp16 and ``kv_data_type`` fp8;
    ``mla_head_dims``: the absorbed ``[qk, v]`` head-dim pairs served for MLA layer kinds (e.g.
    ``[[576, 512]]`` for DeepSeek-V2/V3 and Kimi-K2: ``kv_lora_rank + qk_rope_head_dim`` and
    ``kv_lora_rank``); None = MLA kinds are checked against ``head_dims_qk``/``head_dims_v`` like
    any other; ``fp8_kv_features``: the model features (of :data:`MODEL_FEATURES`) served with an fp8
    KV cache — a model using any other is refused with fp8 (None = every claimed feature);
    ``source``: where the limits come from.
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
    """A backend's own decisions beyond its record, torch-free (its registry entry answers them; None = none).

    ``workspace(args, model, env) -> Setting``: the workspace bytes one instance gets, as the setting that
    is logged (without it: the record's ``workspace_bytes``, not logged).
    ``check_workspace(nbytes, query)``: refuse a workspace of ``nbytes`` too small for the largest batch a
    :class:`WorkspaceQuery` plans (ConfigError ``workspace_too_small``).
    ``workspace_need(query) -> int``: the bytes of workspace that check needs (the least it accepts); None: none.
    ``jit_variants(kinds, q_dtype, kv_dtype, arch) -> list``: the kernel modules a build JIT-compiles
    (what ``attn-setup warmup`` compiles ahead).
    ``graph_decode_allocs(kind, bs, q_elem_bytes) -> [(nbytes, is_output)]``: the device tensors its decode
    forward allocates for one layer of ``kind`` at ``bs`` requests, in order (``is_output``: the tensor it returns;
    the others are freed before it returns) — what a CUDA-graph capture takes from the graph pool
    (:mod:`pipeline.memory.graphs`); None: the output alone (:func:`decode_output_only`).
    ``graph_state_allocs(kinds, batch_sizes, *, max_context_len, page_size, num_sms) -> [(bs, nbytes)]``: the device
    tensors it allocates outside the graph pool for capture and keeps, in order — ``bs`` 0 for
    ``init_cuda_graph_state``, else in ``init_forward_metadata_capture_cuda_graph`` of that size (sizes captured
    largest first); None: none.
    """

    workspace: Optional[Callable[..., Any]] = None
    check_workspace: Optional[Callable[..., None]] = None
    workspace_need: Optional[Callable[..., int]] = None
    jit_variants: Optional[Callable[..., list[Any]]] = None
    graph_decode_allocs: Optional[Callable[..., list[tuple[int, bool]]]] = None
    graph_state_allocs: Optional[Callable[..., list[tuple[int, int]]]] = None


class WorkspaceQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What a workspace check asks of one backend's workspace (build-mode, ``plan`` and ``run``'s preflight).

    ``kinds``: the layer kinds it serves; ``num_sms``: the device's SMs; ``max_reqs``: rows of ``req_to_token``
    (the largest eager batch); ``graph_max_bs``: the largest captured decode batch (0: no graphs).
    For the refusal's remedy: ``graph_bs``: the ``cuda_graph_bs`` list (a remedy that cuts it names the largest size
    it keeps) and ``graph_bs_given`` (the sizes came from it); ``max_bs_given``: ``cuda_graph_max_bs`` was set too
    (the remedy then names that top as well); ``env_var``: the environment variable the size came from ("" when the
    field or the default set it); ``field_given``: the size came from its field (which wins over the variable: the
    remedy names only it); ``max_bytes``: the largest workspace the device holds (0: unknown), which the remedy never
    exceeds; ``fits(ws, bs)``: whether each workspace at ``ws`` bytes fits beside the KV pools and the graphs up to
    ``bs`` (``plan``'s :func:`pipeline.memory.fits.fits_beside`; None: ``max_bytes`` alone). ``graph_mode`` /
    ``graph_tokens``: what the graphs capture (``decode``; a speculative worker's ``target_verify`` or
    ``draft_decode``, ``graph_tokens`` rows per captured request: :func:`states.build_mode.graph_mode`).
    """

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
    """A decode forward that allocates only its output ``[bs, H, Dv]`` in q's dtype (``q_elem_bytes`` each) and
    keeps its scratch in buffers made before capture: FlashInfer's ``run`` (``out`` left to it, or made by our MLA
    path) and our Triton launchers (split scratch from ``init_cuda_graph_state``)."""
    return [(bs * kind.num_heads * kind.head_dim_v * q_elem_bytes, True)]
