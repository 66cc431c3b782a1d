"""The e4m3 upcast PTX of pipeline/backends/triton/kernels/fp8.py, executed instruction by instruction on every
byte value and compared with torch's own float8_e4m3fn conversion (bit for bit; NaN for NaN).

The GPU runs the same strings (tests/gpu/test_triton_gpu.py compares fp8 decode/extend with torch_native); this
file proves them exhaustively without one. The interpreter covers exactly the instructions the strings use and
fails on any other, so a new instruction cannot slip past it."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from pipeline.backends.triton.kernels.fp8 import E4M3_TO_BF16, E4M3_TO_F16  # noqa: E402

M32 = 0xFFFFFFFF


def _num(tok: str, regs: dict) -> int:
    return regs[tok] if tok in regs else int(tok, 0)


def _prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))   # no sign-replicate modes used


def _fma16(a: int, c: int, z: int, dtype: torch.dtype) -> int:
    """fma.rn on two 16-bit lanes: a * c + z computed exactly (float64 holds these products), rounded once."""
    def lanes(x):
        return torch.tensor([x & 0xFFFF, x >> 16], dtype=torch.int32).to(torch.int16).view(dtype).double()
    r = (lanes(a) * lanes(c) + lanes(z)).to(dtype).view(torch.int16).int() & 0xFFFF
    return int(r[0]) | (int(r[1]) << 16)


def run_ptx(asm: str, x: int) -> tuple[int, int]:
    """Execute ``asm`` with ``$2 = x``; returns ``($0, $1)``."""
    regs = {"$2": x}
    body = asm.strip()
    assert body[0] == "{" and body[-1] == "}"
    for line in body[1:-1].split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        v = [_num(t, regs) for t in a[1:]]
        if op == "mov.b32":
            r = v[0]
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "add.u32":
            r = (v[0] + v[1]) & M32
        elif op == "sub.u32":
            r = (v[0] - v[1]) & M32
        elif (m := re.fullmatch(r"fma\.rn\.(bf16x2|f16x2)", op)):
            r = _fma16(v[0], v[1], v[2], torch.bfloat16 if m.group(1) == "bf16x2" else torch.float16)
        else:
            raise AssertionError(f"instruction the interpreter does not know: {op}")
        regs[a[0]] = r & M32
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("asm,dtype", [(E4M3_TO_BF16, torch.bfloat16), (E4M3_TO_F16, torch.float16)],
                         ids=["bf16", "fp16"])
def test_every_e4m3_byte_upcasts_exactly(asm, dtype):
    got = []
    for word in range(64):   # bytes 4w .. 4w+3 in one register, as pack=4 hands them over
        x = sum((4 * word + i) << (8 * i) for i in range(4))
        lo, hi = run_ptx(asm, x)
        got += [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]
    y = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(dtype)
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype)
    nan = ref.isnan()
    assert int(nan.sum()) == 2 and bool(y[nan].isnan().all())
    # bit for bit elsewhere: signed zeros and all 14 subnormals included
    assert torch.equal(y[~nan].view(torch.int16), ref[~nan].view(torch.int16))


def test_the_interpreter_rejects_an_unknown_instruction():
    with pytest.raises(AssertionError, match="does not know"):
        run_ptx("{\ncvt.rn.f16x2.e4m3x2 $0, $2;\n}", 0)
