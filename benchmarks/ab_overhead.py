"""Same-run A/B comparison of this tree against an older checkout: setup build time and cold ``plan``.

Both trees are measured in one loop, interleaved, so that load from other work on a shared machine falls on both
sides alike:

* **build**: one long-lived worker process per tree imports that tree's ``benchmarks/pipeline_overhead.py`` and
  times its ``piped`` (``build_attention_backends`` through the machine with JSON-lines logging to a file, bundled
  Llama-3.1-8B, tiny CPU pools) and ``direct`` (the same state functions without machine or log); the driver asks
  worker A then worker B for a batch of ``--batch`` runs, ``--rounds`` times, alternating which goes first. The rounds
  are served by ``--workers`` fresh worker pairs in turn (default 5): the bundled model's pools are 64 tensors of
  128 KiB, glibc's mmap threshold, and a process whose heap happens to hand them back to the kernel after each build
  faults 8 MiB in again on the next (~2,000 minor faults and ~4 ms per build, both sides alike), so one long-lived
  worker can sit in that mode for a whole run; the minor faults per build are printed per tree, and ``--pin-heap``
  fixes glibc's thresholds for every worker alike so that no build is in that mode.
* **plan**: ``python -m pipeline.cli plan --device-profile h200 --json`` as a fresh process per run, with the working
  directory and ``PYTHONPATH`` at each tree, A and B alternated ``--plan-runs`` times.

Several new trees (``--new B C``) are measured in the same loop, each round in a rotated order. Printed per
measure and tree: median, 10th and 90th percentile (ms) of A and of the tree, the ratio of medians, and the median
of paired ratios (per round of batches, per round of fresh processes) with their 10th–90th percentile spread, which
is what cancels the machine's load. The old tree needs its own ``benchmarks/pipeline_overhead.py`` with
``piped``/``direct``.

    git worktree add --detach /tmp/old a91a56e
    python benchmarks/ab_overhead.py --old /tmp/old [--new TREE …] [--rounds 40 --batch 25 --plan-runs 40]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent

_WORKER = r"""
import importlib.util, json, resource, sys, tempfile, time
root = sys.argv[1]
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("po", root + "/benchmarks/pipeline_overhead.py")
po = importlib.util.module_from_spec(spec); spec.loader.exec_module(po)
from pipeline.cli import configure_logging
configure_logging(verbose=False)
model = po.load_model_spec(root + "/examples/configs/llama-3.1-8b.json")
req = po.SetupRequest(args=po.AttentionArgs(), model=model, device="cpu",
                      pool=po.PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64))
path = tempfile.mktemp(suffix=".jsonl")
import torch
torch.set_num_threads(1)  # both sides alike: no intra-op threads spinning against other work on a shared machine
for _ in range(20):
    po.direct(req); po.piped(req, path)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    out = {"direct": [], "piped": [], "direct_cpu": [], "piped_cpu": []}
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        for key, fn in (("direct", po.direct), ("piped", lambda r: po.piped(r, path))):
            t, c = time.perf_counter(), time.process_time()
            fn(req)
            out[key + "_cpu"].append((time.process_time() - c) * 1e3)
            out[key].append((time.perf_counter() - t) * 1e3)
        open(path, "w").close()  # keep the log file small: appending would grow it over the run
    out["minflt"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / n  # per direct + piped pair
    print(json.dumps(out), flush=True)
"""


class Worker:
    """One tree's benchmark process, answering batches of timed runs over a pipe."""

    def __init__(self, root: Path, env_extra: Optional[dict[str, str]] = None):
        env = dict(os.environ, PYTHONPATH=str(root), **(env_extra or {}))
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root)], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "ready", f"worker for {root} did not start"

    def batch(self, n: int) -> dict[str, Any]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def plan_ms(root: Path, env_extra: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + sys) time in ms of one fresh ``plan --device-profile h200 --json`` process in ``root``.

    Raises ``subprocess.CalledProcessError`` when the command does not exit 0.
    """
    env = dict(os.environ, PYTHONPATH=str(root), **env_extra)
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", "--device-profile", "h200", "--json"],
                   cwd=root, env=env, check=True, capture_output=True)
    wall = (time.perf_counter() - t) * 1e3
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1e3


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=10)[0] if q == 0.1 else statistics.quantiles(xs, n=10)[-1]


def row(name: str, a: list[float], b: list[float], ratios: list[float]) -> str:
    """One table row: medians and 10/90th percentiles of A and B, ratio of medians, paired ratios' median and spread."""
    ma, mb = statistics.median(a), statistics.median(b)
    return (f"| {name} | {ma:.3f} ({_pct(a, .1):.3f}–{_pct(a, .9):.3f}) | {mb:.3f} ({_pct(b, .1):.3f}–"
            f"{_pct(b, .9):.3f}) | {mb / ma:.3f} | {statistics.median(ratios):.3f} "
            f"({_pct(ratios, .1):.3f}–{_pct(ratios, .9):.3f}) |")


def _plan_modes(pycache: str) -> dict[str, dict[str, str]]:
    """The two cold-start cases: bytecode cached (what an installed package has) and compiled on every import."""
    return {"pyc cached": {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": pycache},
            "no pyc": {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": pycache + "-unused"}}


def _rotated(items: list, i: int) -> list:
    """``items`` rotated by ``i`` (each tree goes first in turn, so none always runs right after another)."""
    k = i % len(items)
    return items[k:] + items[:k]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout of the old commit (A)")
    ap.add_argument("--new", type=Path, nargs="+", default=[ROOT],
                    help="checkouts compared with A in the same loop (B, C, …); default this tree")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--plan-runs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=5,
                    help="fresh worker processes per tree over the build rounds (each serves rounds/workers rounds)")
    ap.add_argument("--pin-heap", action="store_true",
                    help="every worker (both trees alike) with glibc's mmap and trim thresholds fixed at 1 GiB "
                         "(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_): the pools stay on the heap and no "
                         "build faults them in again; default: the allocator as it comes")
    ns = ap.parse_args()
    roots = [ns.old.resolve()] + [p.resolve() for p in ns.new]
    keys = {"build wall": "piped", "build CPU": "piped_cpu", "direct wall": "direct", "direct CPU": "direct_cpu"}
    # measure → tree → (every time, per-round medians)
    res: dict[str, dict[Path, tuple[list, list]]] = {}
    faults: dict[Path, list[float]] = {r: [] for r in roots}
    per_worker = -(-ns.rounds // max(ns.workers, 1)) if ns.rounds else 0
    for first in range(0, ns.rounds, per_worker or 1):
        pin = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)} if ns.pin_heap else None
        workers = {r: Worker(r, pin) for r in roots}
        try:
            for i in range(first, min(first + per_worker, ns.rounds)):
                got = {r: workers[r].batch(ns.batch) for r in _rotated(roots, i)}
                for r, out in got.items():
                    faults[r].append(out["minflt"])
                    for key, src in keys.items():
                        times, meds = res.setdefault(key, {}).setdefault(r, ([], []))
                        times.extend(out[src])
                        meds.append(statistics.median(out[src]))
        finally:
            for w in workers.values():
                w.close()
    with tempfile.TemporaryDirectory() as pycache:
        for mode, env in _plan_modes(pycache).items():
            for r in roots:
                plan_ms(r, env)  # warm the file cache (and write the bytecode)
            for i in range(ns.plan_runs):
                t = {r: plan_ms(r, env) for r in _rotated(roots, i)}
                for j, wall_or_cpu in enumerate(("wall", "CPU")):
                    for r in roots:
                        times, meds = res.setdefault(f"cold plan, {mode}, {wall_or_cpu}", {}).setdefault(r, ([], []))
                        times.append(t[r][j]), meds.append(t[r][j])
    print(f"A = {roots[0]}")
    print(f"build: {ns.rounds} rounds x {ns.batch} runs per tree (paired ratio per round), "
          f"{-(-ns.rounds // per_worker) if per_worker else 0} worker process(es) per tree in turn; "
          f"cold plan: {ns.plan_runs} fresh processes per tree and mode (paired ratio per round of processes)")
    print("| measure | tree | A median ms (p10–p90) | tree median ms (p10–p90) | tree/A medians | "
          "paired tree/A median (p10–p90) |")
    print("|---|---|---|---|---|---|")
    for key, by in res.items():
        a_times, a_meds = by[roots[0]]
        for r in roots[1:]:
            times, meds = by[r]
            print(row(f"{key} | {r}", a_times, times, [m / am for m, am in zip(meds, a_meds)]))
    for r in roots:
        if faults[r]:
            print(f"minor page faults per direct + piped pair, {r}: median {statistics.median(faults[r]):.0f}, "
                  f"max of a round {max(faults[r]):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
