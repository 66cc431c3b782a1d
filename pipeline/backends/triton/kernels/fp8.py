"""fp8 KV tiles upcast to q's dtype in registers: e4m3 by integer operations, everything else by ``.to``.

Why not ``.to`` for e4m3: Triton lowers ``float8e4nv -> bfloat16`` through conversion instructions
(``cvt.rn.f16x2.e4m3x2``, then f16 -> bf16), which run on the SM's quarter-rate conversion unit; at B=64 ctx
4096 (32 q / 8 kv heads, D 128, H200) the decode kernel was bound by them: 0.895-0.899x FlashInfer's fp8 decode
against 0.957-0.958x for e5m2, whose upcast Triton already does with bit operations. Rebuilt here from integer
operations at full rate (a ``prmt`` per two values, shift, masks, one packed multiply), the same shape of trick
as FlashInfer's ``fast_dequant`` in ``vec_dtypes.cuh``: e4m3 0.896 -> 0.960-0.962x in one process, outputs
bit-equal (benchmarks/NOTES.md, fifth pass).

The bits (one e4m3 byte ``s eeee mmm`` in the high byte of a 16-bit lane):

* bf16 ``s 0000eeee mmm0000`` is the value times 2^-120 exactly, subnormals included (exponent field 0 is a
  bf16 subnormal with the same mantissa); one ``fma.rn.bf16x2`` by 2^120 (+ -0, so a zero keeps its sign)
  makes it the value. Every e4m3 value is then a normal bf16 or zero, so the multiply is exact.
* fp16 ``s 0eeee mmm0000000`` is the value times 2^-8 exactly (fp16 has subnormals down to 2^-24; e4m3's
  smallest is 2^-9); one ``fma.rn.f16x2`` by 2^8.
* NaN (``s 1111 111``; e4m3fn has no infinities) would come out as +-480: its lane gets the exponent field
  all ones OR-ed in, which with 480's nonzero mantissa is a NaN, so a NaN written to the cache still poisons
  the outputs that read it, as ``.to`` does.

Checked exhaustively (all 256 bytes, both targets) in tests/test_triton_fp8_upcast.py against torch's own
conversion, by executing these same instruction strings on the bytes through a small PTX interpreter. Used
only in compiled kernels (``UPCAST`` False): our Triton backend runs on CUDA sm80-sm90 (``fma.rn.bf16x2`` needs
sm80); under ``TRITON_INTERPRET=1`` the tiles go through ``.to``.
"""

import triton
import triton.language as tl


def e4m3_asm(shift: int, mask: int, one: int, nan_shift: int) -> str:
    """PTX for ``tl.inline_asm_elementwise(..., "=r,=r,r", pack=4)``: four e4m3 bytes in ``$2`` to four 16-bit
    values in ``$0`` (bytes 0, 1) and ``$1`` (bytes 2, 3). ``shift``/``mask`` put the byte's exponent and
    mantissa into the target format's fields, ``one`` is the packed 16-bit constant that undoes the exponent
    offset (2^120 in bf16, 2^8 in fp16), ``nan_shift`` turns a lane's 0x8000 into its all-ones exponent."""
    lines = ["{", ".reg .b32 a, m, t, n, c, z;", f"mov.b32 c, {one:#010x};", "mov.b32 z, 0x80008000;"]
    kind = "bf16x2" if one == 0x7B807B80 else "f16x2"
    for out, sel in (("$0", "0x1404"), ("$1", "0x3424")):
        lines += [f"prmt.b32 a, $2, 0, {sel};",             # lane i: byte << 8
                  f"shr.b32 m, a, {shift};", f"and.b32 m, m, {mask:#010x};",
                  "and.b32 t, a, 0x80008000;", "or.b32 m, m, t;",
                  f"fma.rn.{kind} m, m, c, z;",
                  "and.b32 t, a, 0x7F007F00;", "add.u32 t, t, 0x01000100;", "and.b32 t, t, 0x80008000;",
                  f"shr.b32 n, t, {nan_shift};", "sub.u32 t, t, n;",   # 0x8000 -> exponent all ones in NaN lanes
                  f"or.b32 {out}, m, t;"]
    return "\n".join(lines + ["}"])


E4M3_TO_BF16 = e4m3_asm(4, 0x07F007F0, 0x7B807B80, 8)
E4M3_TO_F16 = e4m3_asm(1, 0x3F803F80, 0x5C005C00, 5)
_BF16_ASM: tl.constexpr = tl.constexpr(E4M3_TO_BF16)
_F16_ASM: tl.constexpr = tl.constexpr(E4M3_TO_F16)


@triton.jit
def _kv_up(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """A loaded K/V tile in q's ``dtype`` (bf16/fp16): e4m3 through the integer PTX above when compiled, any
    other case (e5m2, 16-bit caches, the CPU interpreter) through ``.to``. Exact either way."""
    if UPCAST:
        return x.to(dtype)
    else:
        if x.dtype == tl.float8e4nv:
            xb = x.to(tl.uint8, bitcast=True)
            if dtype == tl.bfloat16:
                return tl.inline_asm_elementwise(_BF16_ASM, "=r,=r,r", [xb], dtype=tl.bfloat16, is_pure=True,
                                                 pack=4)
            else:
                return tl.inline_asm_elementwise(_F16_ASM, "=r,=r,r", [xb], dtype=tl.float16, is_pure=True,
                                                 pack=4)
        else:
            return x.to(dtype)
