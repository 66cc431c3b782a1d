"""Same-run A/B comparison of this tree against an older checkout: setup build time and cold ``plan``.

Both trees are measured in one loop, interleaved, so that load from other work on a shared machine falls on both
sides alike:

* **build**: one long-lived worker process per tree imports that tree's ``benchmarks/pipeline_overhead.py`` and
  times its ``piped`` (``build_attention_backends`` through the machine with JSON-lines logging to a file, bundled
  Llama-3.1-8B, tiny CPU pools) and ``direct`` (the same state functions without machine or log); the driver asks
  worker A then worker B for a batch of ``--batch`` runs, ``--rounds`` times, alternating which goes first.
* **plan**: ``python -m pipeline.cli plan --device-profile h200 --json`` as a fresh process per run, with the working
  directory and ``PYTHONPATH`` at each tree, A and B alternated ``--plan-runs`` times.

Printed per measure: median, 10th and 90th percentile (ms) for A and B, the ratio of medians B/A, and the median of
paired ratios (per round, per A/B pair of processes) with their 10th–90th percentile spread, which is what cancels the machine's load. The old
tree needs its own ``benchmarks/pipeline_overhead.py`` with ``piped``/``direct`` (any commit since issue 2).

    git worktree add --detach /tmp/old a91a56e
    python benchmarks/ab_overhead.py --old /tmp/old [--rounds 40 --batch 25 --plan-runs 40]
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

ROOT = Path(__file__).resolve().parent.parent

_WORKER = r"""
import importlib.util, json, sys, tempfile, time
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
    for _ in range(n):
        for key, fn in (("direct", po.direct), ("piped", lambda r: po.piped(r, path))):
            t, c = time.perf_counter(), time.process_time()
            fn(req)
            out[key + "_cpu"].append((time.process_time() - c) * 1e3)
            out[key].append((time.perf_counter() - t) * 1e3)
        open(path, "w").close()  # keep the log file small: appending would grow it over the run
    print(json.dumps(out), flush=True)
"""


class Worker:
    """One tree's benchmark process, answering batches of timed runs over a pipe."""

    def __init__(self, root: Path):
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(root)], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "ready", f"worker for {root} did not start"

    def batch(self, n: int) -> dict[str, list[float]]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout of the old commit (A)")
    ap.add_argument("--new", type=Path, default=ROOT, help="checkout of the new commit (B); default this tree")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--plan-runs", type=int, default=40)
    ns = ap.parse_args()
    a_root, b_root = ns.old.resolve(), ns.new.resolve()
    keys = {"build wall": "piped", "build CPU": "piped_cpu", "direct wall": "direct", "direct CPU": "direct_cpu"}
    res: dict[str, tuple[list, list, list]] = {k: ([], [], []) for k in keys}
    if ns.rounds:
        wa, wb = Worker(a_root), Worker(b_root)
        try:
            for i in range(ns.rounds):
                first, second = (wa, wb) if i % 2 == 0 else (wb, wa)
                r1, r2 = first.batch(ns.batch), second.batch(ns.batch)
                ra, rb = (r1, r2) if first is wa else (r2, r1)
                for key, src in keys.items():
                    res[key][0].extend(ra[src])
                    res[key][1].extend(rb[src])
                    res[key][2].append(statistics.median(rb[src]) / statistics.median(ra[src]))
        finally:
            wa.close(), wb.close()
    with tempfile.TemporaryDirectory() as pycache:
        for mode, env in _plan_modes(pycache).items():
            for wall_or_cpu in ("wall", "CPU"):
                res[f"cold plan, {mode}, {wall_or_cpu}"] = ([], [], [])
            plan_ms(a_root, env), plan_ms(b_root, env)  # warm the file cache (and write the bytecode)
            for i in range(ns.plan_runs):
                order = (a_root, b_root) if i % 2 == 0 else (b_root, a_root)
                t = {r: plan_ms(r, env) for r in order}
                for j, wall_or_cpu in enumerate(("wall", "CPU")):
                    a, b, r = res[f"cold plan, {mode}, {wall_or_cpu}"]
                    a.append(t[a_root][j]), b.append(t[b_root][j]), r.append(t[b_root][j] / t[a_root][j])
    print(f"A = {a_root}  B = {b_root}")
    print(f"build: {ns.rounds} rounds x {ns.batch} runs per side (paired ratio per round); "
          f"cold plan: {ns.plan_runs} fresh processes per side and mode (paired ratio per A/B pair)")
    print("| measure | A median ms (p10–p90) | B median ms (p10–p90) | B/A medians | paired B/A median (p10–p90) |")
    print("|---|---|---|---|---|")
    for key, (a, b, r) in res.items():
        if len(a) > 1:
            print(row(key, a, b, r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
