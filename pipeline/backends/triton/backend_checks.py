"""What :class:`~pipeline.backends.triton.backend.TritonAttnBackend` serves, checked before any launch.

:func:`kernel_dims` — the layer kinds the registry factory accepts (D == Dv up to 256, or absorbed MLA with one
latent head, ``kv_lora_rank`` up to 512 and rope dims up to 128), refused with ``CapabilityMismatch`` naming the
model's fields; :func:`check_call` — one forward call's layer and batch against the kernels and the pool's buffers
(``CapabilityMismatch`` for what the kernels lack, ``BuildError`` ``forward_input_invalid`` for a layer id, KV buffer
or q that does not match). The launchers' own tensor checks are :mod:`.checks`.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeline.backends.triton.checks import MAX_HEAD_DIM
from pipeline.backends.triton.mla_configs import MLA_MAX_LATENT_DIM, MLA_MAX_ROPE_DIM
from pipeline.core.contracts import LayerKind
from pipeline.core.errors import BuildError, CapabilityMismatch


def call_error(field: str, value: Any, allowed: str, remedy: str) -> BuildError:
    """The BuildError (``forward_input_invalid``, state ``forward``) for a call input that does not match."""
    return BuildError(f"triton backend: {field}={value!r} does not match the layer/batch", code="forward_input_invalid",
                      state="forward", flags=[(field, value)], allowed=[allowed], remedy=remedy)


def check_call(q: Any, layer: Any, fb: Any) -> None:
    """Refuse a forward call the kernels cannot run: a non-MLA layer with D != Dv, an MLA layer with a window, softcap
    or sinks, a layer id outside the pool, a KV buffer of other [Hkv, D] than the layer's, or q not
    [T, H, D] / [T, H*D] for the batch's T new tokens."""
    if not layer.is_mla and layer.head_dim != layer.v_head_dim:
        raise CapabilityMismatch("the triton backend serves D == Dv, or MLA layers",
                                 flags=[("layer.head_dim", layer.head_dim), ("layer.v_head_dim", layer.v_head_dim)],
                                 allowed=["D == Dv", "is_mla"], remedy="use torch_native for this layer")
    if layer.is_mla:
        for name in ("sliding_window", "logit_softcap", "sinks"):
            if getattr(layer, name) is not None:
                raise CapabilityMismatch(f"the triton MLA kernels have no {name}", flags=[(f"layer.{name}", "set")],
                                         allowed=["None"], remedy="use torch_native for this layer")
    pool = fb.token_to_kv_pool
    if not 0 <= layer.layer_id < len(pool.k_buffer):
        raise call_error("layer.layer_id", layer.layer_id, f"0..{len(pool.k_buffer) - 1}", "size the KV pool per layer")
    kb = pool.get_key_buffer(layer.layer_id)
    want = (layer.num_kv_heads, layer.head_dim)
    if tuple(kb.shape[1:]) != want:
        raise call_error("kv_pool.buffer_shape", tuple(kb.shape[1:]), str(want), "build the pool from the layer kinds")
    t, h, d = fb.num_tokens, layer.num_heads, layer.head_dim
    if q.numel() != t * h * d or q.shape[0] != t:
        raise call_error("q.shape", tuple(q.shape), f"[{t}, {h}, {d}] or [{t}, {h * d}]", "pass q for the new tokens")


def kernel_dims(kinds: Sequence[LayerKind]) -> list[tuple[int, int, int, int]]:
    """``(H, Hkv, D, Dv)`` per layer kind, after refusing a kind the kernels cannot serve (CapabilityMismatch)."""
    dims = []
    for kind in kinds:
        if kind.is_mla:
            dv, dr = kind.head_dim_v, kind.head_dim_qk - kind.head_dim_v
            if kind.num_kv_heads != 1 or not 1 <= dv <= MLA_MAX_LATENT_DIM or \
                    not 1 <= dr <= MLA_MAX_ROPE_DIM:
                raise CapabilityMismatch(
                    f"triton MLA kernels cannot serve kv_lora_rank={dv}, rope dims={dr}, kv heads={kind.num_kv_heads}",
                    flags=[("model.kv_lora_rank", dv), ("model.qk_rope_head_dim", dr)],
                    allowed=[f"1 latent head, kv_lora_rank <= {MLA_MAX_LATENT_DIM}, "
                             f"rope dims 1..{MLA_MAX_ROPE_DIM}"],
                    remedy="use flashinfer or torch_native for this model")
        elif kind.head_dim_qk != kind.head_dim_v or kind.head_dim_qk > MAX_HEAD_DIM:
            raise CapabilityMismatch(
                f"triton cannot serve a layer kind with D={kind.head_dim_qk}, Dv={kind.head_dim_v}, mla={kind.is_mla}",
                flags=[("model.head_dim", kind.head_dim_qk), ("model.v_head_dim", kind.head_dim_v)],
                allowed=["D == Dv <= 256, no MLA"], remedy="use flashinfer or torch_native for this model")
        dims.append((kind.num_heads, kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v))
    return dims
