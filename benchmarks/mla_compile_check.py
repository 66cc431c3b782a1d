"""Compile the MLA Triton kernels for a GPU arch without a GPU and report what each config costs.

For every decode config of :data:`pipeline.backends.triton.launch_mla.MLA_DECODE_CONFIGS` and
:data:`~pipeline.backends.triton.launch_mla.SWEEP_DECODE` (and the extend configs) at 512 + 64 dims,
bf16, this runs Triton's own compiler (``triton.compile`` on an ``ASTSource``, pointers and strides
marked 16-divisible as the runtime specialises them) down to a cubin with the ptxas bundled in the
triton wheel, and prints: dynamic shared memory (bytes), registers per thread and spill stack
(``cuobjdump -res-usage``), whether the dots became wgmma (sm90) or mma.sync, the warp layout of each
dot (``warpsPerCTA``), and whether the cache loads were pipelined (async copies). A config that needs
more shared memory than the arch has, or spills, is visible before any GPU time is spent.

Usage (CPU is fine): ``python benchmarks/mla_compile_check.py [--arch 90] [--only NAME]``.
The Triton version here may differ from the GPU machine's; layouts and budgets are indicative.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pipeline.backends.triton import launch_mla  # noqa: E402
from pipeline.backends.triton.kernels import mla as kmla  # noqa: E402
from pipeline.backends.triton.kernels import mla as kmla_ext

DV, DR = 512, 64
_TYPES = {"Q": "*bf16", "KV": "*bf16", "KVNew": "*bf16", "ReqToToken": "*i32", "ReqIdx": "*i64", "SeqLens": "*i32",
          "OPart": "*fp32", "LsePart": "*fp32", "Out": "*bf16", "sm_scale": "fp32", "QoIndptr": "*i32",
          "PrefixLens": "*i32"}


def compile_kernel(fn, const: dict, num_warps: int, num_stages: int, arch: int, types: dict = _TYPES):
    """triton.compile for ``arch`` with the constexprs ``const``; pointers/strides marked 16-divisible."""
    sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in const and (types.get(n, "i32").startswith("*") or n.startswith("stride"))}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def report(c) -> dict:
    """Shared memory, registers, spills, MMA kind, dot layouts and async copies of a compiled kernel."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ttgir = c.asm["ttgir"]
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    return dict(shared=c.metadata.shared, regs=int(reg.group(1)) if reg else None,
                spill_stack=int(stack.group(1)) if stack else None,
                mma="wgmma" if "versionMajor = 3" in ttgir else "mma.sync" if "nvidia_mma" in ttgir else "none",
                dot_warps=sorted(set(re.findall(r"nvidia_mma<\{versionMajor = \d+, versionMinor = \d+, "
                                                r"warpsPerCTA = (\[\d+, \d+\])", ttgir))),
                async_copies=ttgir.count("async_copy_global_to_local"))


def decode_const(cfg: launch_mla.MLADecodeConfig, direct: bool) -> dict:
    return dict(DL=DV, DR=DR, BLOCK_L=DV, BLOCK_R=DR, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                SPLIT_MIN=cfg.split_min, DIRECT=direct, DETACH=cfg.detach, LAZY=cfg.lazy_rescale, UPCAST=False,
                **launch_mla.prefetch_constexprs(cfg, DV + DR, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", help="a config name substring")
    a = ap.parse_args()
    arch_class = "sm90" if a.arch == 90 else "other"
    cands = [(f"default[{h}]", c) for h, c in launch_mla.MLA_DECODE_CONFIGS[arch_class].items()]
    cands += list(launch_mla.SWEEP_DECODE) if a.arch == 90 else []
    limit = {90: 232448, 80: 166912, 86: 101376, 89: 101376}.get(a.arch)
    print(f"triton {triton.__version__}, sm_{a.arch}, shared memory limit per block {limit} B")
    for name, cfg in cands:
        if a.only and a.only not in name:
            continue
        for direct in (False, True):
            types = dict(_TYPES, OPart="*bf16" if cfg.partial_bf16 else "*fp32")
            try:
                r = report(compile_kernel(kmla.mla_decode_split_kernel, decode_const(cfg, direct), cfg.num_warps,
                                          cfg.num_stages, a.arch, types))
                fits = "" if limit is None or r["shared"] <= limit else "  TOO MUCH SHARED MEMORY"
                print(f"decode {name:26} direct={int(direct)} {r}{fits}")
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"decode {name:26} direct={int(direct)} error: {str(e).splitlines()[0][:200]}")
    ecfg = launch_mla.MLA_EXTEND_CONFIGS[arch_class]
    const = dict(DL=DV, DR=DR, BLOCK_L=DV, BLOCK_R=DR, BLOCK_M=ecfg.block_m, BLOCK_N=ecfg.block_n,
                 DETACH=ecfg.detach, LAZY=ecfg.lazy_rescale, UPCAST=False)
    r = report(compile_kernel(kmla_ext.mla_extend_kernel, const, ecfg.num_warps, ecfg.num_stages, a.arch))
    print(f"extend default {ecfg}: {r}")
    mconst = dict(DL=DV, BLOCK_L=DV, MERGE_H=1, S_PAD=64, BLOCK_N=32, SPLIT_MIN=128, UPCAST=False)
    print(f"merge (1 head, 64 splits): {report(compile_kernel(kmla.mla_decode_merge_kernel, mconst, 4, 3, a.arch))}")


if __name__ == "__main__":
    main()
