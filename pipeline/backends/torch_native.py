"""torch_native: the reference backend — plain torch attention over the paged KV cache (docs/internals.md)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from pipeline.backends.base import AttentionBackend, AttentionLayer, ForwardBatch, PlannedLayers
from pipeline.backends.memory import dequantize_kv, layer_kv_scales
from pipeline.backends.speculative import check_draft_batch, check_verify_batch
from pipeline.core.contracts import LayerKind
from pipeline.core.errors import BuildError

__all__ = ["TorchNativeBackend", "create", "check_forward_inputs", "batch_layout"]

Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bad(field: str, value: Any, allowed: str, remedy: str) -> BuildError:
    return BuildError(f"attention input {field}={value} does not match the layer/batch",
                      code="forward_input_invalid", state="forward", flags=[(field, value)],
                      allowed=[allowed], remedy=remedy)


def _check_layer(layer: AttentionLayer, fb: ForwardBatch) -> None:
    """Layer parameters against each other and against the layer's KV buffers."""
    h, hkv = layer.num_heads, layer.num_kv_heads
    if hkv < 1 or h % hkv:
        raise _bad("layer.num_kv_heads", hkv, f"a divisor of num_heads={h}", "fix the layer's head counts")
    pool = fb.token_to_kv_pool
    if not 0 <= layer.layer_id < len(pool.k_buffer):
        raise _bad("layer.layer_id", layer.layer_id, f"0..{len(pool.k_buffer) - 1}", "size the KV pool for every layer")
    kb, vb = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    want_k, want_v = (hkv, layer.head_dim), (hkv, layer.v_head_dim)
    if tuple(kb.shape[1:]) != want_k or tuple(vb.shape[1:]) != want_v:
        raise _bad("kv_pool.buffer_shape", (tuple(kb.shape[1:]), tuple(vb.shape[1:])), f"{want_k} / {want_v}",
                   "build the KV pool from the same layer kinds as the layers")
    if layer.sliding_window is not None and layer.sliding_window < 1:
        raise _bad("layer.sliding_window", layer.sliding_window, "None or >= 1", "use None for full attention")
    if layer.attention_chunk_size is not None and layer.attention_chunk_size < 1:
        raise _bad("layer.attention_chunk_size", layer.attention_chunk_size, "None or >= 1",
                   "use None for attention without chunks")
    if layer.logit_softcap is not None and not layer.logit_softcap > 0:
        raise _bad("layer.logit_softcap", layer.logit_softcap, "None or > 0", "use None to turn the softcap off")
    if layer.sinks is not None and tuple(layer.sinks.shape) != (h,):
        raise _bad("layer.sinks.shape", tuple(layer.sinks.shape), f"[{h}]", "give one sink logit per q head")


def check_forward_inputs(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                         layer: AttentionLayer, fb: ForwardBatch, save_kv_cache: bool,
                         layout: Optional[list[tuple[int, int, int]]] = None) -> torch.Tensor:
    """Validate one layer call; returns ``q`` as [T, H, D]. ``q`` [T, H, D] or [T, H*D], fp32/bf16/fp16, on the pool's
    device; ``k`` [T, Hkv, D] / ``v`` [T, Hkv, Dv] when ``save_kv_cache``; ``layout``: :func:`batch_layout` if known.
    Raises :class:`BuildError` (``forward_input_invalid``) before any write."""
    _check_layer(layer, fb)
    t, h, d, dv, hkv = fb.num_tokens, layer.num_heads, layer.head_dim, layer.v_head_dim, layer.num_kv_heads
    if q.dtype not in Q_DTYPES:
        raise _bad("q.dtype", str(q.dtype), "float32, bfloat16, float16", "run the model in a supported dtype")
    if q.numel() != t * h * d or q.shape[0] != t:
        raise _bad("q.shape", tuple(q.shape), f"[{t}, {h}, {d}] or [{t}, {h * d}]", "pass q for the batch's new tokens")
    pdev = fb.token_to_kv_pool.device
    if q.device.type != pdev.type or (q.device.index or 0) != (pdev.index or 0):
        raise _bad("q.device", str(q.device), str(pdev), "move q to the KV pool's device")
    if save_kv_cache:
        for name, x, dim in (("k", k, d), ("v", v, dv)):
            if x is None or not x.is_floating_point() or x.shape[0] != t or x.numel() != t * hkv * dim:
                got = None if x is None else (tuple(x.shape), str(x.dtype))
                raise _bad(f"{name}.shape", got, f"float [{t}, {hkv}, {dim}]", f"pass {name} for the new tokens")
    layout = batch_layout(fb) if layout is None else layout
    if sum(n for _, _, n in layout) != t:
        raise _bad("forward_batch.num_tokens", t, str(sum(n for _, _, n in layout)),
                   "out_cache_loc must hold one slot per new token")
    return q.reshape(t, h, d)


def batch_layout(fb: ForwardBatch) -> list[tuple[int, int, int]]:
    """Per request ``(req_to_token row, cached prefix length, new tokens)`` from host data (extend, decode, draft decode
    of ``topk`` rows). Raises BuildError for an inconsistent batch."""
    rows = [int(r) for r in fb.req_pool_indices.tolist()]
    seq = list(fb.seq_lens_cpu) or [int(s) for s in fb.seq_lens.tolist()]
    if fb.is_draft_decode():
        topk = check_draft_batch(fb.spec_info, fb.batch_size, fb.num_tokens).shape[1]
        if len(rows) != len(seq) or len(rows) != fb.batch_size:
            raise _bad("forward_batch.batch_size", fb.batch_size, f"{len(rows)} (req_pool_indices)",
                       "build the batch with one entry per request in every field")
        return [(r, s, topk) for r, s in zip(rows, seq)]
    if fb.is_decode():
        prefix, new = [s - 1 for s in seq], [1] * len(seq)
    else:
        prefix = list(fb.extend_prefix_lens_cpu) or [int(x) for x in fb.extend_prefix_lens.tolist()]
        new = list(fb.extend_seq_lens_cpu) or [int(x) for x in fb.extend_seq_lens.tolist()]
    if not len(rows) == len(seq) == len(prefix) == len(new) == fb.batch_size:
        raise _bad("forward_batch.batch_size", fb.batch_size, f"{len(rows)} (req_pool_indices)",
                   "build the batch with one entry per request in every field")
    for p, n, s in zip(prefix, new, seq):
        if p < 0 or n < 1 or p + n != s:
            raise _bad("forward_batch.seq_lens", (p, n, s), "prefix + new == seq_len, new >= 1",
                       "fill seq_lens with prefix + new tokens per request")
    return list(zip(rows, prefix, new))


class Unit(NamedTuple):
    """One attention problem: output rows ``[start, start + n)``, KV slots [s] int64, query [n] / key [s] positions, and
    an extra mask [n, s] (None: causal)."""

    start: int
    n: int
    slots: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    allowed: Optional[torch.Tensor]


def batch_units(fb: ForwardBatch, layout: list[tuple[int, int, int]]) -> list[Unit]:
    """The batch as :class:`Unit` s (host index work once per batch): one per request for extend / decode / target
    verify (its tree mask and ``prefix + depth`` positions), one per branch for draft decode."""
    r2t, dev = fb.req_to_token_pool.req_to_token, fb.token_to_kv_pool.device
    ar = lambda a, b: torch.arange(a, b, device=dev)  # noqa: E731
    units, start = [], 0
    if fb.is_draft_decode():
        slots = fb.spec_info.draft_slots.to(dev, torch.int64)
        for b, (row, prefix, topk) in enumerate(layout):
            head = r2t[row, :prefix].to(torch.int64)
            s = slots.shape[2]
            for k in range(topk):
                units.append(Unit(start, 1, torch.cat([head, slots[b, k]]), ar(prefix + s - 1, prefix + s),
                                  ar(0, prefix + s), None))
                start += 1
        return units
    spec = check_verify_batch(fb.spec_info, [p for _, p, _ in layout], [n for _, _, n in layout]) \
        if fb.is_target_verify() else None
    for b, (row, prefix, new) in enumerate(layout):
        slots = r2t[row, : prefix + new].to(torch.int64)
        if spec is None:
            units.append(Unit(start, new, slots, ar(prefix, prefix + new), ar(0, prefix + new), None))
        else:
            depth = torch.tensor(spec.depths()[b], device=dev) + prefix
            allowed = torch.cat([torch.ones((new, prefix), dtype=torch.bool), spec.masks()[b]], dim=1).to(dev)
            units.append(Unit(start, new, slots, depth, torch.cat([ar(0, prefix), depth]), allowed))
        start += new
    return units


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, unit: Unit, layer: AttentionLayer) -> torch.Tensor:
    """One unit: q [n, H, D], k [s, Hkv, D], v [s, Hkv, Dv] fp32 → [n, H, Dv] fp32; key j visible from query i when
    its position is not later (causal), within the window and chunk by position, and ``unit.allowed``."""
    n, s = q.shape[0], k.shape[0]
    qpos, kpos = unit.q_pos.view(-1, 1), unit.k_pos.view(1, -1)
    dist = qpos - kpos
    mask = dist >= 0
    if unit.allowed is not None:
        mask &= unit.allowed
    if layer.sliding_window is not None:
        mask &= dist < layer.sliding_window
    if layer.attention_chunk_size is not None:
        c = layer.attention_chunk_size
        mask &= (qpos // c) == (kpos // c)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)   # [H, n, D], [Hkv, s, *]
    if layer.logit_softcap is None and layer.sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scaling,
                                             enable_gqa=qh.shape[0] != kh.shape[0])
        return out.transpose(0, 1)
    group = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(group, dim=0), vh.repeat_interleave(group, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * layer.scaling          # [H, n, s]
    if layer.logit_softcap is not None:
        scores = torch.tanh(scores / layer.logit_softcap) * layer.logit_softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.to(device=q.device, dtype=torch.float32).view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1)


class TorchNativeBackend(AttentionBackend):
    """Per-request fp32 attention over the paged KV cache (pools come with each :class:`ForwardBatch`).
    ``torch_device``; ``role``; ``layer_kinds``: checked per layer object (``LayerMismatch`` before any write; None:
    trust each call's layer)."""

    name = "torch_native"

    def __init__(self, *, torch_device: str | torch.device = "cpu", role: str = "primary",
                 layer_kinds: Optional[Sequence[LayerKind]] = None) -> None:
        self.torch_device = torch.device(torch_device)
        self.role = role
        self.planned = None if layer_kinds is None else PlannedLayers(layer_kinds, backend=self.name, role=role)
        self._layout: Optional[tuple[ForwardBatch, list[tuple[int, int, int]], list[Unit]]] = None
        self.closed = False

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Read the batch layout and its attention units from host data once per batch."""
        layout = batch_layout(forward_batch)
        self._layout = (forward_batch, layout, batch_units(forward_batch, layout))

    def _layout_for(self, fb: ForwardBatch) -> tuple[list[tuple[int, int, int]], list[Unit]]:
        if self._layout is None or self._layout[0] is not fb:  # not planned: plan once, not once per layer
            self.init_forward_metadata(fb)
        return self._layout[1], self._layout[2]

    def _run(self, q, k, v, layer: AttentionLayer, fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if self.planned is not None:
            self.planned.check(layer)
        layout, units = self._layout_for(fb)
        q3 = check_forward_inputs(q, k, v, layer, fb, save_kv_cache, layout)
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        kb, vb = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        ks, vs = layer_kv_scales(pool, layer.layer_id)
        out = torch.empty((q3.shape[0], layer.num_heads, layer.v_head_dim), dtype=q.dtype, device=q.device)
        for u in units:
            k_req, v_req = dequantize_kv(kb[u.slots], ks), dequantize_kv(vb[u.slots], vs)
            q_req = q3[u.start: u.start + u.n].to(torch.float32)
            out[u.start: u.start + u.n] = _attend(q_req, k_req, v_req, u, layer).to(q.dtype)
        return out.reshape(q3.shape[0], layer.num_heads * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Extend: q [T, H, D] → [T, H*Dv] in q's dtype (prefix from the cache, causal among new; target verify:
        the tree mask)."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer: AttentionLayer, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Decode: q [B, H, D] (one token per request; draft decode: [B * topk, H, D], one per branch) → [rows, H*Dv]
        in q's dtype."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def close(self) -> None:
        """Drop the cached batch layout (this backend owns no device buffers)."""
        self._layout = None
        self.closed = True


def create(ctx: Any) -> TorchNativeBackend:
    """Registry factory: ``create(ctx: BackendContext) -> TorchNativeBackend`` (needs no workspace)."""
    return TorchNativeBackend(torch_device=ctx.torch_device, role=ctx.role, layer_kinds=ctx.layer_kinds)
