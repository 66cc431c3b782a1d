"""Dense float64 reference attention over un-paged K/V, one request at a time: the yardstick every backend is checked
against, written apart from the backends. Error metric: :func:`rel_err`."""

from __future__ import annotations

from typing import Optional

import torch

from pipeline.core.errors import BuildError

__all__ = ["reference_attention", "rel_err"]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
           window: Optional[int], sinks: Optional[torch.Tensor], chunk: Optional[int] = None,
           k_positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> None:
    """Shape checks; raises :class:`BuildError` (``reference_input_invalid``) naming the argument."""
    def bad(field: str, value: object, allowed: str) -> BuildError:
        return BuildError(f"reference_attention: {field}={value} is not allowed", code="reference_input_invalid",
                          flags=[(field, value)], allowed=[allowed], remedy=f"pass {field} as {allowed}")

    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise bad("q/k/v.dim", (q.dim(), k.dim(), v.dim()), "q [Tq, H, D], k [L, Hkv, D], v [L, Hkv, Dv]")
    (tq, h, d), (lk, hkv, dk), (lv, hkv_v, _) = q.shape, k.shape, v.shape
    if dk != d or lv != lk or hkv_v != hkv:
        raise bad("k/v.shape", (tuple(k.shape), tuple(v.shape)), f"k [L, Hkv, {d}] and v [L, Hkv, Dv] with equal L, Hkv")
    if hkv < 1 or h % hkv:
        raise bad("num_kv_heads", hkv, f"a divisor of num_heads={h}")
    if tuple(q_positions.shape) != (tq,):
        raise bad("q_positions.shape", tuple(q_positions.shape), f"[{tq}]")
    if tq and (int(q_positions.min()) < 0 or int(q_positions.max()) >= lk):
        raise bad("q_positions", (int(q_positions.min()), int(q_positions.max())), f"positions in [0, {lk - 1}]")
    if k_positions is not None and tuple(k_positions.shape) != (lk,):
        raise bad("k_positions.shape", tuple(k_positions.shape), f"[{lk}]")
    if mask is not None and (tuple(mask.shape) != (tq, lk) or mask.dtype != torch.bool):
        raise bad("mask", (tuple(mask.shape), str(mask.dtype)), f"bool [{tq}, {lk}]")
    if window is not None and window < 1:
        raise bad("window", window, "None or an integer >= 1")
    if chunk is not None and chunk < 1:
        raise bad("chunk", chunk, "None or an integer >= 1")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise bad("sinks.shape", tuple(sinks.shape), f"[{h}]")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_positions: torch.Tensor,
                        scale: float, window: Optional[int] = None, softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None, chunk: Optional[int] = None,
                        k_positions: Optional[torch.Tensor] = None,
                        mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one request's queries over all of its keys, in float64: [Tq, H, Dv] on q's device.

    ``q`` [Tq, H, D] any float dtype; ``k`` [L, Hkv, D]; ``v`` [L, Hkv, Dv]; ``q_positions`` [Tq] int; ``scale``;
    ``window``: key ``j`` visible from ``i`` iff ``0 <= i - j < window`` (None: causal); ``softcap``: ``softcap * tanh(s
    / softcap)``; ``sinks`` [H]: add ``exp(sink_h)`` to the denominator; ``chunk``: visible only when ``j // chunk == i
    // chunk``; ``k_positions`` [L] (default ``0..L-1``); ``mask`` [Tq, L] bool: visible only where also True. GQA: head
    ``h`` reads kv head ``h // (H // Hkv)``. Raises BuildError (``reference_input_invalid``) for inconsistent inputs.
    """
    _check(q, k, v, q_positions, window, sinks, chunk, k_positions, mask)
    f64 = torch.float64
    h, hkv = q.shape[1], k.shape[1]
    kv_of_head = torch.arange(h, device=k.device) // (h // hkv)
    qh = q.to(f64).transpose(0, 1)                                # [H, Tq, D]
    kh = k.to(f64)[:, kv_of_head].transpose(0, 1)                 # [H, L, D]
    vh = v.to(f64)[:, kv_of_head].transpose(0, 1)                 # [H, L, Dv]
    scores = (qh @ kh.transpose(1, 2)) * scale                    # [H, Tq, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~_visible(q_positions, k_positions, k.shape[0], window, chunk, mask, q.device),
                                float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)                   # every query sees itself: finite
    if sinks is not None:
        sink = sinks.to(device=q.device, dtype=f64).view(h, 1, 1)
        row_max = torch.maximum(row_max, sink)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = (weights / denom) @ vh                                  # [H, Tq, Dv]
    return out.transpose(0, 1).contiguous()


def _visible(q_positions: torch.Tensor, k_positions: Optional[torch.Tensor], num_keys: int, window: Optional[int],
             chunk: Optional[int], mask: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[Tq, L] bool: key j visible from query i — causal by position, within the window and the chunk, and
    ``mask`` (see :func:`reference_attention`)."""
    key_pos = (torch.arange(num_keys, device=device) if k_positions is None else k_positions.to(device)).view(1, -1)
    q_pos = q_positions.to(device).view(-1, 1)
    dist = q_pos - key_pos
    visible = dist >= 0
    if mask is not None:
        visible &= mask.to(device)
    if window is not None:
        visible &= dist < window
    if chunk is not None:
        visible &= (q_pos // chunk) == (key_pos // chunk)
    return visible


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` in float64 over flattened tensors of equal size; ``inf`` for NaN/inf in ``out``;
    absolute error when ``ref`` is all zeros."""
    o = out.detach().to(torch.float64).reshape(-1)
    r = ref.detach().to(device=o.device, dtype=torch.float64).reshape(-1)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    num = float((o - r).abs().max()) if o.numel() else 0.0
    den = float(r.abs().max()) if r.numel() else 0.0
    return num / den if den > 0 else num
