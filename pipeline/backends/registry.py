"""Backend registry: names → entries, each with its capability record, its rules and a lazily imported factory.

An entry answers every backend-specific question the rest of the package asks, torch-free: may it serve
this request (its :class:`Capability`, checked by :mod:`states.capability_check`), how large is its
workspace and is it large enough (:meth:`BackendEntry.workspace`, :meth:`BackendEntry.check_workspace`), can
its decode be captured in a CUDA graph (:attr:`BackendEntry.graphs`), which kernels does it JIT-compile
(:meth:`BackendEntry.jit_variants`); the per-call layer check is each backend's own
(:class:`pipeline.backends.base.PlannedLayers`). The registry also names the reference backend and the
auto-selection order (:func:`reference_name`, :func:`auto_candidates`). Outside ``pipeline/backends/`` no
code names a backend. The registry holds only the import path of each factory, so ``import pipeline``
never imports torch, triton or flashinfer.

Factories have the signature ``factory(ctx: BackendContext) -> AttentionBackend``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from pipeline.backends.capability import FEATURES, BackendRules, Capability  # noqa: F401 (re-exported)
from pipeline.backends.packages import install_hint  # noqa: F401 (the registry answers it for resolve)
from pipeline.core.errors import BackendUnavailable, BackendUnknown
from pipeline.core.settings import Setting

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.core.contracts import AttentionArgs, DeviceFacts, LayerKind, ModelSpec
    from pipeline.backends.memory import KVPool, ReqToTokenPool
    from pipeline.backends.workspace import Workspace


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

    def check_workspace(self, nbytes: int, kinds: Sequence["LayerKind"], *, num_sms: int, max_reqs: int,
                        graph_max_bs: int, graph_bs_given: bool = False, env_var: str = "",
                        max_bytes: int = 0, field_given: bool = False, fits: Any = None,
                        graph_bs: Sequence[int] = (), max_bs_given: bool = False) -> None:
        """Refuse a workspace of ``nbytes`` too small for the largest batch this backend plans over ``kinds``
        (ConfigError ``workspace_too_small``); a backend without such a rule needs no check. ``env_var``: the
        environment variable the size came from, if it did (the error then names it and its value);
        ``max_bytes``: the largest workspace the device holds (0: unknown), which the remedy never exceeds;
        ``field_given``: the size came from its field (which wins over the variable: the remedy names only it);
        ``fits(ws, bs)``: whether each workspace at ``ws`` bytes fits beside the KV pools and the graphs up to
        ``bs`` (``plan``'s, :func:`states.workspace_remedy_check.fits_beside`; None: ``max_bytes`` alone), which
        every alternative of the remedy then does; ``graph_bs``: the ``cuda_graph_bs`` list and ``max_bs_given``:
        ``cuda_graph_max_bs`` set too, so that a remedy cutting the list names a size of it and that top."""
        if self.rules.check_workspace is not None:
            self.rules.check_workspace(nbytes, kinds, num_sms=num_sms, max_reqs=max_reqs, graph_max_bs=graph_max_bs,
                                       graph_bs_given=graph_bs_given, env_var=env_var, max_bytes=max_bytes,
                                       field_given=field_given, fits=fits, graph_bs=graph_bs,
                                       max_bs_given=max_bs_given)

    def workspace_need(self, kinds: Sequence["LayerKind"], *, num_sms: int, max_reqs: int, graph_max_bs: int) -> int:
        """Bytes of workspace :meth:`check_workspace` needs for ``kinds`` with ``max_reqs`` rows and graphs up to
        ``graph_max_bs`` (0: none) — the least it accepts; 0 for a backend without such a rule."""
        if self.rules.workspace_need is None:
            return 0
        return self.rules.workspace_need(kinds, num_sms=num_sms, max_reqs=max_reqs, graph_max_bs=graph_max_bs)

    def jit_variants(self, kinds: Sequence["LayerKind"], q_dtype: str, kv_dtype: str, arch: str) -> list[Any]:
        """The kernel modules a build of this backend JIT-compiles for ``kinds`` (none for most backends)."""
        return [] if self.rules.jit_variants is None else self.rules.jit_variants(kinds, q_dtype, kv_dtype, arch)

    def graph_decode_allocs(self, kind: "LayerKind", bs: int, q_elem_bytes: int) -> list[tuple[int, bool]]:
        """``[(nbytes, is_output)]`` its decode forward allocates for one layer of ``kind`` at ``bs`` requests, in
        order (the CUDA-graph memory estimate replays them: :mod:`states.graph_memory`); without a rule of its
        own, the output ``[bs, H, Dv]`` in q's dtype alone."""
        from pipeline.backends.capability import decode_output_only

        rule = self.rules.graph_decode_allocs or decode_output_only
        return rule(kind, bs, q_elem_bytes)

    def graph_state_allocs(self, kinds: Sequence["LayerKind"], batch_sizes: Sequence[int], *, max_context_len: int,
                           page_size: int, num_sms: int) -> list[tuple[int, int]]:
        """``[(bs, nbytes)]`` it allocates outside the graph pool for decode-graph capture and keeps (``bs`` 0:
        ``init_cuda_graph_state``; else that size's capture-time metadata, sizes largest first); none without a
        rule of its own."""
        if self.rules.graph_state_allocs is None:
            return []
        return self.rules.graph_state_allocs(kinds, batch_sizes, max_context_len=max_context_len, page_size=page_size,
                                             num_sms=num_sms)

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
    for name, cap, factory, rules in caps.BUILTINS:
        _REGISTRY.setdefault(name, BackendEntry(name=name, capability=cap, factory=factory, rules=rules))


def reference_name() -> str:
    """The reference backend (correct everywhere, slow, no CUDA graphs): auto-selection landing on it on an
    accelerator is a ``reference_fallback`` warning, refused under ``strict``."""
    from pipeline.backends import records

    return records.REFERENCE_BACKEND


def auto_candidates(device_type: str, arch: str = "", mla: bool = False) -> list[str]:
    """The registered backends auto-selection considers on ``device_type``, in priority order.

    For an MLA model (``mla``) on an ``arch`` with measured MLA decode times
    (:data:`pipeline.backends.records.MLA_DECODE_US`) the measured backends come first, fastest first, then the
    rest of :data:`~pipeline.backends.records.AUTO_PRIORITY` in its order (sglang picks per arch by hand: fa3 on
    Hopper, where our fa3 serves no MLA; vLLM walks a priority list; we let the measurement order it).
    """
    from pipeline.backends import records

    known = set(names())
    base = [n for n in records.AUTO_PRIORITY.get(device_type, records.DEFAULT_PRIORITY) if n in known]
    timed = records.MLA_DECODE_US.get(arch, {}) if mla else {}
    fast = sorted((n for n in base if n in timed), key=lambda n: timed[n])
    return fast + [n for n in base if n not in timed]
