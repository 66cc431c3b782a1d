"""The KV cache's storage dtypes and its fp8 write and read rule (the contract in :mod:`pipeline.backends.memory`).

Write: ``stored = round_to_fp8(clamp(float32(x) / scale, -fp8_max, +fp8_max))`` for the two fp8 dtypes
(``float8_e4m3fn``, ``float8_e5m2``), else ``x`` cast to the storage dtype; read: ``real = float(stored) * scale``.
:func:`quantize_kv` is the one writer's rule — the pool's ``set_kv_buffer``, the Triton backend's new K/V in extend
and verification's own copy all use it — and :func:`dequantize_kv` the reader's.
"""

from __future__ import annotations

from typing import Any

import torch

_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a normalised dtype name (``bfloat16``, ``fp8_e4m3`` …)."""
    return _TORCH_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the two fp8 KV storage dtypes (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: Any = 1.0) -> torch.Tensor:
    """What the pool stores for ``x``: ``round(clamp(x / scale))`` in fp8, else ``x`` cast to ``dtype``.

    ``x``: any float tensor; ``dtype``: the pool's storage dtype; ``scale``: the layer's
    ``k_scale`` or ``v_scale``, a float or a one-element tensor (only fp8 pools take one other than 1.0). Returns a tensor of
    ``dtype`` with ``x``'s shape. See the module docstring (the write rule).
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    y = x.to(torch.float32)
    if isinstance(scale, torch.Tensor) or scale != 1.0:  # x / 1.0 is x: skip the op for the common case
        y = y / scale
    return y.clamp(-fmax, fmax).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(stored) * scale`` in ``dtype`` (float32 by default): the value a stored K/V element means."""
    out = stored.to(dtype)
    return out * scale if scale != 1.0 else out
