"""`attn-setup inspect` on large logs: seconds, MB/s and peak RSS, one fresh process per measurement.

A log grows large when many launches append to one ``--log-file`` (a fixed path reused by a
service that restarts, a CI loop). The log here is built that way from real traces: the CLI run
trace and the golden setup traces of tests/ (ok and refused starts), repeated with a fresh run id,
launch id and timestamps per copy, until the file reaches each size. Each size is then read by
``python -m pipeline.cli inspect LOG --json`` (and the text view) with stdout to /dev/null; peak RSS
is the child's ``ru_maxrss`` (``os.wait4``), so it includes the interpreter and imports; CPU seconds
(user + system) are given next to wall seconds because a shared machine's wall clock is noisy.

    python benchmarks/inspect_large_log.py                   # 64 MB, 256 MB, 1024 MB
    python benchmarks/inspect_large_log.py --sizes-mb 100 --keep /tmp/logs

Targets: peak RSS <= 300 MB and >= 20 MB/s for a 1 GB log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = [ROOT / "tests/data/bad_inputs/traces/cli_run_ok.jsonl", ROOT / "tests/data/golden/ok_tbo.jsonl",
             ROOT / "tests/data/golden/failed_pdmux.jsonl", ROOT / "tests/data/golden/ok_gemma2.jsonl"]


def _template(path: Path) -> tuple[list[bytes], str, str, int]:
    lines = [x for x in path.read_bytes().splitlines() if x.strip()]
    first = json.loads(lines[0])
    return lines, first["run_id"], first.get("launch_id", ""), min(json.loads(x)["ts_ns"] for x in lines)


def build_log(path: Path, size_bytes: int) -> int:
    """Append copies of the templates (fresh ids, later times) until ``path`` holds ``size_bytes``; returns runs."""
    temps = [_template(p) for p in TEMPLATES]
    runs, written, ts = 0, 0, 1_700_000_000_000_000_000
    with open(path, "wb") as fh:
        while written < size_bytes:
            chunk = []
            for lines, run_id, launch, t0 in temps:
                new_id = f"bench-{runs:09d}".encode()
                new_launch = f"{runs:012x}".encode()
                shift = ts - t0
                for ln in lines:
                    ln = ln.replace(b'"run_id":"' + run_id.encode() + b'"', b'"run_id":"' + new_id + b'"')
                    if launch:
                        ln = ln.replace(b'"launch_id":"' + launch.encode() + b'"',
                                        b'"launch_id":"' + new_launch + b'"')
                    i = ln.index(b'"ts_ns":') + 8
                    j = ln.index(b",", i)
                    ln = ln[:i] + str(int(ln[i:j]) + shift).encode() + ln[j:]
                    chunk.append(ln)
                runs += 1
                ts += 10_000_000_000
            data = b"\n".join(chunk) + b"\n"
            fh.write(data)
            written += len(data)
    return runs


def measure(argv: list[str]) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MB, exit code) of one fresh process, stdout to /dev/null."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    with open(os.devnull, "wb") as null:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], stdout=null, stderr=null, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--keep", default=None, help="folder to keep the generated logs in (default: a temp dir)")
    ap.add_argument("--text", action="store_true", help="also measure the text view (slower: rich tables)")
    args = ap.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="inspect-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{'view':6} {'size MB':>8} {'runs':>9} {'wall s':>7} {'MB/s':>6} {'CPU s':>6} {'MB/CPU s':>8} "
          f"{'peak RSS MB':>11} {'exit':>4}")
    for mb in args.sizes_mb:
        log = folder / f"log_{mb}mb.jsonl"
        runs = build_log(log, mb << 20)
        size = log.stat().st_size / (1 << 20)
        views = [("json", ["inspect", str(log), "--json"])] + ([("text", ["inspect", str(log)])] if args.text else [])
        for view, argv in views:
            seconds, cpu, rss, code = measure(argv)
            print(f"{view:6} {size:8.0f} {runs:9d} {seconds:7.1f} {size / seconds:6.1f} {cpu:6.1f} {size / cpu:8.1f} "
                  f"{rss:11.0f} {code:4d}", flush=True)
        if not args.keep:
            log.unlink()
    if not args.keep:
        folder.rmdir()


if __name__ == "__main__":
    main()
