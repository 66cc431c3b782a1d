"""Where the first CUDA-graph capture of a process puts its device memory (the one-time cost the estimate does not model).

A fresh process does, one step at a time, what the decode-graph capture step does, and prints for each step the
drop in the device's free memory (``torch.cuda.mem_get_info``, MiB), the change in what PyTorch's caching
allocator has reserved (``torch.cuda.memory_reserved``) and the rest — device memory taken outside the allocator
(driver, CUDA graph executables, library handles, lazily loaded kernel modules):

    context + a matmul on the default stream (the runner has done this before capture: model load, verification)
    a new side stream;  a matmul on it (cuBLAS workspace for that stream);  a first capture of an elementwise op
    (graph machinery);  its replay;  a second capture;  a captured matmul;  a captured Triton kernel.

``--eager-modules`` sets ``CUDA_MODULE_LOADING=EAGER`` (kernel modules loaded at context creation, not on first
launch). GPU only: ``python3 benchmarks/first_capture_probe.py [--eager-modules] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eager-modules", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.eager_modules:
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    import torch

    rows: list[dict] = []
    last = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        free, reserved = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        if last:
            drop = (last["free"] - free) / MiB
            res = (reserved - last["reserved"]) / MiB
            rows.append(dict(step=name, device_drop_mib=round(drop, 2), allocator_mib=round(res, 2),
                             outside_allocator_mib=round(drop - res, 2)))
        last.update(free=free, reserved=reserved)

    torch.cuda.init()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = x @ w
    mark("start")
    rows.clear()
    s = torch.cuda.Stream()
    mark("new side stream")
    with torch.cuda.stream(s):
        y = x @ w
    mark("matmul on the side stream")
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=s):
        z1 = x * 2 + 1
    mark("first capture (elementwise)")
    g1.replay()
    mark("its replay")
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=s):
        z2 = x * 3 + 1
    mark("second capture (elementwise)")
    g3 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g3, stream=s):
        z3 = x @ w
    mark("captured matmul")
    g3.replay()
    mark("its replay")
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _add(X, Y, N: tl.constexpr):
            o = tl.arange(0, N)
            tl.store(Y + o, tl.load(X + o) + 1)

        xf = torch.randn(1024, device="cuda")
        yf = torch.empty_like(xf)
        _add[(1,)](xf, yf, N=1024)
        mark("triton kernel eager (compile + module load)")
        g4 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g4, stream=s):
            _add[(1,)](xf, yf, N=1024)
        mark("captured triton kernel")
    except Exception as e:  # noqa: BLE001 - a probe row, not a failure
        rows.append(dict(step="triton", error=repr(e)[:200]))
    del y, z1, z2, z3
    print(f"{'step':48} {'device MiB':>11} {'allocator':>10} {'outside':>8}")
    for r in rows:
        if "error" in r:
            print(r["step"], r["error"])
            continue
        print(f"{r['step']:48} {r['device_drop_mib']:11.2f} {r['allocator_mib']:10.2f} {r['outside_allocator_mib']:8.2f}")
    print("total outside the allocator:", round(sum(r.get("outside_allocator_mib", 0) for r in rows), 2), "MiB;",
          "CUDA_MODULE_LOADING =", os.environ.get("CUDA_MODULE_LOADING", "(default: LAZY)"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, module_loading=os.environ.get("CUDA_MODULE_LOADING")), f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
