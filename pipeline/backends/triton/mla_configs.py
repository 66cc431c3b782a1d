"""Tuning of the absorbed-MLA Triton kernels: the decode and extend tile configs, the defaults per arch class and head
count, the candidates ``benchmarks/mla_decode.py --sweep`` times, and the split-K cap chosen against wave
quantisation. The launchers that use them are :mod:`pipeline.backends.triton.launch_mla` (import from there).
Tile choices and their measurement: ``benchmarks/NOTES.md`` (MLA section).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton

MLA_MAX_LATENT_DIM = 512   # the [BLOCK_H, 512] fp32 accumulator is the register budget of a program
MLA_MAX_ROPE_DIM = 128


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tuning of the MLA decode kernels.

    ``block_h``: q heads per program (the M of ``tl.dot``; >= 16); ``block_n``: cache rows per tile
    (>= 16); ``num_warps``/``num_stages``: Triton's; ``split_min``: fewest keys per split (a request gets
    ``ceil(len / split_min)`` splits, capped); ``programs_per_sm``: stage-1 programs resident per SM
    (shared memory / registers allow 1 at 64 heads), which with the batch size sets the split cap
    (:func:`mla_decode_max_splits`); ``max_splits_cap``: hard cap;
    ``detach``: compute the softmax in a region so Triton splits the score tile over the warp groups
    instead of replicating it (matters at 64 heads x 8 warps, see :mod:`.kernels.mla`);
    ``lazy_rescale``: raise the running max only when it grows by more than 2^8 (skips most [M, 512]
    accumulator rescales; exact); ``partial_bf16``: store the split partials in bf16 instead of fp32
    (half the partials' bytes — at B=8, ctx 4096 with 8 splits fp32 partials move about as many bytes
    as the latent itself — for one more bf16 rounding of the output, as FlashInfer's MLA stores its
    partial outputs in the output dtype); ``merge_block_h``: heads per merge program (a power of two;
    1 = one program per (request, head), the most parallel).
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


# Default decode configs by head count (the smallest key >= H; the largest key above that), per arch
# class. sm90: 227 KB of shared memory per block; "other" tiles fit 99 KB (sm86/89; sm80 has 163 KB).
# Registers / shared memory / spills of each were read from an offline sm90 (and sm80/89) compile.
# Rationale and the H200 measurements: benchmarks/NOTES.md, "MLA decode".
MLA_DECODE_CONFIGS: dict[str, dict[int, MLADecodeConfig]] = {
    "sm90": {
        # 16 heads (DeepSeek-V2-Lite, or V3 at TP 8): memory-bound; mma.sync tiles of 16 rows, 180
        # registers x 4 warps and 56 KB: two programs per SM.
        16: MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, split_min=128, programs_per_sm=2),
        # More heads: 64 heads per program on wgmma (two warp groups split the 512 output dims, 128 fp32
        # accumulator registers each), 64-row latent tiles double-buffered with the req_to_token indices
        # copied a stage ahead (3 stages: 225 KB, no spill), eager rescale (the lazy one's block-wide vote
        # cost more than the multiplies on the H200: 0.280 vs 0.237x at 32-key tiles), 64-key splits.
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


# Candidates ``benchmarks/mla_decode.py --sweep`` times at 128 heads (name, config); one GPU run picks. Offline
# sm90 compile (Triton 3.9): shared memory / registers / spill bytes in the comments.
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
    """Split cap for a batch size, chosen against wave quantisation.

    With ``P = B * cdiv(H, block_h)`` programs per split and ``slots = programs_per_sm * SMs`` running
    at once, ``s`` splits take about ``ceil(P * s / slots) / s`` (in units of one unsplit request's time).
    Candidates stop at two waves' worth of programs (:func:`mla_split_candidates`): more splits mostly
    add partial outputs (``B * H * s * 512 * 4`` B written and merged), which the model leaves out; a
    larger cap is taken only when it cuts the modelled time by more than :data:`SPLIT_GAIN`. Unlike a
    plain ``floor(slots / P)`` this splits B=40 x 2 head blocks (80 programs: 61 % of 132 SMs busy) three
    ways (240 programs in 2 waves, 2/3 of the time) and leaves B=64 (128 programs) unsplit. Depends on the
    batch size (and the layer), never on sequence lengths, so it is fixed per captured CUDA graph. 1 means
    the batch fills the GPU: stage 1 writes the output itself (no merge).
    """
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
