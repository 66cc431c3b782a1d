"""The attention backend interface (sglang's contract), the forward-batch record and the per-call layer check.

Details: docs/internals.md, ``pipeline.backends.base``.
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, TYPE_CHECKING

from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import LayerMismatch

if TYPE_CHECKING:  # pragma: no cover
    import torch


# The methods a closed backend refuses (sglang's backend contract: everything that reads its buffers).
GUARDED_METHODS = ("init_forward_metadata", "init_cuda_graph_state", "init_forward_metadata_capture_cuda_graph",
                   "init_forward_metadata_replay_cuda_graph", "forward", "forward_extend", "forward_decode")
_CLOSED_VIEWS: dict[type, type] = {}


def _refuse(method: str) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        from pipeline.core.errors import BackendClosed

        name = getattr(self, "name", type(self).__name__)
        raise BackendClosed(f"{type(self).__name__}.{method}() was called after close() released this backend",
                            code="backend_closed", state="closed", flags=[("backend", name), ("method", method)],
                            remedy="build new backends with build_attention_backends() (AttentionBackends.close() "
                                   "or a failed start released these); drop references to the old ones")
    refuse.__name__ = method
    return refuse


def mark_closed(backend: Any) -> None:
    """Move ``backend`` to the closed view of its class, whose :data:`GUARDED_METHODS` raise
    :class:`pipeline.core.errors.BackendClosed` (idempotent; attributes and ``isinstance`` are kept)."""
    cls = type(backend)
    if getattr(cls, "_closed_view", False):
        return
    view = _CLOSED_VIEWS.get(cls)
    if view is None:
        ns = {"_closed_view": True, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
              "__doc__": cls.__doc__, **{m: _refuse(m) for m in GUARDED_METHODS}}
        view = _CLOSED_VIEWS[cls] = type(cls)(cls.__name__, (cls,), ns)
    backend.__class__ = view


def _closing(close: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(close)
    def wrapper(self: Any) -> Any:
        out = close(self)
        mark_closed(self)
        return out

    wrapper._marks_closed = True  # type: ignore[attr-defined]
    return wrapper


@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """Per-layer attention parameters (what sglang's ``RadixAttention`` carries).

    Frozen (make a changed layer with :func:`dataclasses.replace`): backends check a layer object
    against what they were built for once (:class:`PlannedLayers`) and trust it afterwards.

    ``sliding_window``: keys visible to a query, itself included (None = full attention).
    ``logit_softcap``: ``cap * tanh(score / cap)`` applied to scaled scores (None = off).
    ``sinks``: [H] float32 per-head sink logits (gpt-oss): an extra softmax term ``exp(sink)`` in
    the denominator that attends to no value (None = off).
    ``is_mla``: absorbed MLA layer (one latent KV head, D = kv_lora_rank + rope dim, Dv = kv_lora_rank).
    ``attention_chunk_size``: chunked local attention (Llama-4): key j is visible from query i iff
    ``j <= i`` and ``j // C == i // C`` (None = off); served by backends claiming ``chunked_local_attention``.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float
    sliding_window: Optional[int] = None
    logit_softcap: Optional[float] = None
    sinks: Optional["torch.Tensor"] = None
    is_mla: bool = False
    attention_chunk_size: Optional[int] = None

    @classmethod
    def from_kind(cls, kind: LayerKind, layer_id: int, sinks: Optional["torch.Tensor"] = None) -> "AttentionLayer":
        """Layer ``layer_id`` of ``kind`` (a :class:`LayerKind` of ``ModelSpec.layer_kinds()``): the kind's heads, head
        dims (``head_dim_qk`` → ``head_dim``, ``head_dim_v`` → ``v_head_dim``), scale, window, softcap, MLA and chunk
        size, as the backends built for it check them. ``sinks`` [H] float32: the layer's sink logits, needed by
        (and only by) a kind with ``has_sinks``. Raises :class:`~pipeline.core.errors.LayerMismatch` for a
        ``layer_id`` not of ``kind`` or sinks given or missing against the kind."""
        if layer_id not in kind.layer_ids:
            raise LayerMismatch(f"layer {layer_id} is not a {kind.kind} layer of this kind (its layers: "
                                f"{_ranges(sorted(kind.layer_ids))})", state="forward", flags=[("layer_id", layer_id)],
                                allowed=[_ranges(sorted(kind.layer_ids))],
                                remedy="take each layer from attention_layers(spec), or its own kind")
        if (sinks is not None) != kind.has_sinks:
            raise LayerMismatch(f"layer {layer_id}: its kind {'has' if kind.has_sinks else 'has no'} attention sinks, "
                                f"and sinks were {'given' if sinks is not None else 'not given'}", state="forward",
                                flags=[("layer_id", layer_id), ("sinks", sinks is not None)],
                                allowed=[str(kind.has_sinks)],
                                remedy="pass the layer's [num_heads] float32 sink logits" if kind.has_sinks else
                                       "drop sinks: this kind has none")
        return cls(layer_id=layer_id, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                   head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                   sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=sinks,
                   is_mla=kind.is_mla, attention_chunk_size=kind.attention_chunk_size)


def attention_layers(spec: Any, sinks: Optional[Mapping[int, "torch.Tensor"]] = None) -> list[AttentionLayer]:
    """Every attention layer of ``spec`` (a ``ModelSpec``) as the :class:`AttentionLayer` its backends expect, in
    layer-id order (layers no attention backend computes, e.g. linear attention, are not in it):
    :meth:`AttentionLayer.from_kind` over ``spec.layer_kinds()``. ``sinks``: layer id → its sink logits, for the
    layers of a kind with sinks (gpt-oss)."""
    sinks = sinks or {}
    layers = [AttentionLayer.from_kind(k, lid, sinks.get(lid)) for k in spec.layer_kinds() for lid in k.layer_ids]
    return sorted(layers, key=lambda layer: layer.layer_id)


class LayerField(NamedTuple):
    """One parameter a backend is built for: its name (the :class:`AttentionLayer` attribute used in
    errors), how to read it from the call's layer and from the planned :class:`LayerKind`."""

    name: str
    of_layer: Callable[[Any], Any]
    of_kind: Callable[[LayerKind], Any]


# What a call's layer must share with the kind its id was built for. FlashInfer compiles window and
# softcap into its kernels and takes scale / heads / dims per planned wrapper (``plan(window_left=...,
# logits_soft_cap=..., sm_scale=...)``); sglang's trtllm_mha backend likewise passes the window it read
# from the model runner at init (``window_left=self.sliding_window_size``), not the layer's, to every
# call. One row per compared field: a new per-layer parameter is one more row here.
LAYER_FIELDS: tuple[LayerField, ...] = (
    LayerField("num_heads", attrgetter("num_heads"), attrgetter("num_heads")),
    LayerField("num_kv_heads", attrgetter("num_kv_heads"), attrgetter("num_kv_heads")),
    LayerField("head_dim", attrgetter("head_dim"), attrgetter("head_dim_qk")),
    LayerField("v_head_dim", attrgetter("v_head_dim"), attrgetter("head_dim_v")),
    LayerField("is_mla", attrgetter("is_mla"), attrgetter("is_mla")),
    LayerField("scaling", attrgetter("scaling"), attrgetter("scaling")),
    LayerField("sliding_window", attrgetter("sliding_window"), attrgetter("sliding_window")),
    LayerField("logit_softcap", attrgetter("logit_softcap"), attrgetter("logit_softcap")),
    LayerField("sinks", lambda layer: layer.sinks is not None, attrgetter("has_sinks")),
    LayerField("attention_chunk_size", attrgetter("attention_chunk_size"), attrgetter("attention_chunk_size")),
)


def _same(call: Any, built: Any) -> bool:
    """Equal, with floats compared to 1e-6 relative (a scale computed in float32 by an engine still matches)."""
    if isinstance(call, float) and isinstance(built, float):
        return math.isclose(call, built, rel_tol=1e-6)
    return call == built


def check_layer(planned: "PlannedLayers", layer: Any) -> LayerKind:
    """Compare ``layer`` with the kind its ``layer_id`` was built for; returns that kind.

    Raises :class:`~pipeline.core.errors.LayerMismatch` naming the backend, its role, the layer id, the
    field, the call's value and the built value — for the first field of :data:`LAYER_FIELDS`
    that differs, or for a layer id the backend was not built for. Host-only work (no device access).
    """
    lid = layer.layer_id
    kind = planned.by_id.get(lid)
    who = f"the {planned.backend} backend ({planned.role})"
    if kind is None:
        built = sorted(planned.by_id)
        raise LayerMismatch(
            f"layer {lid} was called on {who}, which was built for layers {_ranges(built)} only",
            state="forward", flags=[("layer_id", lid)], allowed=[_ranges(built)],
            remedy="build the backend from the ModelSpec whose layers the model calls (its layer_kinds())")
    for f in LAYER_FIELDS:
        call, want = f.of_layer(layer), f.of_kind(kind)
        if not _same(call, want):
            raise LayerMismatch(
                f"layer {lid}: {f.name}={call!r} in the call, but {who} was built for {f.name}={want!r} "
                f"({kind.kind} layers)", state="forward",
                flags=[("layer_id", lid), (f"layer.{f.name}", call)], allowed=[repr(want)],
                remedy=f"build the backend from a ModelSpec whose {kind.kind} layers have {f.name}={call!r}, "
                       f"or call it with the layers of the ModelSpec it was built from")
    return kind


def _ranges(ids: Sequence[int]) -> str:
    """Sorted ids as spans: ``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


class PlannedLayers:
    """The layer kinds one backend instance was built for, and the check of each call's layer.

    ``kinds``: the :class:`LayerKind` list of the build (``BackendContext.layer_kinds``);
    ``backend``/``role``: named in errors. :meth:`check` compares a layer with its kind (see
    :func:`check_layer`) the first time a layer object is seen under its id and remembers the object:
    later calls cost one dict lookup and an identity test, no device access and no growing state
    (one entry per layer id). :class:`AttentionLayer` is frozen, so a remembered object cannot change.
    """

    __slots__ = ("kinds", "by_id", "backend", "role", "dtype", "_seen")

    def __init__(self, kinds: Sequence[LayerKind], *, backend: str, role: str, dtype: Optional[str] = None) -> None:
        self.kinds = list(kinds)
        self.by_id = {lid: k for k in self.kinds for lid in k.layer_ids}
        self.backend, self.role, self.dtype = backend, role, dtype
        self._seen: dict[int, Any] = {}

    def check(self, layer: Any, q: Any = None) -> None:
        """Raise :class:`~pipeline.core.errors.LayerMismatch` unless ``layer`` matches what was built for its id and
        ``q`` (when given) is in the dtype the backend was built for (``dtype``, the model's: sglang's backends take
        q in the model dtype and return it; another dtype would be computed and returned silently). Checked when a
        layer object or q's dtype is new for its id."""
        seen = self._seen.get(layer.layer_id)
        qd = None if q is None else q.dtype
        if seen is None or seen[0] is not layer or seen[1] is not qd:
            check_layer(self, layer)
            if qd is not None and self.dtype is not None and str(qd) != f"torch.{self.dtype}":
                got = str(qd).replace("torch.", "")
                raise LayerMismatch(
                    f"layer {layer.layer_id}: q is {got} in the call, but the {self.backend} backend ({self.role}) "
                    f"was built for {self.dtype} activations", state="forward",
                    flags=[("layer_id", layer.layer_id), ("q.dtype", got)], allowed=[self.dtype],
                    remedy=f"pass q (and k, v) as {self.dtype}, the model dtype the backend was built for "
                           f"(q.to(torch.{self.dtype})), or build it for {got}")
            self._seen[layer.layer_id] = (layer, qd)


@dataclass
class ForwardBatch:
    """One forward step's batch, as the backends see it (sglang's ``ForwardBatch`` subset).

    ``req_pool_indices``: [B] int64 rows of ``req_to_token``.
    ``seq_lens``: [B] int32, tokens per request *after* this step (prefix + new).
    ``extend_prefix_lens`` / ``extend_seq_lens``: [B] int32, cached prefix and new tokens
    (extend only; for decode every request has exactly one new token).
    ``out_cache_loc``: [T] int64 KV slots for the new tokens, in batch order.
    ``positions``: [T] int64 position of each new token.
    ``*_cpu``: host copies (Python lists) for planning without a device sync.
    ``spec_info``: a :class:`~pipeline.backends.speculative.SpecInfo` for ``TARGET_VERIFY`` (the trees; extend
    fields as for an extend of their tokens) and ``DRAFT_DECODE`` (B requests, ``B * topk`` rows: ``out_cache_loc``,
    ``positions`` and q have one per branch; ``seq_lens`` are the committed prefixes); None otherwise.
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: "torch.Tensor"
    seq_lens: "torch.Tensor"
    out_cache_loc: "torch.Tensor"
    positions: "torch.Tensor"
    req_to_token_pool: Any  # pipeline.backends.memory.ReqToTokenPool (which imports this module)
    token_to_kv_pool: Any  # pipeline.backends.memory.KVPool
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens: Optional["torch.Tensor"] = None
    extend_seq_lens: Optional["torch.Tensor"] = None
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    spec_info: Any = None  # pipeline.backends.speculative.SpecInfo (which imports torch)

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def is_decode(self) -> bool:
        return self.forward_mode is ForwardMode.DECODE

    def is_extend(self) -> bool:
        """An extend-shaped batch: extend, draft extend or target verify (sglang's ``is_extend`` includes verify)."""
        return self.forward_mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self.forward_mode is ForwardMode.TARGET_VERIFY

    def is_draft_decode(self) -> bool:
        return self.forward_mode is ForwardMode.DRAFT_DECODE


class AttentionBackend(abc.ABC):
    """Base class of every backend (sglang's ``AttentionBackend`` contract).

    Subclasses implement :meth:`forward_extend` and :meth:`forward_decode`; CUDA-graph hooks
    raise :class:`NotImplementedError` unless the backend's capability record claims
    ``cuda_graph``. :meth:`close` releases every buffer the backend owns (idempotent).

    After the annotate state, ``prefill_attention_backend_str`` and
    ``decode_attention_backend_str`` hold the resolved names (as sglang sets them).

    After :meth:`close` (any subclass's), every forward, metadata and CUDA-graph method raises
    :class:`pipeline.core.errors.BackendClosed` instead of touching released buffers: ``close`` moves
    the instance to a closed view of its class (:func:`mark_closed`), so no forward call pays for
    a check.
    """

    name: str = "base"
    prefill_attention_backend_str: Optional[str] = None
    decode_attention_backend_str: Optional[str] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        close = cls.__dict__.get("close")
        if close is not None and not getattr(close, "_marks_closed", False):
            cls.close = _closing(close)  # type: ignore[method-assign]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan one forward batch (host metadata, index buffers) before the layers run."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate fixed-address metadata buffers for CUDA-graph capture (``max_bs`` requests)."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: "torch.Tensor", seq_lens: "torch.Tensor",
        encoder_lens: Any, forward_mode: ForwardMode, spec_info: Any,
    ) -> None:
        """Fill the graph metadata buffers for capture at batch size ``bs``."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: "torch.Tensor", seq_lens: "torch.Tensor", seq_lens_sum: int,
        encoder_lens: Any, forward_mode: ForwardMode, spec_info: Any, seq_lens_cpu: Optional["torch.Tensor"],
    ) -> None:
        """Refresh the graph metadata buffers (outside the graph) before a replay."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length written into padded graph slots (sglang uses 1 for most backends)."""
        return 1

    def forward(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", layer: AttentionLayer,
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> "torch.Tensor":
        """Run attention for one layer; dispatches on ``forward_batch.forward_mode``.

        Returns [T, H*Dv] in q's dtype. With ``save_kv_cache`` the new K/V are first written to
        ``out_cache_loc`` of layer ``layer.layer_id``. Decode and draft decode go to :meth:`forward_decode`; extend,
        draft extend and target verify to :meth:`forward_extend`.
        """
        if forward_batch.forward_mode.is_decode_like:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)

    @abc.abstractmethod
    def forward_extend(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> "torch.Tensor":
        """Extend: new tokens attend to their cached prefix and causally to each other."""

    @abc.abstractmethod
    def forward_decode(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> "torch.Tensor":
        """Decode: one new token per request attends to everything cached before it and itself."""

    def owned_buffers(self) -> list[Any]:
        """Tensors this backend allocated (for release accounting); wrappers include children."""
        return []

    def close(self) -> None:
        """Release every buffer this backend owns; calling twice is harmless."""


AttentionBackend.close = _closing(AttentionBackend.close)  # type: ignore[method-assign]

