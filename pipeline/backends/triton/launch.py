"""Launchers of the Triton kernels: validate every input, then launch (nothing allocated before) (docs/internals.md)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import triton

from pipeline.backends.triton.kernels import decode as kdec, extend as kext
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
    """A dequantisation scale: a finite float > 0, or a one-element float tensor on ``device`` (value unchecked: no host
    sync). Returns True for a tensor."""
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


def check_tree(tree_mask: Any, tree_indptr: Any, positions: Any, bsz: int, t: int, device: torch.device) -> bool:
    """A target-verify batch's tree inputs of :func:`extend_attention` (all three or none); returns whether given."""
    given = [x is not None for x in (tree_mask, tree_indptr, positions)]
    if not any(given):
        return False
    if not all(given):
        raise bad("tree_mask/tree_indptr/positions", given, "all three or none", "pass the tree's mask, its row "
                  "offsets and the tokens' positions together (pipeline.backends.speculative.tree_mask_rows)")
    _check_tensor("tree_mask", tree_mask, 1, (torch.uint8,), device)
    _check_index("tree_indptr", tree_indptr, bsz + 1, device)
    _check_index("positions", positions, t, device)
    return True


@dataclass(frozen=True)
class DecodeConfig:
    """Decode tuning: ``block_n`` keys per tile (``block_n_single`` when the batch alone fills the GPU), ``split_min``
    fewest keys per split, ``programs_per_sm`` (sets the split cap), warps (``num_warps_single``: unsplit; None =
    ``num_warps``), stages."""

    block_n: int = 64
    block_n_single: int = 64
    num_warps: int = 4
    num_warps_single: Optional[int] = None
    num_stages: int = 3
    split_min: int = 128
    programs_per_sm: int = 8
    max_splits_cap: int = 64


@dataclass(frozen=True)
class ExtendConfig:
    """Extend tuning: ``block_m`` query rows and ``block_n`` keys per program, warps, stages. ``pack_gqa``: a program's
    rows are (token, q head) pairs of one kv group (as FlashInfer), filling tiles of short extends; None: packed when
    the group has > 1 head and ``max_extend_len < block_m`` (:func:`extend_packs_gqa`)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pack_gqa: Optional[bool] = None


def _is_sm90(device: Optional[torch.device]) -> bool:
    return device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def default_decode_config(head_dim: int, device: Optional[torch.device] = None) -> DecodeConfig:
    """Decode config by head dim and arch (H200-tuned, benchmarks/NOTES.md): 64-key tiles, 3 stages and 2 unsplit warps
    on sm90, 2 stages elsewhere; 32-key tiles for D > 128."""
    if head_dim > 128:
        return DecodeConfig(block_n=32, block_n_single=32, num_stages=2)
    if device is not None and not _is_sm90(device):
        return DecodeConfig(num_stages=2)
    return DecodeConfig(num_warps_single=2)


def default_extend_config(head_dim: int, device: Optional[torch.device] = None) -> ExtendConfig:
    """Extend config by head dim and arch: 128x128 tiles, 3 stages on sm90 (about 192 KB of shared
    memory); tiles that fit 99 KB elsewhere; 64x32 tiles for D > 128."""
    if head_dim > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=4)
    if _is_sm90(device):
        return ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def extend_packs_gqa(cfg: ExtendConfig, group: int, max_extend_len: int) -> bool:
    """Whether extend packs the GQA group's heads into a program's rows: ``cfg.pack_gqa`` when set, else
    ``group > 1 and max_extend_len < cfg.block_m`` (unpacked tiles would be partly empty)."""
    if cfg.pack_gqa is not None:
        return bool(cfg.pack_gqa)
    return group > 1 and max_extend_len < cfg.block_m


def decode_max_splits(batch_size: int, num_kv_heads: int, num_sms: int, cfg: DecodeConfig) -> int:
    """The split cap for a batch size: ``floor(programs_per_sm * SMs / (B * Hkv))`` in [1, cap]; rounding down avoids a
    nearly empty last wave. Depends only on B (fixed per captured graph)."""
    want = (cfg.programs_per_sm * max(num_sms, 1)) // max(batch_size * num_kv_heads, 1)
    return int(min(max(want, 1), cfg.max_splits_cap))


def _interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels then upcast dot operands: the interpreter's bf16 dot is wrong)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def decode_scratch_numel(batch_size: int, num_heads: int, v_head_dim: int, max_splits: int) -> int:
    """fp32 elements of decode scratch: partial outputs [B, H, S, Dv] then LSEs [B, H, S]."""
    return batch_size * num_heads * max_splits * (v_head_dim + 1)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
                     sm_scale: float, max_splits: int, scratch: Optional[torch.Tensor] = None,
                     sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None, config: Optional[DecodeConfig] = None,
                     attention_chunk_size: Optional[int] = None, k_scale: Scale = 1.0,
                     v_scale: Scale = 1.0) -> torch.Tensor:
    """Paged flash-decoding: one new query per request over its cached keys (itself included).

    ``q`` [B, H, D]; ``out`` [B, H, Dv] (written, returned); ``scratch`` fp32 of :func:`decode_scratch_numel` elements
    (fixed for CUDA graphs; allocated when None); ``max_splits``: stage-1 grid ``(B * Hkv, max_splits)``. sglang's
    two-stage Triton decode with FlashInfer's ``window_left``/``logits_soft_cap``/sinks semantics;
    ``attention_chunk_size``: keys ``[(L-1)//C*C, L)`` only. fp8 K/V are read as stored; score scale ``sm_scale *
    k_scale``, output times ``v_scale``. Raises the errors in docs/internals.md.
    """
    ks_ptr, vs_ptr = check_decode(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out,
                                  sliding_window, logit_softcap, sinks, max_splits, attention_chunk_size,
                                  k_scale, v_scale)
    bsz, h, d = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    dev = q.device
    need = decode_scratch_numel(bsz, h, dv, max_splits)
    if scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=dev)
    elif scratch.dtype != torch.float32 or scratch.device != dev or scratch.numel() < need:
        raise bad("scratch", f"{scratch.dtype}[{scratch.numel()}]@{scratch.device}", f"float32[>={need}]@{dev}",
                   "size it with decode_scratch_numel() at the largest batch size")
    if bsz == 0:
        return out
    cfg = config or default_decode_config(d, dev)
    block_n = cfg.block_n_single if max_splits == 1 else cfg.block_n
    warps = cfg.num_warps_single if max_splits == 1 and cfg.num_warps_single else cfg.num_warps
    o_part = scratch[: bsz * h * max_splits * dv].view(bsz, h, max_splits, dv)
    lse = scratch[bsz * h * max_splits * dv: need].view(bsz, h, max_splits)
    win, chunk = int(sliding_window or 0), int(attention_chunk_size or 1)
    common = dict(SPLIT_MIN=cfg.split_min, BLOCK_N=block_n, USE_WINDOW=sliding_window is not None,
                  USE_CHUNK=attention_chunk_size is not None)
    kdec.decode_split_kernel[(bsz * hkv, max_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, o_part, lse,
        k_scale if ks_ptr else lse, v_scale if vs_ptr else lse,
        float(sm_scale), 1.0 if ks_ptr else float(k_scale), 1.0 if vs_ptr else float(v_scale),
        float(logit_softcap or 1.0), win, chunk, h // hkv, hkv, max_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        D=d, DV=dv, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), G_PAD=max(16, _pow2(h // hkv)),
        USE_SOFTCAP=logit_softcap is not None, UPCAST=_interpreting(), K_SCALE_PTR=ks_ptr, V_SCALE_PTR=vs_ptr,
        num_warps=warps, num_stages=cfg.num_stages, **common)
    kdec.decode_merge_kernel[(bsz, h)](
        o_part, lse, seq_lens, sinks if sinks is not None else lse, out, win, chunk, max_splits,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        DV=dv, BLOCK_DV=_pow2(dv), S_PAD=_pow2(max_splits), HAS_SINKS=sinks is not None, num_warps=4, **common)
    return out


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
                     v_buffer: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     qo_indptr: torch.Tensor, prefix_lens: torch.Tensor, out: torch.Tensor, *,
                     max_extend_len: int, sm_scale: float, sliding_window: Optional[int] = None,
                     logit_softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     config: Optional[ExtendConfig] = None,
                     attention_chunk_size: Optional[int] = None, k_scale: Scale = 1.0,
                     v_scale: Scale = 1.0, tree_mask: Optional[torch.Tensor] = None,
                     tree_indptr: Optional[torch.Tensor] = None,
                     positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Extend attention over a paged prefix plus the step's own tokens (causal), ragged batch (sglang's
    ``extend_attention_fwd``).

    ``q`` [T, H, D], ``k``/``v`` [T, Hkv, D/Dv]: new tokens in the pool's stored format (fp8: quantised, same scales);
    ``qo_indptr`` [B+1] int32/int64; ``prefix_lens`` [B] (read via ``req_to_token``); ``max_extend_len``: host int
    (sizes the grid); ``out`` [T, H, Dv] written and returned; ``attention_chunk_size``: key p visible from query i iff
    ``p // C == i // C``.

    Target verify (``tree_mask``, ``tree_indptr``, ``positions``: all or none): request ``b``'s new tokens are an EAGLE
    tree, ``tree_mask`` [sum n_b^2] uint8 row-major ancestor-or-self masks from ``tree_indptr[b]``, ``positions`` [T]
    (``prefix + depth``); prefix columns implied, windows and chunks on positions (sglang's ``custom_mask``).
    """
    bsz, ks_ptr, vs_ptr = check_extend(q, k, v, k_buffer, v_buffer, req_to_token, req_pool_indices, qo_indptr,
                                       prefix_lens, out, sliding_window, logit_softcap, sinks, max_extend_len,
                                       attention_chunk_size, k_scale, v_scale)
    tree = check_tree(tree_mask, tree_indptr, positions, bsz, q.shape[0], q.device)
    t, h, d = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    if bsz == 0 or max_extend_len == 0 or t == 0:
        return out
    cfg = config or default_extend_config(d, q.device)
    stages = min(cfg.num_stages, 2) if tree and config is None else cfg.num_stages  # + mask tile: 3 overflow sm90
    pack = extend_packs_gqa(cfg, h // hkv, max_extend_len)
    if pack:
        grid = (hkv, bsz, triton.cdiv(max_extend_len * (h // hkv), cfg.block_m))
    else:
        grid = (h, bsz, triton.cdiv(max_extend_len, cfg.block_m))
    kext.extend_kernel[grid](
        q, k, v, k_buffer, v_buffer, req_to_token, req_pool_indices, qo_indptr, prefix_lens,
        sinks if sinks is not None else q, out, k_scale if ks_ptr else out, v_scale if vs_ptr else out,
        tree_mask if tree else out, tree_indptr if tree else qo_indptr, positions if tree else qo_indptr,
        float(sm_scale), 1.0 if ks_ptr else float(k_scale), 1.0 if vs_ptr else float(v_scale),
        float(logit_softcap or 1.0), int(sliding_window or 0), int(attention_chunk_size or 1),
        h // hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        D=d, DV=dv, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=logit_softcap is not None, HAS_SINKS=sinks is not None,
        UPCAST=_interpreting(), USE_CHUNK=attention_chunk_size is not None, K_SCALE_PTR=ks_ptr, V_SCALE_PTR=vs_ptr,
        PACK_GQA=pack, USE_TREE=tree, num_warps=cfg.num_warps, num_stages=stages)
    return out

