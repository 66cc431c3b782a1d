"""``attn-setup inspect LOG [LOG …]``: what a start did, read back from its trace.

Per run (``run_id``, rank): a timeline table (state, start, duration, outcome; for an ``attn-setup
run`` trace the runner's states with the setup machine's nested under ``attention``), the decisions, and
for a failed start a short explanation (failed state, cause, the flag to change). Several logs
merge by (run_id, rank); where the ranks of one run_id decided differently is listed. Truncated or
corrupt lines are counted and skipped. Exit codes: 0 every start succeeded · 1 a start failed or
is incomplete · 2 nothing was readable.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from pipeline.errors import EXIT_FAILED, EXIT_OK
from pipeline.model_spec import format_layer_ids
from pipeline.trace import Run, Trace, rank_differences, read_trace


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="timeline, decisions and failure explanation from trace file(s)")
    p.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines trace(s) written by 'attn-setup run'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--perfetto", metavar="OUT.json", default=None,
                   help="also write a Chrome trace-event JSON timeline (open in ui.perfetto.dev; default: none)")
    return p


def run_obj(run: Run) -> dict[str, Any]:
    """The ``--json`` shape of one run."""
    return {"run_id": run.run_id, "rank": run.rank, "ok": run.ok, "status": run.status,
            "last_state": run.last_state, "states": run.states(), "runner_states": run.runner_states(),
            "decisions": run.decisions(),
            "failure": None if run.failure is None else msgspec.to_builtins(run.failure)}


def report_obj(trace: Trace) -> dict[str, Any]:
    return {"runs": [run_obj(r) for r in trace.runs], "skipped_lines": trace.skipped_lines,
            "skipped": [{"path": s.path, "line": s.line, "reason": s.reason} for s in trace.skipped],
            "unreadable_files": trace.unreadable_files, "rank_differences": rank_differences(trace)}


def explain(run: Run) -> list[str]:
    """Lines explaining a failed or incomplete start: where, why, and which flag to change."""
    if run.status == "incomplete":
        return [f"incomplete: no done/failed record; last seen in state {run.last_state!r} "
                "(the process was killed or is still running)"]
    info = run.failure
    if info is None:
        return []
    out = [f"failed in state {info.state!r}: [{info.code}] {info.message}"]
    if info.flags:
        out.append("flag to change: " + ", ".join(f"{f.name}={f.value!r}" for f in info.flags))
    if info.allowed:
        out.append("allowed: " + ", ".join(info.allowed))
    if info.remedy:
        from pipeline.wording import to_cli

        out.append("remedy: " + to_cli(info.remedy))  # the trace has the library's field names
    return out


def _decision_lines(d: dict[str, Any]) -> list[str]:
    out = []
    if "device" in d:
        dv = d["device"]
        out.append(f"device: {dv['type']}:{dv['index']} {dv['name']} cc={dv['compute_capability']} "
                   f"blas_init={dv['blas_init']}")
    if "resolved" in d:
        r = d["resolved"]
        out.append(f"resolved: prefill={r['prefill']} ({r['rules']['prefill']}), decode={r['decode']} "
                   f"({r['rules']['decode']}), draft override={r['is_draft_override']}")
        for half, rej in r["rejected"].items():
            out += [f"  rejected for {half}: {x['backend']}: {'; '.join(x['reasons'])}" for x in rej]
        out += [f"  not attention (no KV cache): {g['kind']} layers {format_layer_ids(g['layer_ids'])}"
                for g in r.get("not_attention", [])]
    for name, s in d.get("settings", {}).items():
        out.append(f"setting: {name}={s['value']} (from {s['source']})")
    if "plan" in d:
        p = d["plan"]
        out.append(f"plan: mode={p['mode']} hybrid={p['hybrid']} instances="
                   + ", ".join(f"{i['role']}:{i['backend']}@{i['workspace']}" for i in p["instances"]))
    out += [f"skipped ({s['state']}): {s['what']}: {s['reason']}" for s in d.get("skips", [])]
    return out


def render(trace: Trace) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(highlight=False, soft_wrap=False, width=120)
    for run in trace.runs:
        colour = {"ok": "green", "failed": "red"}.get(run.status, "yellow")
        c.print(f"[bold]run {run.run_id} rank {run.rank}[/]: [{colour}]{run.status}[/]")
        t = Table(title_justify="left")
        for col in ("state", "start (ms)", "duration (ms)", "outcome"):
            t.add_column(col)
        outer, inner = run.runner_states(), run.states()
        t0 = min([s["start_ns"] for s in outer + inner] or [0])

        def row(s: dict[str, Any], indent: str = "") -> None:
            t.add_row(indent + s["state"], f"{(s['start_ns'] - t0) / 1e6:.2f}", f"{s['duration_ms']:.2f}", s["outcome"])

        for s in outer or inner:  # a runner's table nests the setup machine under its attention step
            row(s)
            if outer and s["state"] == "attention":
                for i in inner:
                    row(i, "  ")
        c.print(t)
        for line in _decision_lines(run.decisions()) + explain(run):
            c.print("  " + line, markup=False)
    for d in rank_differences(trace):
        vals = ", ".join(f"rank {k}: {v!r}" for k, v in d["values"].items())
        c.print(f"ranks differ in run {d['run_id']}: {d['key']}: {vals}", markup=False)
    if trace.skipped_lines or trace.unreadable_files:
        c.print(f"skipped {trace.skipped_lines} unreadable line(s)"
                + "".join(f"; {s.path}:{s.line} {s.reason}" for s in trace.skipped[:5])
                + "".join(f"; {p}: unreadable file" for p in trace.unreadable_files), markup=False)


def cmd(ns: argparse.Namespace) -> int:
    trace = read_trace(ns.logs).require_records()
    if ns.perfetto:
        from pipeline.perfetto import write_chrome_trace

        try:
            n = write_chrome_trace(trace, ns.perfetto)
        except OSError as e:
            from pipeline.errors import UsageError

            raise UsageError(f"cannot write {ns.perfetto!r}: {e.strerror or e}", code="usage",
                             flags=[("--perfetto", ns.perfetto)], remedy="pick a writable file path") from None
        if not ns.json:
            print(f"perfetto: wrote {n} trace events to {ns.perfetto}", file=sys.stderr)
    if ns.json:
        from pipeline.report import emit_json

        emit_json(report_obj(trace))
    else:
        render(trace)
    return EXIT_OK if all(r.ok for r in trace.runs) else EXIT_FAILED
