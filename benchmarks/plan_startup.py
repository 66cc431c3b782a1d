"""Cold-process time of ``attn-setup plan --device-profile h200 --json`` vs ``python -c "import torch"``.

``plan`` must not import torch, triton or flashinfer, so a fresh process that plans should cost a
fraction of one that merely imports torch (target: <= 0.3x). Each command runs ``--runs`` times
as a new subprocess (after one untimed warm-up that fills the OS file cache); the table shows the
median, min and max wall time in milliseconds and the ratio of medians.

``--model CONFIG`` (repeatable) adds two rows per config: ``plan --model CONFIG`` with transformers' reading of the file
cached (the warm-up run fills the cache: what every plan of a model read before costs) and with the cache off (the
first plan of a file: transformers' configuration module imported, torch hidden, the package inits skipped;
pipeline/core/hf_config.py). The ratio line takes the worst row.

Usage: ``python benchmarks/plan_startup.py [--runs 15] [--model examples/configs/gemma-3-12b-it.json ...]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

TARGET = 0.3


def _plan_cmd(model: str | None = None) -> list[str]:
    exe = shutil.which("attn-setup")
    head = [exe] if exe else [sys.executable, "-m", "pipeline.cli"]
    return head + ["plan", "--device-profile", "h200", "--json"] + (["--model", model] if model else [])


def time_cmd(cmd: list[str], runs: int, env: dict[str, str] | None = None) -> list[float]:
    """Wall times in ms of ``runs`` fresh processes of ``cmd`` (each must exit 0; ``env`` added to the environment)."""
    env = {**os.environ, **(env or {})}
    subprocess.run(cmd, check=True, capture_output=True, env=env)  # warm the file cache (and the reading cache)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--model", action="append", default=[], help="a config.json to plan (repeatable)")
    ns = ap.parse_args()
    torch_ms = time_cmd([sys.executable, "-c", "import torch"], ns.runs)
    plans = [("plan --device-profile h200 --json", time_cmd(_plan_cmd(), ns.runs))]
    for m in ns.model:
        name = f"plan ... --model {m.rsplit('/', 1)[-1]}"
        plans += [(name, time_cmd(_plan_cmd(m), ns.runs)),
                  (f"  same, reading not cached", time_cmd(_plan_cmd(m), ns.runs, {"ATTN_SETUP_CACHE_DIR": "off"}))]
    rows = plans + [('python -c "import torch"', torch_ms),
                    ('python -c "pass"', time_cmd([sys.executable, "-c", "pass"], ns.runs))]
    width = max(48, *(len(n) for n, _ in rows))
    print(f"{'command':<{width}} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'/ torch':>8}   "
          f"(n={ns.runs} fresh processes each)")
    for name, ts in rows:
        ratio = statistics.median(ts) / statistics.median(torch_ms)
        print(f"{name:<{width}} {statistics.median(ts):>10.1f} {min(ts):>9.1f} {max(ts):>9.1f} {ratio:>8.3f}")
    worst = max(statistics.median(ts) for _, ts in plans) / statistics.median(torch_ms)
    print(f"worst ratio plan / import torch (medians): {worst:.3f}  target <= {TARGET}  "
          f"{'MET' if worst <= TARGET else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
