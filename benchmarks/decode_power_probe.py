"""Our Triton decode vs FlashInfer on the B=256 shapes, alternated, with the card's clocks and power.

The three-run table of ``triton_kernels.py`` runs minutes of full-bandwidth load; at B=256 ctx 32768 our unsplit
decode lost 2-4 % per run against FlashInfer there while FlashInfer's time did not move. This probe separates the
kernels from the order and the load: both sides (and two decode-config variants) are captured once over one pool
(scrambled pages), then timed as CUDA-graph replays in alternating order, four rounds, and ``nvidia-smi`` is read
after each round (SM and memory clock in MHz, power in W, temperature in C, active throttle reasons as a bit mask:
0x4 is the software power cap). Ratio = FlashInfer time / ours. GPU only, FlashInfer needed:
``python3 benchmarks/decode_power_probe.py``. Results: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_kernels as tk  # noqa: E402  (the benchmark's pools, FlashInfer and Triton callers)

SHAPES = ((256, 32768), (256, 4096))   # (B, ctx)
ROUNDS = 4


def smi() -> str:
    """One ``nvidia-smi`` line: SM clock, memory clock, power draw, temperature, active throttle reasons."""
    q = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False).stdout.strip()


def probe(b: int, ctx: int, ws: torch.Tensor) -> None:
    """Capture FlashInfer and our decode (default; 4 warps per unsplit program, the default before 2026-12-02;
    128-key unsplit tiles; 4 stages) and time them ROUNDS times."""
    from pipeline.backends.triton import launch

    pool = tk.Pool((b * ctx // tk.PAGE + 1) * tk.PAGE, "cuda")
    pg, r2t = pool.pages(b, ctx, seed=b * 7 + ctx)
    q = torch.randn(b, tk.H, tk.D, dtype=torch.bfloat16, device="cuda")
    keep = []   # the closures own what the graphs read (FlashInfer's plan buffers, our index tensors)
    graphs = {}
    run, _ = tk.fi_decode(pool, pg, q, ws)
    keep.append(run)
    graphs["fi"] = tk._graph(run)
    d0 = launch.default_decode_config(tk.D, torch.device("cuda"))
    for name, cfg in (("ours", d0), ("w4", dataclasses.replace(d0, num_warps_single=4)),
                      ("n128", dataclasses.replace(d0, block_n_single=128)),
                      ("s4", dataclasses.replace(d0, num_stages=4))):
        run, _ = tk.ours_decode(pool, r2t, q, cfg)
        keep.append(run)
        graphs[name] = tk._graph(run)
    print("clocks before", smi(), flush=True)
    for rnd in range(ROUNDS):
        order = list(graphs) if rnd % 2 == 0 else list(reversed(list(graphs)))
        t = {n: tk._us(graphs[n]) for n in order}
        cols = " ".join(f"{n} {t[n]:8.1f}us ratio {t['fi'] / t[n]:.3f}" for n in graphs)
        print(f"B={b} ctx={ctx} round {rnd} order {order}: {cols} | {smi()}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("decode_power_probe needs a CUDA GPU and FlashInfer")
    tk._FI_OK = None   # compile FlashInfer modules in this process if they are not cached
    ws = torch.empty(tk.WS_BYTES, dtype=torch.uint8, device="cuda")
    for b, ctx in SHAPES:
        probe(b, ctx, ws)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
