"""``attn-setup run --device cuda`` for every bundled config: resolved pair, verified instances, worst error, exit code.

Issue 13, section 1 is done when every run here exits 0. Runs (each a subprocess, as a user would):
every ``examples/configs/*.json`` with the default backend choice, plus the issue's two reported
commands — Gemma-2 with ``--attention-backend flashinfer --dtype bfloat16 --page-size 16`` and
gpt-oss with ``--page-size 16`` (auto). Prints one table row per run and writes ``--out``/
``gpu_bundled_configs.json`` (rows, with each run's ``--json`` report) and each run's trace.

Usage (GPU machine, repository root): ``python3 benchmarks/gpu_bundled_configs.py --out DIR [--timeout 240]``
(``--device cpu`` smoke-tests the script: torch_native; the two GPU-backend runs are refused, exit 3).
Exit code: 0 when every run exited 0 with every instance verified, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"
EXTRA = [("gemma-2-9b.json", ["--attention-backend", "flashinfer", "--dtype", "bfloat16", "--page-size", "16"]),
         ("gpt-oss-20b.json", ["--page-size", "16"])]


def runs() -> list[tuple[str, list[str]]]:
    return [(p.name, []) for p in sorted(CONFIGS.glob("*.json"))] + EXTRA


def run_one(config: str, flags: list[str], out: Path, timeout: float, device: str = "cuda") -> dict:
    """One ``attn-setup run --device DEVICE --json`` subprocess; returns its table row."""
    tag = config.removesuffix(".json") + ("_" + "_".join(f.lstrip("-") for f in flags) if flags else "")
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "--device", device, "--json", "--model", str(CONFIGS / config),
           "--log-file", str(out / "traces" / f"{tag}.jsonl"), *flags]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        code, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = 124, e.stdout or "", f"timed out after {timeout} s"
    secs = time.perf_counter() - t
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{tag}.stderr").write_text(stderr if isinstance(stderr, str) else stderr.decode())
    try:
        report = json.loads(stdout)
    except (json.JSONDecodeError, TypeError):
        report = None
    row = {"config": config, "flags": " ".join(flags), "exit": code, "seconds": round(secs, 1), "report": report}
    if report is None:
        return {**row, "pair": "-", "verified": "-", "worst": None, "ok": False,
                "error": (stderr if isinstance(stderr, str) else "")[-300:]}
    v, steps = report["verified"], report.get("model_steps", [])
    res = report.get("resolved") or {}
    errs = [x["max_rel_err"] for x in v] + [s["max_rel_err"] for s in steps]
    ok = code == 0 and bool(v) and all(x["passed"] for x in v) and all(s["passed"] for s in steps)
    return {**row, "pair": f"{res.get('prefill', '-')}/{res.get('decode', '-')}",
            "verified": f"{sum(x['passed'] for x in v)}/{len(v)} " + ",".join(x["role"] for x in v),
            "worst": max(errs) if errs else None, "ok": ok,
            "error": None if report["error"] is None else f"[{report['error']['code']}] {report['error']['message'][:200]}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_bundled_configs.json, traces and stderr")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run (FlashInfer JIT may compile)")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke test of this script)")
    ns = p.parse_args()
    out = Path(ns.out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    rows = []
    for config, flags in runs():
        rows.append(run_one(config, flags, out, ns.timeout, ns.device))
        r = rows[-1]
        print(f"done {r['config']} {r['flags']} exit {r['exit']} in {r['seconds']} s", file=sys.stderr, flush=True)
    print(f"{'config':<22} {'flags':<60} {'pair':<26} {'verified (passed/all roles)':<44} {'worst err':>9} {'exit':>4}")
    for r in rows:
        worst = "-" if r["worst"] is None else f"{r['worst']:.2e}"
        print(f"{r['config']:<22} {r['flags'] or '(default)':<60} {r['pair']:<26} {r['verified'][:44]:<44} "
              f"{worst:>9} {r['exit']:>4}" + (f"  {r['error']}" if r["error"] else ""))
    (out / "gpu_bundled_configs.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} runs ok; JSON: {os.path.abspath(out / 'gpu_bundled_configs.json')}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
