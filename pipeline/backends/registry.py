"""Backend registry: names → entries, each with its capability record, its rules and a lazily imported factory
(docs/internals.md)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from pipeline.backends.capability import BackendRules, Capability, WorkspaceQuery
from pipeline.backends.packages import install_hint
from pipeline.core.errors import BackendUnavailable, BackendUnknown
from pipeline.core.settings import Setting

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import AttentionArgs, DeviceFacts, LayerKind, ModelSpec
    from pipeline.backends.memory import KVPool, ReqToTokenPool
    from pipeline.backends.workspace import Workspace


@dataclass
class BackendContext:
    """What a factory receives: facts, pools and its workspace — never the whole runner. ``torch_device``
    (``"cuda:0"``), ``role`` (``"primary"``, ``"tbo_child_0"`` …), ``dtype``: model dtype name."""

    name: str
    role: str
    device: "DeviceFacts"
    torch_device: str
    model: "ModelSpec"
    layer_kinds: list["LayerKind"]
    args: "AttentionArgs"
    req_to_token_pool: "ReqToTokenPool"
    kv_pool: "KVPool"
    workspace: Optional["Workspace"]
    dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: name, capability record, ``"module:function"`` factory path and its rules."""

    name: str
    capability: Capability
    factory: str
    rules: BackendRules = field(default_factory=BackendRules)

    @property
    def graphs(self) -> bool:
        """Whether its decode can be captured in a CUDA graph (the ``cuda_graph`` feature of its record)."""
        return self.capability.has("cuda_graph")

    def workspace(self, args: "AttentionArgs", model: "ModelSpec", env: Mapping[str, str] = os.environ) -> Setting:
        """The workspace bytes one instance gets: its rule's :class:`Setting` (logged as ``setting_resolved``),
        or the record's ``workspace_bytes`` (source ``default``, field ``""``: nothing to log)."""
        if self.rules.workspace is not None:
            return self.rules.workspace(args, model, env)
        return Setting(field="", value=self.capability.workspace_bytes, source="default")

    def check_workspace(self, nbytes: int, query: WorkspaceQuery) -> None:
        """Refuse a workspace of ``nbytes`` too small for the largest batch ``query`` plans (ConfigError
        ``workspace_too_small``); no rule, no check."""
        if self.rules.check_workspace is not None:
            self.rules.check_workspace(nbytes, query)

    def workspace_need(self, query: WorkspaceQuery) -> int:
        """Bytes of workspace :meth:`check_workspace` needs for ``query`` — the least it accepts; 0 for a backend
        without such a rule."""
        return 0 if self.rules.workspace_need is None else self.rules.workspace_need(query)

    def jit_variants(self, kinds: Sequence["LayerKind"], q_dtype: str, kv_dtype: str, arch: str) -> list[Any]:
        """The kernel modules a build of this backend JIT-compiles for ``kinds`` (none for most backends)."""
        return [] if self.rules.jit_variants is None else self.rules.jit_variants(kinds, q_dtype, kv_dtype, arch)

    def graph_decode_allocs(self, kind: "LayerKind", bs: int, q_elem_bytes: int) -> list[tuple[int, bool]]:
        """``[(nbytes, is_output)]`` its decode forward allocates for one layer of ``kind`` at ``bs`` requests, in
        order; default: the output alone."""
        from pipeline.backends.capability import decode_output_only

        rule = self.rules.graph_decode_allocs or decode_output_only
        return rule(kind, bs, q_elem_bytes)

    def graph_state_allocs(self, kinds: Sequence["LayerKind"], batch_sizes: Sequence[int], *, max_context_len: int,
                           page_size: int, num_sms: int, mode: str = "decode",
                           tokens_per_req: int = 1) -> list[tuple[int, int]]:
        """``[(bs, nbytes)]`` allocated outside the graph pool for capture and kept (``bs`` 0: graph state and
        speculative buffers; else per size, largest first); ``mode`` with ``tokens_per_req`` rows per request."""
        if self.rules.graph_state_allocs is None:
            return []
        kw = {} if mode == "decode" else {"mode": mode, "tokens_per_req": tokens_per_req}
        return self.rules.graph_state_allocs(kinds, batch_sizes, max_context_len=max_context_len, page_size=page_size,
                                             num_sms=num_sms, **kw)

    def load_factory(self) -> Callable[[BackendContext], Any]:
        """Import the factory (this is where torch/triton/flashinfer get imported)."""
        mod, _, fn = self.factory.partition(":")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            pk = list(self.capability.packages) or [mod]
            raise BackendUnavailable(
                f"backend {self.name!r} could not be imported: {e}",
                flags=[("backend", self.name)],
                remedy=f"install {', '.join(pk)} ({'; '.join(install_hint(p) for p in pk)}: the versions attn-setup "
                       "supports), or choose another backend",
            ) from e
        return getattr(module, fn)


_REGISTRY: dict[str, BackendEntry] = {}

# sglang backend names attn-setup knows but does not implement, with what each is (resolve computes alternatives).
KNOWN_UNAVAILABLE: dict[str, str] = {
    "trtllm_mha": "TensorRT-LLM MHA kernels",
    "trtllm_mla": "TensorRT-LLM MLA kernels",
    "flashmla": "DeepSeek FlashMLA kernels",
    "cutlass_mla": "CUTLASS MLA kernels",
    "aiter": "AMD AITER kernels",
    "wave": "AMD Wave kernels",
    "ascend": "Ascend NPU kernels",
    "intel_amx": "Intel AMX CPU kernels",
    "intel_xpu": "Intel XPU kernels",
    "flex_attention": "torch flex_attention",
    "dual_chunk_flash_attn": "dual-chunk flash attention",
    "fa4": "FlashAttention-4 kernels",
    "nsa": "native sparse attention",
    "hybrid_linear_attn": "the linear-attention hybrid wrapper",
}


def known_names() -> list[str]:
    """Every backend name attn-setup knows: the registered ones and sglang's that it does not implement."""
    return sorted(set(names()) | set(KNOWN_UNAVAILABLE))


def register(name: str, capability: Capability, factory: str, rules: Optional[BackendRules] = None) -> None:
    """Add or replace a backend entry (the built-in ones are registered on first lookup)."""
    _REGISTRY[name] = BackendEntry(name=name, capability=capability, factory=factory, rules=rules or BackendRules())


def _ensure_builtins() -> None:
    if not _BUILTINS_LOADED:
        _register_builtins()


def names() -> list[str]:
    """Registered backend names, in priority-free alphabetical order."""
    _ensure_builtins()
    return sorted(_REGISTRY)


def get(name: str, *, flag: str = "attention_backend") -> BackendEntry:
    """The entry for ``name`` (``flag`` names the field); raises BackendUnavailable (known sglang name) or
    BackendUnknown listing every registered backend."""
    _ensure_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in KNOWN_UNAVAILABLE:
        raise BackendUnavailable(
            f"backend {name!r} is known (sglang's {KNOWN_UNAVAILABLE[name]}) but not available in attn-setup",
            flags=[(flag, name)],
            allowed=names(),
            remedy=f"set {flag} to one of: {', '.join(names())}",
        )
    raise BackendUnknown(
        f"unknown attention backend {name!r}",
        flags=[(flag, name)],
        allowed=names(),
        remedy=f"set {flag} to one of: {', '.join(names())}",
    )


_BUILTINS_LOADED = False


def _register_builtins() -> None:
    """Register the built-in records (on first lookup, so either module may be imported first)."""
    global _BUILTINS_LOADED
    from pipeline.backends import records as caps

    _BUILTINS_LOADED = True
    for name, cap, factory, rules in caps.BUILTINS:
        _REGISTRY.setdefault(name, BackendEntry(name=name, capability=cap, factory=factory, rules=rules))


def reference_name() -> str:
    """The reference backend (correct everywhere, slow, no CUDA graphs): auto-selection landing on it on an
    accelerator is a ``reference_fallback`` warning, refused under ``strict``."""
    from pipeline.backends import records

    return records.REFERENCE_BACKEND


def auto_candidates(device_type: str, arch: str = "", mla: bool = False) -> list[str]:
    """The backends auto-selection considers on ``device_type``, in priority order: for MLA on an ``arch`` with
    :data:`pipeline.backends.records.MLA_DECODE_US` the measured ones fastest first, then
    :data:`~pipeline.backends.records.AUTO_PRIORITY`."""
    from pipeline.backends import records

    known = set(names())
    base = [n for n in records.AUTO_PRIORITY.get(device_type, records.DEFAULT_PRIORITY) if n in known]
    timed = records.MLA_DECODE_US.get(arch, {}) if mla else {}
    fast = sorted((n for n in base if n in timed), key=lambda n: timed[n])
    return fast + [n for n in base if n not in timed]
