"""Launchers of the absorbed-MLA Triton kernels (:mod:`.kernels.mla`): validate every input, then launch
(docs/internals.md)."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from pipeline.backends.triton.kernels import mla as kmla, mla as kmla_ext
from pipeline.backends.triton.launch import _check_index, _check_tensor, bad, Q_DTYPES


MLA_MAX_LATENT_DIM = 512   # the [BLOCK_H, 512] fp32 accumulator is the register budget of a program
MLA_MAX_ROPE_DIM = 128


@dataclass(frozen=True)
class MLADecodeConfig:
    """MLA decode tuning.

    ``block_h`` q heads and ``block_n`` rows per tile (>= 16); warps, stages; ``split_min``: fewest keys per split;
    ``programs_per_sm`` with B sets the split cap (``max_splits_cap`` hard cap); ``detach``: softmax in a region so
    Triton splits the score tile over warp groups; ``lazy_rescale``: rescale only when the max grows > 2^8 (exact);
    ``partial_bf16``: bf16 split partials (as FlashInfer's MLA); ``merge_block_h``: heads per merge program (power of
    2).
    """

    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    split_min: int = 128
    programs_per_sm: int = 1
    max_splits_cap: int = 64
    detach: bool = True
    lazy_rescale: bool = True
    partial_bf16: bool = False
    merge_block_h: int = 1
    prefetch: bool = False


@dataclass(frozen=True)
class MLAExtendConfig:
    """Tuning of the MLA extend kernel: packed (token, head) rows and cache rows per tile, warps, stages."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    detach: bool = True
    lazy_rescale: bool = True


# Default decode configs by head count (smallest key >= H), per arch class (sm90: 227 KB shared memory; other 99 KB).
# Measurements: benchmarks/NOTES.md, "MLA decode".
MLA_DECODE_CONFIGS: dict[str, dict[int, MLADecodeConfig]] = {
    "sm90": {
        # 16 heads: memory-bound, mma.sync 16-row tiles, two programs per SM.
        16: MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, split_min=128, programs_per_sm=2),
        # More heads: 64 per program on wgmma, 64-row tiles, 3 stages (225 KB, no spill), eager rescale, 64-key splits.
        128: MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, split_min=64, programs_per_sm=1,
                             lazy_rescale=False),
    },
    "other": {
        16: MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2, split_min=128, programs_per_sm=2),
        128: MLADecodeConfig(block_h=32, block_n=16, num_warps=8, num_stages=2, split_min=128, programs_per_sm=2),
    },
}
MLA_EXTEND_CONFIGS: dict[str, MLAExtendConfig] = {
    "sm90": MLAExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    "other": MLAExtendConfig(block_m=32, block_n=16, num_warps=8, num_stages=2),
}


def _sweep_cfg(**kw) -> MLADecodeConfig:
    base = dict(block_h=64, block_n=64, num_warps=8, num_stages=3, split_min=64, lazy_rescale=False)
    return MLADecodeConfig(**{**base, **kw})


# Candidates ``benchmarks/mla_decode.py --sweep`` times at 128 heads (sm90 shared memory / registers in comments).
SWEEP_DECODE: list[tuple[str, MLADecodeConfig]] = [
    ("h64n64w8s3-pf", _sweep_cfg(prefetch=True)),                                          # 225 KB, 255, 16
    ("h64n64w8s2-pf", _sweep_cfg(num_stages=2, prefetch=True)),                            # 224 KB, 255, 24
    ("h64n32w8s3-pf", _sweep_cfg(block_n=32, prefetch=True)),                              # 148 KB, 240, 0
    ("h64n64w8s3-pf-sm128", _sweep_cfg(prefetch=True, split_min=128)),
    ("h64n64w8s3-pf-bf16part", _sweep_cfg(prefetch=True, partial_bf16=True)),
    # the best of the first H200 sweep (0.33x at B=64 ctx 4096), for comparison within this run
    ("h64n64w8s2-run1", MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, split_min=128)),
]


def _arch(device: Optional[torch.device]) -> str:
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "sm90"
    return "other" if device is not None and device.type == "cuda" else "sm90"


@functools.lru_cache(maxsize=64)
def default_mla_decode_config(num_heads: int, device: Optional[torch.device] = None) -> MLADecodeConfig:
    """The :data:`MLA_DECODE_CONFIGS` entry for ``num_heads`` on ``device``'s arch (sm90 when not CUDA)."""
    table = MLA_DECODE_CONFIGS[_arch(device)]
    keys = sorted(table)
    return table[next((k for k in keys if k >= num_heads), keys[-1])]


@functools.lru_cache(maxsize=64)
def default_mla_extend_config(device: Optional[torch.device] = None) -> MLAExtendConfig:
    """The :data:`MLA_EXTEND_CONFIGS` entry for ``device``'s arch (sm90 when not CUDA)."""
    return MLA_EXTEND_CONFIGS[_arch(device)]


SPLIT_GAIN = 0.15   # a larger split cap must shorten the modelled time by more than this to be taken


def mla_split_candidates(batch_size: int, num_heads: int, num_sms: int, cfg: MLADecodeConfig) -> range:
    """Split caps :func:`mla_decode_max_splits` considers: 1 .. min(max_splits_cap, ceil(2 * slots / P))."""
    programs = max(batch_size, 1) * triton.cdiv(num_heads, cfg.block_h)
    slots = max(cfg.programs_per_sm * num_sms, 1)
    return range(1, max(1, min(cfg.max_splits_cap, triton.cdiv(2 * slots, programs))) + 1)


@functools.lru_cache(maxsize=4096)
def mla_decode_max_splits(batch_size: int, num_heads: int, num_sms: int, cfg: MLADecodeConfig) -> int:
    """Split cap for a batch size against wave quantisation: ``s`` splits of ``P = B * cdiv(H, block_h)`` programs take
    about ``ceil(P * s / slots) / s``; candidates up to two waves (:func:`mla_split_candidates`), a larger cap only when
    it gains more than :data:`SPLIT_GAIN`. Independent of sequence lengths; 1 = no merge."""
    programs = max(batch_size, 1) * triton.cdiv(num_heads, cfg.block_h)
    slots = max(cfg.programs_per_sm * num_sms, 1)
    best, best_t = 1, float(triton.cdiv(programs, slots))
    for s in mla_split_candidates(batch_size, num_heads, num_sms, cfg)[1:]:
        t = triton.cdiv(programs * s, slots) / s
        if t < best_t * (1 - SPLIT_GAIN):
            best, best_t = s, t
    return best


def mla_decode_scratch_numel(batch_size: int, num_heads: int, v_head_dim: int, max_splits: int) -> int:
    """fp32 elements of decode scratch: partials [B, H, S, Dv] then LSEs [B, H, S]; 0 when ``max_splits == 1``."""
    return 0 if max_splits == 1 else batch_size * num_heads * max_splits * (v_head_dim + 1)


def prefetch_constexprs(cfg: MLADecodeConfig, row_elems: int, elem_bytes: int) -> dict:
    """The decode kernel's L2-prefetch constexprs for a cache row of ``row_elems`` elements: PREFETCH, the
    128-byte lines per row (ROW_LINES, padded to a power of two in LINES_PAD) and elements per line."""
    lines = -(-row_elems * elem_bytes // 128)
    return dict(PREFETCH=bool(cfg.prefetch), ROW_LINES=lines, LINES_PAD=_pow2(lines), LINE_ELEMS=128 // elem_bytes)


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def _interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the kernels then upcast dot operands: the interpreter's bf16 dot is wrong)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_cfg(cfg, fields: tuple[str, ...]) -> None:
    for f in fields:
        v = getattr(cfg, f)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise bad(f"config.{f}", v, "a power of two >= 16", f"pick {f} from 16, 32, 64, 128")


def _check_mla(q: torch.Tensor, kv_buffer: torch.Tensor, out: torch.Tensor, sm_scale: float) -> tuple[int, int]:
    """q / latent cache / out against each other; returns (Dv, rope dims)."""
    dev = q.device if isinstance(q, torch.Tensor) else None
    _check_tensor("q", q, 3, Q_DTYPES, dev)
    if isinstance(kv_buffer, torch.Tensor) and kv_buffer.dtype != q.dtype:
        raise bad("kv_buffer.dtype", str(kv_buffer.dtype), str(q.dtype),
                  "store the latent cache in the model dtype (fp8 latent caches: use torch_native)", cap=True)
    _check_tensor("kv_buffer", kv_buffer, 3, (q.dtype,), dev)
    _check_tensor("out", out, 3, (q.dtype,), dev)
    h, d = q.shape[1], q.shape[2]
    if kv_buffer.shape[1] != 1:
        raise bad("kv_buffer.shape[1]", kv_buffer.shape[1], "1 (one latent KV head)",
                  "pass the MLA layer's latent cache [slots, 1, kv_lora_rank + rope dims]")
    if kv_buffer.shape[2] != d:
        raise bad("q.shape[2]", d, f"kv_buffer row width {kv_buffer.shape[2]}",
                  "pass the absorbed q [.., H, kv_lora_rank + rope dims] of this layer")
    dv = out.shape[2]
    if tuple(out.shape[:2]) != (q.shape[0], h) or not 1 <= dv < d:
        raise bad("out.shape", tuple(out.shape), f"[{q.shape[0]}, {h}, Dv] with 1 <= Dv < {d}",
                  "allocate out as [rows, H, kv_lora_rank]")
    if h < 1:
        raise bad("q.shape[1]", h, ">= 1 heads", "pass at least one q head")
    if dv > MLA_MAX_LATENT_DIM or d - dv > MLA_MAX_ROPE_DIM:
        raise bad("mla dims", (dv, d - dv), f"kv_lora_rank <= {MLA_MAX_LATENT_DIM}, rope <= {MLA_MAX_ROPE_DIM}",
                  "use the torch_native backend for this model", cap=True)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise bad("sm_scale", sm_scale, "a finite float > 0", "pass the layer's scaling (ModelSpec.scaling)")
    return dv, d - dv


def check_mla_decode(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, out, sm_scale, max_splits,
                     scratch, cfg: MLADecodeConfig) -> tuple[int, int]:
    """All inputs of :func:`mla_decode_attention`; returns (Dv, rope dims)."""
    dv, dr = _check_mla(q, kv_buffer, out, sm_scale)
    bsz, h = q.shape[:2]
    dev = q.device
    _check_tensor("req_to_token", req_to_token, 2, (torch.int32,), dev)
    _check_index("req_pool_indices", req_pool_indices, bsz, dev)
    _check_index("seq_lens", seq_lens, bsz, dev)
    if not isinstance(max_splits, int) or max_splits < 1:
        raise bad("max_splits", max_splits, "an int >= 1", "use mla_decode_max_splits()")
    _check_cfg(cfg, ("block_h", "block_n"))
    mh = cfg.merge_block_h
    if not isinstance(mh, int) or mh < 1 or mh & (mh - 1):
        raise bad("config.merge_block_h", mh, "a power of two >= 1", "pick merge_block_h from 1, 2, 4, 8, 16")
    need = mla_decode_scratch_numel(bsz, h, dv, max_splits)
    if scratch is not None and (scratch.dtype != torch.float32 or scratch.device != dev or scratch.numel() < need):
        raise bad("scratch", f"{scratch.dtype}[{scratch.numel()}]@{scratch.device}", f"float32[>={need}]@{dev}",
                  "size it with mla_decode_scratch_numel() at the largest batch size")
    return dv, dr


def mla_decode_attention(q: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, *,
                         sm_scale: float, max_splits: int, scratch: Optional[torch.Tensor] = None,
                         config: Optional[MLADecodeConfig] = None) -> torch.Tensor:
    """Absorbed-MLA paged decode: one new query per request over its cached latent rows (itself included). ``q`` [B, H,
    D]; ``kv_buffer`` [S, 1, D]; ``out`` [B, H, Dv] (written, returned). Grid ``(cdiv(H, block_h), max_splits, B)``,
    merge ``(B, cdiv(H, merge_block_h))`` (none when 1). ``scratch``: fp32, >= :func:`mla_decode_scratch_numel` (fixed
    for CUDA graphs). No host sync. sglang's two-stage Triton MLA decode. Raises the errors of docs/internals.md."""
    cfg = config or default_mla_decode_config(q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 1,
                                              q.device if isinstance(q, torch.Tensor) else None)
    dv, dr = check_mla_decode(q, kv_buffer, req_to_token, req_pool_indices, seq_lens, out, sm_scale, max_splits,
                              scratch, cfg)
    bsz, h = q.shape[:2]
    if bsz == 0:
        return out
    need = mla_decode_scratch_numel(bsz, h, dv, max_splits)
    direct = max_splits == 1
    if direct:
        o_part, lse = out, out            # unused by the kernel (DIRECT)
        so = (0, 0, 0)
        sl = (0, 0)
    else:
        if scratch is None:
            scratch = torch.empty(need, dtype=torch.float32, device=q.device)
        n_part = bsz * h * max_splits * dv
        o_part = scratch[:n_part]
        if cfg.partial_bf16:   # the same fp32 region, half of it used as bf16
            o_part = o_part.view(torch.bfloat16)[:n_part]
        o_part = o_part.view(bsz, h, max_splits, dv)
        lse = scratch[n_part:need].view(bsz, h, max_splits)
        so = (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        sl = (lse.stride(0), lse.stride(1))
    common = dict(BLOCK_N=cfg.block_n, SPLIT_MIN=cfg.split_min)
    kmla.mla_decode_split_kernel[(triton.cdiv(h, cfg.block_h), max_splits, bsz)](
        q, kv_buffer, req_to_token, req_pool_indices, seq_lens, o_part, lse, out,
        float(sm_scale), h, max_splits,
        q.stride(0), q.stride(1), kv_buffer.stride(0), req_to_token.stride(0), *so, *sl,
        out.stride(0), out.stride(1),
        DL=dv, DR=dr, BLOCK_L=_pow2(dv), BLOCK_R=_pow2(dr), BLOCK_H=cfg.block_h, DIRECT=direct,
        DETACH=bool(cfg.detach), LAZY=bool(cfg.lazy_rescale), UPCAST=_interpreting(),
        **prefetch_constexprs(cfg, kv_buffer.shape[2], kv_buffer.element_size()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    if not direct:
        kmla.mla_decode_merge_kernel[(bsz, triton.cdiv(h, cfg.merge_block_h))](
            o_part, lse, seq_lens, out, h, max_splits, *so, *sl, out.stride(0), out.stride(1),
            DL=dv, BLOCK_L=_pow2(dv), MERGE_H=cfg.merge_block_h, S_PAD=_pow2(max_splits), UPCAST=_interpreting(),
            num_warps=4, **common)
    return out


def check_mla_extend(q, kv_new, kv_buffer, req_to_token, req_pool_indices, qo_indptr, prefix_lens, out,
                     sm_scale, max_extend_len, cfg: MLAExtendConfig) -> tuple[int, int, int]:
    """All inputs of :func:`mla_extend_attention`; returns (batch size, Dv, rope dims)."""
    dv, dr = _check_mla(q, kv_buffer, out, sm_scale)
    t, d = q.shape[0], q.shape[2]
    dev = q.device
    _check_tensor("kv_new", kv_new, 3, (q.dtype,), dev)
    if tuple(kv_new.shape) != (t, 1, d):
        raise bad("kv_new.shape", tuple(kv_new.shape), f"[{t}, 1, {d}]",
                  "pass the step's new latent rows, one per new token")
    _check_tensor("req_to_token", req_to_token, 2, (torch.int32,), dev)
    bsz = int(prefix_lens.shape[0]) if isinstance(prefix_lens, torch.Tensor) and prefix_lens.dim() == 1 else -1
    _check_index("prefix_lens", prefix_lens, bsz, dev)
    _check_index("req_pool_indices", req_pool_indices, bsz, dev)
    _check_index("qo_indptr", qo_indptr, bsz + 1, dev)
    if not isinstance(max_extend_len, int) or max_extend_len < 0:
        raise bad("max_extend_len", max_extend_len, "an int >= 0", "pass max(extend_seq_lens)")
    _check_cfg(cfg, ("block_m", "block_n"))
    return bsz, dv, dr


def mla_extend_attention(q: torch.Tensor, kv_new: torch.Tensor, kv_buffer: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, qo_indptr: torch.Tensor, prefix_lens: torch.Tensor,
                         out: torch.Tensor, *, max_extend_len: int, sm_scale: float,
                         config: Optional[MLAExtendConfig] = None) -> torch.Tensor:
    """Absorbed-MLA extend: new tokens attend to their paged prefix and causally to each other (bottom-right aligned).
    ``q`` [T, H, D], ``kv_new`` [T, 1, D]; ``qo_indptr`` [B+1]; ``prefix_lens`` [B] (via ``req_to_token``);
    ``max_extend_len``: host int, grid ``(cdiv(max_extend_len * H, block_m), B)``; ``out`` [T, H, Dv] written and
    returned. Raises the errors of docs/internals.md."""
    cfg = config or default_mla_extend_config(q.device if isinstance(q, torch.Tensor) else None)
    bsz, dv, dr = check_mla_extend(q, kv_new, kv_buffer, req_to_token, req_pool_indices, qo_indptr, prefix_lens,
                                   out, sm_scale, max_extend_len, cfg)
    t, h = q.shape[:2]
    if bsz == 0 or max_extend_len == 0 or t == 0:
        return out
    grid = (triton.cdiv(max_extend_len * h, cfg.block_m), bsz)
    kmla_ext.mla_extend_kernel[grid](
        q, kv_new, kv_buffer, req_to_token, req_pool_indices, qo_indptr, prefix_lens, out,
        float(sm_scale), h,
        q.stride(0), q.stride(1), kv_new.stride(0), kv_buffer.stride(0), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        DL=dv, DR=dr, BLOCK_L=_pow2(dv), BLOCK_R=_pow2(dr), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DETACH=bool(cfg.detach), LAZY=bool(cfg.lazy_rescale), UPCAST=_interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out

