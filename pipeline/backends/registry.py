"""Backend registry: names → capability record + lazily imported factory.

Each backend module declares a :class:`Capability` next to its factory; this registry only holds
the import path of the factory, so ``import pipeline`` never imports torch, triton or flashinfer.

Factories have the signature ``factory(ctx: BackendContext) -> AttentionBackend``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional


from pipeline.core.errors import BackendUnavailable, BackendUnknown

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import AttentionArgs, DeviceFacts, LayerKind, ModelSpec
    from pipeline.backends.memory import KVPool, ReqToTokenPool
    from pipeline.backends.workspace import Workspace

from pipeline.backends.capability import FEATURES, Capability  # noqa: E402,F401 (re-exported)


@dataclass
class BackendContext:
    """What a factory receives: facts, pools and its workspace — never the whole runner.

    ``torch_device``: e.g. ``"cpu"`` or ``"cuda:0"``; ``role``: the instance's role in the plan
    (``"primary"``, ``"tbo_child_0"``, ``"pdmux_decode_2"`` …); ``dtype``: model dtype name.
    """

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
    """A registered backend: name, capability record and ``"module:function"`` factory path."""

    name: str
    capability: Capability
    factory: str

    def load_factory(self) -> Callable[[BackendContext], Any]:
        """Import the factory (this is where torch/triton/flashinfer get imported)."""
        mod, _, fn = self.factory.partition(":")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            pk = ", ".join(self.capability.packages) or mod
            raise BackendUnavailable(
                f"backend {self.name!r} could not be imported: {e}",
                flags=[("backend", self.name)],
                remedy=f"install {pk} (pip install 'attn-setup[cuda]'), or choose another backend",
            ) from e
        return getattr(module, fn)


_REGISTRY: dict[str, BackendEntry] = {}

# sglang backend names attn-setup knows but does not implement, with what each is in sglang (for the
# message). What to use instead depends on the request, so resolve computes it (the backends that
# resolve for this device, model and flags) rather than a fixed hint here.
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


def register(name: str, capability: Capability, factory: str) -> None:
    """Add or replace a backend entry (the built-in ones are registered on import of this module)."""
    _REGISTRY[name] = BackendEntry(name=name, capability=capability, factory=factory)


def _ensure_builtins() -> None:
    if not _BUILTINS_LOADED:
        _register_builtins()


def names() -> list[str]:
    """Registered backend names, in priority-free alphabetical order."""
    _ensure_builtins()
    return sorted(_REGISTRY)


def get(name: str, *, flag: str = "attention_backend") -> BackendEntry:
    """The entry for ``name``; raises BackendUnavailable (known sglang name) or BackendUnknown.

    ``flag`` is the field that named it (for the error). Without a request to check against, the
    error's allowed values are every registered backend; resolve narrows them to the ones that
    resolve for its request.
    """
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
    for name, cap, factory in caps.BUILTINS:
        _REGISTRY.setdefault(name, BackendEntry(name=name, capability=cap, factory=factory))
