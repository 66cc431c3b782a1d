"""The ``flashinfer`` and ``fa3`` backends' own rules, torch-free: what their registry entries answer.

- **workspace**: ``flashinfer_workspace_size`` when set, else ``SGLANG_FLASHINFER_WORKSPACE_SIZE``,
  else sglang's default (:func:`flashinfer_workspace_size`); logged as ``setting_resolved``.
- **workspace check**: the bytes FlashInfer's scheduler can ask for at the largest planned batch
  (:func:`pipeline.backends.flashinfer_workspace_check.check_backend_workspace`), checked in build-mode, ``plan``
  and ``run``'s preflight before anything is allocated.
- **JIT variants**: the kernel modules a build compiles (:func:`pipeline.backends.flashinfer_jit.variants_for`):
  FA2 prefill plus CUDA-core decode for ``flashinfer``, FA3 prefill for ``fa3``.

The records list them (:data:`pipeline.backends.records.BUILTINS`); resolve, build-mode, plan, warmup
and replay ask the entries, never these names.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from pipeline.backends import flashinfer_sizing as sizing, flashinfer_workspace_check as wscheck
from pipeline.backends.capability import BackendRules, decode_output_only
from pipeline.core.contracts import AttentionArgs, ModelSpec
from pipeline.core.settings import Setting, Source, explicit_or_env, setting

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.backends.flashinfer_jit import Variant

MiB = 1 << 20
FLASHINFER_WORKSPACE_DEFAULT = 384 * MiB
FLASHINFER_WORKSPACE_QWEN = 512 * MiB
# sglang's FlashInferAttnBackend.__init__ (python/sglang/srt/layers/attention/flashinfer_backend.py,
# sgl-project/sglang at 0005834c, "Qwen2/Qwen3 models require higher flashinfer workspace size")
# raises the workspace to 512 MiB when hf_config.architectures contains one of these names, and
# keys on nothing else: not model_type, so Qwen2-MoE, Qwen3-MoE, Qwen2-VL and Qwen2.5-VL keep 384 MiB
# while MiMo gets 512 MiB. sglang assigns the value inside the backend, so there it also beats an
# env var; here explicit field > env var > this default, so an explicit value is never replaced.
WORKSPACE_512_MIB_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM",
                                   "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
FIELD = "flashinfer_workspace_size"


def flashinfer_workspace_size(args: AttentionArgs, model: ModelSpec,
                              env: Mapping[str, str] = os.environ) -> tuple[int, Source]:
    """Bytes of the FlashInfer workspace buffer and where the value came from.

    ``flashinfer_workspace_size`` when set, else ``SGLANG_FLASHINFER_WORKSPACE_SIZE``, else 512 MiB
    when ``model.architectures`` names one of :data:`WORKSPACE_512_MIB_ARCHITECTURES` (sglang's
    rule, matched on the architecture name exactly as sglang does) and 384 MiB otherwise.
    Raises ConfigError for an env value that is not a byte count.
    """
    given = explicit_or_env(args, FIELD, env)
    if given is not None:
        return given
    big = any(a in WORKSPACE_512_MIB_ARCHITECTURES for a in model.architectures)
    return (FLASHINFER_WORKSPACE_QWEN if big else FLASHINFER_WORKSPACE_DEFAULT), "default"


def workspace(args: AttentionArgs, model: ModelSpec, env: Mapping[str, str]) -> Setting:
    """The workspace one ``flashinfer``/``fa3`` instance gets, as the :class:`Setting` that is logged."""
    return setting(FIELD, *flashinfer_workspace_size(args, model, env))


def _checker(kernel: str) -> Any:
    def check(nbytes: int, kinds: Sequence[Any], *, num_sms: int, max_reqs: int, graph_max_bs: int,
              graph_bs_given: bool = False, env_var: str = "", max_bytes: int = 0, field_given: bool = False,
              fits: Any = None, graph_bs: Sequence[int] = (), max_bs_given: bool = False) -> None:
        wscheck.check_backend_workspace(nbytes, kinds, backend=kernel, num_sms=num_sms, max_reqs=max_reqs,
                                       graph_max_bs=graph_max_bs, graph_bs_given=graph_bs_given, env_var=env_var,
                                       max_bytes=max_bytes, field_given=field_given, fits=fits, graph_bs=graph_bs,
                                       max_bs_given=max_bs_given)
    return check


def _need(kernel: str) -> Any:
    def need(kinds: Sequence[Any], *, num_sms: int, max_reqs: int, graph_max_bs: int) -> int:
        return wscheck.backend_need(kinds, backend=kernel, num_sms=num_sms, max_reqs=max_reqs,
                                    graph_max_bs=graph_max_bs)
    return need


def _variants(prefill: str) -> Any:
    def variants(kinds: Sequence[Any], q_dtype: str, kv_dtype: str, arch: str) -> list["Variant"]:
        from pipeline.backends.flashinfer_jit import variants_for  # its module imports multiprocessing: not for plan

        return variants_for(kinds, prefill, q_dtype, kv_dtype, arch)
    return variants


# Every FlashInfer wrapper allocates its own int workspace on the device (8 MiB: ``_int_workspace_buffer`` of
# BatchDecodeWithPagedKVCacheWrapper and BatchPrefillWithPagedKVCacheWrapper in ``__init__``; FlashInfer 0.7.2's
# BatchMLAPagedAttentionWrapper in its fa2/fa3 backend object at the first ``plan()``, which a CUDA-graph wrapper's
# later plans reuse — before capture either way); prefill-class wrappers also a ``_kv_lens_buffer`` of 32768 int32.
FI_INT_WORKSPACE_BYTES = 8 * MiB
FI_KV_LENS_BYTES = 32768 * 4


def graph_state_allocs(kinds: Sequence[Any], batch_sizes: Sequence[int], *, max_context_len: int, page_size: int,
                       num_sms: int) -> list[tuple[int, int]]:
    """What decode-graph capture allocates outside the graph pool, in order (``[(bs, nbytes)]``, bs 0 first):
    :class:`pipeline.backends.flashinfer_graph.GraphState`'s int32 buffers for the largest size (``indptr``,
    ``indices`` of ``max_bs * ceil(max_context_len / page_size)`` pages, ``last_page_len``, ``qo_indptr``,
    ``kv_len``), then per captured size and layer kind the ``use_cuda_graph`` wrapper made for it — its own 8 MiB
    int workspace (:data:`FI_INT_WORKSPACE_BYTES`), a prefill-class (sink) wrapper's kv-lens buffer, a tensor-core
    decode wrapper's ``qo_indptr`` [bs+1] int32. sglang's FlashInfer backend makes its capture wrappers per size
    the same way."""
    mb = max(batch_sizes)
    pages = -(-max_context_len // max(page_size, 1))
    out = [(0, (mb + 1) * 4), (0, mb * pages * 4), (0, mb * 4), (0, (mb + 1) * 4), (0, mb * 4)]
    for bs in sorted(set(batch_sizes), reverse=True):
        for k in kinds:
            out.append((bs, FI_INT_WORKSPACE_BYTES))
            if k.has_sinks and not k.is_mla:
                out.append((bs, FI_KV_LENS_BYTES))
            elif not k.is_mla and sizing.use_tensor_core_decode(k.num_heads // k.num_kv_heads, bs):
                out.append((bs, (bs + 1) * 4))
    return out


# CUDA-graph memory: decode allocates only its output inside a capture (``run`` makes ``out`` [bs, H, Dv]; the MLA
# path makes it before calling ``run``); the split scratch lives in the workspace, made before capture.
FLASHINFER_RULES = BackendRules(workspace=workspace, check_workspace=_checker("flashinfer"),
                                workspace_need=_need("flashinfer"),
                                jit_variants=_variants("fa2"), graph_decode_allocs=decode_output_only,
                                graph_state_allocs=graph_state_allocs)
FA3_RULES = BackendRules(workspace=workspace, check_workspace=_checker("fa3"), workspace_need=_need("fa3"),
                         jit_variants=_variants("fa3"),
                         graph_decode_allocs=decode_output_only, graph_state_allocs=graph_state_allocs)
