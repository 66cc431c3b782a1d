"""Accepted means runs: every combination the capability records accept, built and verified against float64.

Enumerates backend × layer kind (full, window, softcap, sinks, chunked, MLA) × KV dtype × page size {1, 16, 64} ×
mode {normal, TBO, hybrid, PD-mux} × {eager, graph} from the records, asks the resolver which are accepted on
``--profile``, and builds and verifies exactly those (``benchmarks/matrix_cells.py`` says how). Prints a table
(combination → accepted → max_rel_err / tol → result) and a summary line (accepted, passed, failed — must be 0 —,
refused by error code), writes JSON to ``--out``. Exit 0 when no accepted cell failed, 1 otherwise.

``--device cpu`` with a GPU profile decides on that profile and runs on CPU tensors (a
:class:`~pipeline.platforms.fake.FakePlatform`; our Triton kernels under ``TRITON_INTERPRET=1`` with the GPU's
bf16 rounding, :func:`matrix_cells.interpreter_rounding`), its SM count set to :data:`matrix_cells.INTERPRET_SMS`:
that only sets the Triton decode split cap, and the verification requests (≤ 26 tokens) use one split each, so
132 SMs would only add empty programs, which the interpreter runs one by one. Graph cells then cannot run (no
CUDA device): they are listed as ``needs_cuda``.

On the H200 (repo root; FlashInfer compiles each kernel variant on first use, ~2 min each)::

    python benchmarks/accepted_matrix.py --profile h200 --list-variants   # the FlashInfer variants needed (JSON lines)
    python benchmarks/accepted_matrix.py --profile h200 --warmup 16       # compile them, 16 processes
    python benchmarks/accepted_matrix.py --profile h200 --out matrix.json # every accepted cell, eager and graph
    python benchmarks/accepted_matrix.py --profile h200 --shard 0/2 --out m0.json   # or in two calls ...
    python benchmarks/accepted_matrix.py --merge m0.json m1.json                    # ... joined into one table

On CPU: ``--profile cpu`` (torch_native), ``--profile h200 --device cpu --backends triton,torch_native`` (the
Triton interpreter); ``--subset covering`` runs a pairwise covering subset; ``--dry-run`` only decides.
``tests/test_matrix.py`` runs the CPU side in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix_cells import (  # noqa: E402
    PROFILES, Cell, Row, cells, cost, covering, evaluate, grouped_table, interpreter_rounding, profile_facts, run_cell,
    summary, table,
)
from matrix_cells import DECODE_STEPS  # noqa: E402


def shard_of(rows: Sequence[Row], n: int) -> list[list[Row]]:
    """``rows`` split into ``n`` shards of about equal :func:`cost` (dearest first onto the lightest shard)."""
    shards: list[list[Row]] = [[] for _ in range(max(n, 1))]
    load = [0.0] * len(shards)
    for r in sorted(rows, key=lambda r: -cost(r.cell)):
        i = load.index(min(load))
        shards[i].append(r)
        load[i] += cost(r.cell)
    return shards


def select(rows: Sequence[Row], picked: Sequence[Row], mine: Sequence[Row], graphs_run: bool) -> list[Row]:
    """``rows`` with every accepted row this call will not run marked: ``needs_cuda`` (a graph cell without a CUDA
    device), ``not_in_subset`` (outside the covering subset) or ``other_shard``; the rest stay ``accepted``."""
    picked_ids, mine_ids = {id(r) for r in picked}, {id(r) for r in mine}
    out = []
    for r in rows:
        if r.accepted and not graphs_run and r.cell.graph == "graph":
            r = Row(r.cell, True, "needs_cuda", "graph capture needs a CUDA device: runs in the GPU script")
        elif r.accepted and id(r) not in picked_ids:
            r = Row(r.cell, True, "not_in_subset")
        elif r.accepted and id(r) not in mine_ids:
            r = Row(r.cell, True, "other_shard")
        out.append(r)
    return out


def run_rows(rows: Sequence[Row], *, device: str, platform: Any, decode_steps: int = DECODE_STEPS,
             progress: bool = False) -> list[Row]:
    """Run every row still ``accepted`` (:func:`run_cell`); the others are kept as they are."""
    out = []
    todo = sum(r.status == "accepted" for r in rows)
    for r in rows:
        if r.status == "accepted":
            r = run_cell(r.cell, device=device, platform=platform, decode_steps=decode_steps)
            if progress:
                err = "-" if r.max_rel_err is None else f"{r.max_rel_err:.2e}"
                print(f"[{sum(x.status in ('passed', 'failed') for x in out) + 1}/{todo}] {r.status:7} {err:>9} "
                      f"{r.seconds:6.2f}s {r.cell.label} {r.reason}", file=sys.stderr, flush=True)
        out.append(r)
    return out


def variants(rows: Sequence[Row], facts: Any) -> list[Any]:
    """FlashInfer JIT variants the accepted rows need (:func:`pipeline.cli.warmup.variants_for_request`)."""
    from pipeline.cli.warmup import variants_for_request
    from pipeline.core.contracts import ResolvedAttentionBackendStr

    out: list[Any] = []
    for r in rows:
        if r.accepted:
            pair = ResolvedAttentionBackendStr(prefill=r.cell.prefill, decode=r.cell.decode)
            out += variants_for_request(r.cell.request(facts.device_str), facts, pair)
    return list(dict.fromkeys(out))


def summary_line(s: dict[str, Any]) -> str:
    """``accepted A, passed P, failed F`` and the cells not run (why) and refused (by code)."""
    unrun = ", ".join(f"{k} {s[k]}" for k in ("needs_cuda", "not_in_subset", "other_shard") if s[k])
    return (f"accepted {s['accepted']}, passed {s['passed']}, failed {s['failed']}" + (f", not run: {unrun}" if unrun
            else "") + f"; refused {s['refused']} {s['refused_by_code']}")


def merge(paths: Sequence[str], *, show_refused: bool = False) -> int:
    """Print one table and summary from several ``--out`` files of the same matrix (e.g. its shards): each cell
    takes the row of the file that ran it. Exit 1 when a cell failed or no file ran an accepted cell."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    by_label: dict[str, dict[str, Any]] = {}
    for run in runs:
        for r in run["rows"]:
            old = by_label.get(r["cell"]["label"])
            if old is None or old["status"] in ("other_shard", "not_in_subset", "accepted"):
                by_label[r["cell"]["label"]] = r
    rows = []
    for r in by_label.values():
        c = {f: r["cell"][f] for f in Cell.__dataclass_fields__}
        cell = Cell(**{**c, "dims": tuple(c["dims"]), "heads": tuple(c["heads"])})
        rows.append(Row(**{**r, "cell": cell}))
    s = summary(rows)
    print(table(rows, accepted_only=not show_refused) + "\n\n" + grouped_table(rows))
    print(f"\n{summary_line(s)} (merged from {len(paths)} files)")
    return 1 if s["failed"] or not s["passed"] else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", default="h200", choices=sorted(PROFILES), help="device profile decided on")
    p.add_argument("--device", default=None, help="where to run: cuda (default for a GPU profile) or cpu")
    p.add_argument("--backends", default=None, help="comma-separated subset of the registered backends")
    p.add_argument("--subset", choices=("all", "covering"), default="all", help="every accepted cell, or a "
                   "pairwise covering subset of them")
    p.add_argument("--list-variants", action="store_true", help="print the FlashInfer variants the accepted cells "
                   "need (one JSON object per line, pipeline.backends.flashinfer.jit.Variant fields) and exit")
    p.add_argument("--installed", default=None, help="comma-separated distributions to decide with (default: what "
                   "imports here), e.g. torch,triton,flashinfer-python to list a GPU machine's variants from a CPU one")
    p.add_argument("--dry-run", action="store_true", help="decide only: print the accepted cells and the counts")
    p.add_argument("--warmup", type=int, default=0, metavar="JOBS", help="compile the FlashInfer variants the "
                   "accepted cells need in JOBS parallel processes (pipeline.backends.flashinfer.jit.warmup_variants), print each, exit")
    p.add_argument("--shard", default="0/1", metavar="K/N", help="run only the K-th (from 0) of N shards of about "
                   "equal estimated cost (one matrix over several calls; --merge joins their --out files)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="print the table and summary of several "
                   "--out files (shards) as one, and exit")
    p.add_argument("--out", default=None, help="write the rows and the summary as JSON here")
    p.add_argument("--show-refused", action="store_true", help="also list refused cells in the table")
    ns = p.parse_args(argv)
    if ns.merge:
        return merge(ns.merge, show_refused=ns.show_refused)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    facts = PROFILES[ns.profile]
    device = ns.device or ("cpu" if facts.type == "cpu" else "cuda")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from pipeline.backends.packages import installed_by_import

    installed = installed_by_import()
    if ns.installed is not None:
        named = {x.strip() for x in ns.installed.split(",") if x.strip()}
        installed = {k: k in named for k in installed}
    rows = evaluate(cells(ns.backends.split(",") if ns.backends else None), facts, installed)
    if ns.list_variants or ns.warmup:
        found = variants(rows, facts)
        if ns.warmup:
            from pipeline.backends.flashinfer.jit import warmup_variants

            results = warmup_variants(found, jobs=ns.warmup) if found else []
            for r in results:
                print(f"{r['status']:9} {r['seconds']:7.1f} s  {r['variant']}  {r.get('error') or ''}")
            return 1 if any(r["status"] == "failed" for r in results) else 0
        for v in found:
            print(json.dumps(v.fields()))
        return 0
    if ns.dry_run:
        print(table(rows, accepted_only=not ns.show_refused))
        print(json.dumps(summary(rows)))
        return 0
    facts, platform, torch_device = profile_facts(ns.profile, device)
    if torch_device == "cpu":
        import torch

        torch.set_num_threads(1)  # tiny tensors: a second intra-op thread only waits on a shared machine
    k, n = (int(x) for x in ns.shard.split("/"))
    graphs_run = torch_device.startswith("cuda")
    runnable = [r for r in rows if r.accepted and (graphs_run or r.cell.graph == "eager")]
    picked = runnable if ns.subset == "all" else covering(runnable)
    rows = select(rows, picked, shard_of(picked, n)[k], graphs_run)
    t0 = time.perf_counter()
    with interpreter_rounding() if torch_device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" \
            else contextlib.nullcontext():
        rows = run_rows(rows, device=torch_device, platform=platform, progress=True)
    s = {**summary(rows), "profile": ns.profile, "device": torch_device, "subset": ns.subset, "shard": ns.shard,
         "seconds": round(time.perf_counter() - t0, 1), "installed": installed}
    print(table(rows, accepted_only=not ns.show_refused) + "\n\n" + grouped_table(rows))
    print(f"\n{summary_line(s)} ({s['seconds']} s, profile {ns.profile} on {torch_device})")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"summary": s, "rows": [r.to_json() for r in rows]}, indent=1))
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
