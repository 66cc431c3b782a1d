"""How much of ``attn-setup run``'s wall time the ``startup_summary`` names, per bundled config.

Each config runs as its own process (``python -m pipeline.cli run --json …``); the wall time is taken
from outside, from just before the process is spawned to its exit, and compared with the named
top-level phases of the run's ``startup_summary`` (read back from its log). ``after`` is what the
summary cannot see: from the summary record to the process's exit (the report printed, the exit).

    python benchmarks/startup_coverage.py                        # CPU, every bundled config
    python benchmarks/startup_coverage.py --device cuda --extra="--attention-backend flashinfer" \\
        --configs llama-3.1-8b,qwen3-8b                          # GPU (graphs captured by default)

Exit 1 when a config's coverage is below ``--min-coverage`` (default 0.95) or its run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"


def one(config: Path, device: str, extra: list[str], tmp: str) -> dict:
    log = os.path.join(tmp, f"{config.stem}.jsonl")
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--device", device, "--model", str(config), "--json",
           "--log-file", log, *extra]
    t0 = time.time_ns()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    t1 = time.time_ns()
    recs = [json.loads(line) for line in open(log, encoding="utf-8")] if os.path.exists(log) else []
    s = next((r for r in reversed(recs) if r["event"] == "startup_summary"), None)
    if s is None:
        return {"config": config.stem, "rc": p.returncode, "error": (p.stderr or p.stdout)[-300:]}
    top = sorted((ph for ph in s["phases"] if not ph["parent"]), key=lambda ph: -ph["seconds"])
    named = sum(ph["seconds"] for ph in top)
    wall = (t1 - t0) / 1e9
    return {"config": config.stem, "rc": p.returncode, "wall_s": wall, "named_s": named, "coverage": named / wall,
            "after_s": (t1 - s["ts_ns"]) / 1e9, "spawn_s": (s["process_start_ns"] - t0) / 1e9,
            "unaccounted_s": s["unaccounted_s"], "top3": ", ".join(f"{ph['name']} {ph['seconds']:.2f}" for ph in top[:3])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default="", help="comma-separated config stems (default: every bundled config)")
    ap.add_argument("--extra", default="", help="more run flags, one shell-quoted string")
    ap.add_argument("--min-coverage", type=float, default=0.95)
    a = ap.parse_args()
    configs = sorted(CONFIGS.glob("*.json"))
    if a.configs:
        want = set(a.configs.split(","))
        configs = [c for c in configs if c.stem in want]
    bad = 0
    print(f"| config | exit | wall s (outside) | named s | coverage | unaccounted s | after summary s | largest phases |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for c in configs:
            r = one(c, a.device, shlex.split(a.extra), tmp)
            if "error" in r:
                bad += 1
                print(f"| {r['config']} | {r['rc']} | no startup_summary: {r['error']!r} |")
                continue
            bad += r["rc"] != 0 or r["coverage"] < a.min_coverage
            print(f"| {r['config']} | {r['rc']} | {r['wall_s']:.2f} | {r['named_s']:.2f} | {r['coverage'] * 100:.1f} % "
                  f"| {r['unaccounted_s']:.3f} | {r['after_s']:.3f} | {r['top3']} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
