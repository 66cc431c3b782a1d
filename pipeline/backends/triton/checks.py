"""Input checks of the Triton launchers: typed errors naming the field, raised before any launch.

:class:`~pipeline.core.errors.CapabilityMismatch` for what the kernels do not serve (q dtype other than
bf16/fp16, KV dtype other than q's or fp8 e4m3/e5m2, head dim > 256); :class:`~pipeline.core.errors.BuildError`
(``bad_tensor``) for inconsistent shapes, dtypes, devices, strides or scales. Shapes as in ``launch.py``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from pipeline.core.errors import BuildError, CapabilityMismatch

Q_DTYPES = (torch.bfloat16, torch.float16)
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)   # stored K/V; real = stored * k_scale / v_scale
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256

Scale = Union[float, torch.Tensor]


def bad(field: str, value: Any, allowed: str, remedy: str, *, cap: bool = False) -> Exception:
    cls = CapabilityMismatch if cap else BuildError
    kw = {} if cap else {"code": "bad_tensor"}
    return cls(f"triton attention: {field}={value!r} is not accepted (allowed: {allowed})",
               flags=[(field, value)], allowed=[allowed], remedy=remedy, **kw)


def _check_tensor(name: str, t: Any, ndim: int, dtypes: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise bad(name, type(t).__name__, "torch.Tensor", f"pass {name} as a tensor")
    if t.dim() != ndim:
        raise bad(f"{name}.shape", tuple(t.shape), f"{ndim} dims", f"reshape {name} to {ndim} dims")
    if t.dtype not in dtypes:
        raise bad(f"{name}.dtype", str(t.dtype), ", ".join(map(str, dtypes)), f"cast {name}",
                   cap=name in ("q", "k_buffer"))
    if t.device != device:
        raise bad(f"{name}.device", str(t.device), str(device), f"move {name} to {device}")
    if t.numel() and t.stride(-1) != 1:
        raise bad(f"{name}.stride(-1)", t.stride(-1), "1", f"call {name}.contiguous()")


def kv_dtypes(q_dtype: torch.dtype) -> tuple:
    """The KV buffer dtypes the kernels read with a ``q_dtype`` query: q's own, fp8 e4m3 and e5m2."""
    return (q_dtype,) + FP8_KV_DTYPES


def check_scale(name: str, s: Any, device: torch.device) -> bool:
    """A dequantisation scale (``k_scale`` / ``v_scale``): a finite float > 0, or a one-element float tensor
    on ``device`` (read in-kernel, so CUDA graphs follow its value; its value is not checked: no host sync).
    Returns True for a tensor."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or s.dtype not in SCALE_DTYPES:
            raise bad(f"{name}", f"{s.dtype}[{tuple(s.shape)}]", "a float > 0 or a one-element float32 tensor",
                      f"pass {name} as a Python float or a 0-d float32 tensor")
        if s.device != device:
            raise bad(f"{name}.device", str(s.device), str(device), f"move {name} to {device}")
        return True
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise bad(name, s, "a finite float > 0 (or a one-element float32 tensor)",
                  f"pass the layer's {name} (1.0 when the checkpoint has none)")
    return False


def _check_heads(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """Common head/dim/dtype checks of q against one layer of the KV pool (K/V in q's dtype or fp8)."""
    dev = q.device
    _check_tensor("q", q, 3, Q_DTYPES, dev)
    _check_tensor("k_buffer", k_buffer, 3, kv_dtypes(q.dtype), dev)
    _check_tensor("v_buffer", v_buffer, 3, (k_buffer.dtype,), dev)
    h, d = q.shape[1], q.shape[2]
    hkv = k_buffer.shape[1]
    if d != k_buffer.shape[2]:
        raise bad("q.shape[2]", d, f"k_buffer head dim {k_buffer.shape[2]}", "use the layer's K buffer")
    if v_buffer.shape[:2] != k_buffer.shape[:2]:
        raise bad("v_buffer.shape", tuple(v_buffer.shape), f"[{k_buffer.shape[0]}, {hkv}, Dv]",
                   "use the V buffer of the same layer")
    if hkv < 1 or h % hkv:
        raise bad("num_heads", h, f"a multiple of num_kv_heads={hkv}", "check the model's head counts")
    if max(d, v_buffer.shape[2]) > MAX_HEAD_DIM:
        raise bad("head_dim", max(d, v_buffer.shape[2]), f"<= {MAX_HEAD_DIM}",
                   "use the flashinfer or torch_native backend for larger heads", cap=True)


def _check_features(h: int, sliding_window: Optional[int], logit_softcap: Optional[float],
                    sinks: Optional[torch.Tensor], device: torch.device,
                    attention_chunk_size: Optional[int] = None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise bad("sliding_window", sliding_window, ">= 1 or None", "pass None for full attention")
    if attention_chunk_size is not None and (isinstance(attention_chunk_size, bool)
                                             or not isinstance(attention_chunk_size, int) or attention_chunk_size < 1):
        raise bad("attention_chunk_size", attention_chunk_size, "an integer >= 1 or None",
                  "pass None for attention without chunks")
    if logit_softcap is not None and not logit_softcap > 0:
        raise bad("logit_softcap", logit_softcap, "> 0 or None", "pass None to disable the softcap")
    if sinks is not None:
        _check_tensor("sinks", sinks, 1, (torch.float32, torch.bfloat16, torch.float16), device)
        if sinks.shape[0] != h:
            raise bad("sinks.shape", tuple(sinks.shape), f"[{h}]", "pass one sink logit per q head")


def _check_index(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    _check_tensor(name, t, 1, (torch.int32, torch.int64), device)
    if t.shape[0] != n:
        raise bad(f"{name}.shape", tuple(t.shape), f"[{n}]", f"give one {name} entry per request")


def check_decode(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out,
                 sliding_window, logit_softcap, sinks, max_splits, attention_chunk_size=None,
                 k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> tuple[bool, bool]:
    """All inputs of :func:`pipeline.backends.triton.launch.decode_attention`; returns whether each of
    k_scale / v_scale is a tensor."""
    _check_heads(q, k_buffer, v_buffer)
    bsz, h = q.shape[:2]
    dv = v_buffer.shape[2]
    dev = q.device
    _check_tensor("req_to_token", req_to_token, 2, (torch.int32,), dev)
    _check_index("req_pool_indices", req_pool_indices, bsz, dev)
    _check_index("seq_lens", seq_lens, bsz, dev)
    _check_tensor("out", out, 3, (q.dtype,), dev)
    if tuple(out.shape) != (bsz, h, dv):
        raise bad("out.shape", tuple(out.shape), f"[{bsz}, {h}, {dv}]", "allocate out as [B, H, Dv]")
    _check_features(h, sliding_window, logit_softcap, sinks, dev, attention_chunk_size)
    if max_splits < 1:
        raise bad("max_splits", max_splits, ">= 1", "use decode_max_splits()")
    return check_scale("k_scale", k_scale, dev), check_scale("v_scale", v_scale, dev)


def check_extend(q, k, v, k_buffer, v_buffer, req_to_token, req_pool_indices, qo_indptr, prefix_lens, out,
                 sliding_window, logit_softcap, sinks, max_extend_len, attention_chunk_size=None,
                 k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> tuple[int, bool, bool]:
    """All inputs of :func:`pipeline.backends.triton.launch.extend_attention`; returns the batch size and
    whether each of k_scale / v_scale is a tensor. The new ``k``/``v`` are in the pool's stored format."""
    _check_heads(q, k_buffer, v_buffer)
    t, h, d = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    dev = q.device
    stored = "quantise the new K/V as the pool stores them (or read them back from the pool)"
    if isinstance(k, torch.Tensor) and k.dtype != k_buffer.dtype:
        raise bad("k.dtype", str(k.dtype), f"{k_buffer.dtype} (the pool's stored format)", stored)
    if isinstance(v, torch.Tensor) and v.dtype != k_buffer.dtype:
        raise bad("v.dtype", str(v.dtype), f"{k_buffer.dtype} (the pool's stored format)", stored)
    _check_tensor("k", k, 3, (k_buffer.dtype,), dev)
    _check_tensor("v", v, 3, (k_buffer.dtype,), dev)
    if tuple(k.shape) != (t, hkv, d) or tuple(v.shape) != (t, hkv, dv):
        raise bad("k.shape/v.shape", (tuple(k.shape), tuple(v.shape)), f"[{t}, {hkv}, {d}] / [{t}, {hkv}, {dv}]",
                   "pass the step's new K/V, one row per new token")
    _check_tensor("req_to_token", req_to_token, 2, (torch.int32,), dev)
    bsz = int(prefix_lens.shape[0]) if isinstance(prefix_lens, torch.Tensor) else -1
    _check_index("prefix_lens", prefix_lens, bsz, dev)
    _check_index("req_pool_indices", req_pool_indices, bsz, dev)
    _check_index("qo_indptr", qo_indptr, bsz + 1, dev)
    _check_tensor("out", out, 3, (q.dtype,), dev)
    if tuple(out.shape) != (t, h, dv):
        raise bad("out.shape", tuple(out.shape), f"[{t}, {h}, {dv}]", "allocate out as [T, H, Dv]")
    _check_features(h, sliding_window, logit_softcap, sinks, dev, attention_chunk_size)
    if max_extend_len < 0:
        raise bad("max_extend_len", max_extend_len, ">= 0", "pass max(extend_seq_lens)")
    return bsz, check_scale("k_scale", k_scale, dev), check_scale("v_scale", v_scale, dev)
