"""Cold-process time of ``attn-setup plan --device-profile h200 --json`` vs ``python -c "import torch"``.

``plan`` must not import torch, triton or flashinfer, so a fresh process that plans should cost a
fraction of one that merely imports torch (target: <= 0.3x). Each command runs ``--runs`` times
as a new subprocess (after one untimed warm-up that fills the OS file cache); the table shows the
median, min and max wall time in milliseconds and the ratio of medians.

Usage: ``python benchmarks/plan_startup.py [--runs 15]``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

TARGET = 0.3


def _plan_cmd() -> list[str]:
    exe = shutil.which("attn-setup")
    head = [exe] if exe else [sys.executable, "-m", "pipeline.cli"]
    return head + ["plan", "--device-profile", "h200", "--json"]


def time_cmd(cmd: list[str], runs: int) -> list[float]:
    """Wall times in ms of ``runs`` fresh processes of ``cmd`` (each must exit 0)."""
    subprocess.run(cmd, check=True, capture_output=True)  # warm the file cache
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ns = ap.parse_args()
    rows = [("attn-setup plan --device-profile h200 --json", time_cmd(_plan_cmd(), ns.runs)),
            ('python -c "import torch"', time_cmd([sys.executable, "-c", "import torch"], ns.runs)),
            ('python -c "pass"', time_cmd([sys.executable, "-c", "pass"], ns.runs))]
    print(f"{'command':<48} {'median ms':>10} {'min ms':>9} {'max ms':>9}   (n={ns.runs} fresh processes each)")
    for name, ts in rows:
        print(f"{name:<48} {statistics.median(ts):>10.1f} {min(ts):>9.1f} {max(ts):>9.1f}")
    ratio = statistics.median(rows[0][1]) / statistics.median(rows[1][1])
    print(f"ratio plan / import torch (medians): {ratio:.3f}  target <= {TARGET}  "
          f"{'MET' if ratio <= TARGET else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
