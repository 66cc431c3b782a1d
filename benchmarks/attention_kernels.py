"""Attention-kernel benchmark table: our FlashInfer decode step vs the raw FlashInfer calls.

Prints, for H=32 q / 8 kv heads, head dim 128, bf16, page 16 (the H200 anchor shapes of the team's GPU notes):
our 32-layer decode step (``init_forward_metadata`` + 32 ``forward_decode``) against the same raw
``plan`` + 32 ``run`` calls on one wrapper, eager and under CUDA-graph replay (interleaved wall-clock
medians, ``decode_step_overhead.interleaved``); and the CUDA-core vs tensor-core crossover. If
``benchmarks/triton_kernels.py`` exposes ``rows()``, its rows are appended.

Usage (GPU): ``python benchmarks/attention_kernels.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import flashinfer_gpu_check as chk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    chk.phase_bench()
    with open(os.path.join(a.out, "attention_kernels.json"), "w") as fh:  # full rows for RESULTS.md
        json.dump({"bench": chk.R["bench"], "crossover": chk.R["crossover"]}, fh, indent=1)
    print(f"{'kernel':<28} {'B':>4} {'ctx':>6} {'µs':>9} {'anchor µs':>10} {'ratio':>6} {'graph ratio':>11}")
    for r in chk.R["bench"]:
        print(f"{'flashinfer decode x32 (ours)':<28} {r['B']:>4} {r['ctx']:>6} {r['step_ours_us']:9.1f} "
              f"{r['step_raw_us']:10.1f} {r['step_ratio']:6.3f} {r['graph_ratio']:11.3f}")
    try:
        tk = importlib.import_module("triton_kernels")
    except ImportError:
        tk = None
    if tk is not None and hasattr(tk, "rows"):
        for row in tk.rows():
            print(row if isinstance(row, str) else "  ".join(str(x) for x in (row.values() if isinstance(row, dict) else row)))


if __name__ == "__main__":
    main()
