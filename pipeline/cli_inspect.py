"""``attn-setup inspect LOG [LOG …]``: what a start did, read back from its trace.

Per run (``run_id``, rank): a timeline table (state, start, duration, outcome; for an ``attn-setup
run`` trace the runner's states with the setup machine's nested under ``attention``), the decisions, and
for a failed start a short explanation (failed state, cause, the flag to change). Several logs
merge by (run_id, rank, launch); where the ranks of one run_id decided differently is listed. Truncated or
corrupt lines are counted and skipped. Exit codes: 0 every start succeeded · 1 a start failed or
is incomplete · 2 nothing was readable (or a LOG is not a regular file).

Logs are read streaming (:class:`pipeline.trace.TraceReader`): runs are reported one at a time
and let go, so memory stays bounded on huge logs; only ``--perfetto`` keeps every run (the
timeline file holds them all anyway). Every string read from a log is printed as plain text, never
as rich markup.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator, Optional

import msgspec

from pipeline.errors import EXIT_FAILED, EXIT_OK
from pipeline.trace import RankDifferences, Run, Trace, TraceReader, nothing_readable, rank_differences


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="timeline, decisions and failure explanation from trace file(s)")
    p.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines trace(s) written by 'attn-setup run'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--perfetto", metavar="OUT.json", default=None,
                   help="also write a Chrome trace-event JSON timeline (open in ui.perfetto.dev)")
    return p


def run_obj(run: Run) -> dict[str, Any]:
    """The ``--json`` shape of one run."""
    return {"run_id": run.run_id, "rank": run.rank, "launch_id": run.launch_id, "ok": run.ok, "status": run.status,
            "last_state": run.last_state, "states": run.states(), "runner_states": run.runner_states(),
            "decisions": run.decisions(),
            "failure": None if run.failure is None else msgspec.to_builtins(run.failure)}


def _tail_obj(src: Any, differences: list[dict[str, Any]]) -> dict[str, Any]:
    return {"skipped_lines": src.skipped_lines,
            "skipped": [{"path": s.path, "line": s.line, "reason": s.reason} for s in src.skipped],
            "unreadable_files": src.unreadable_files, "rank_differences": differences}


def report_obj(trace: Trace) -> dict[str, Any]:
    """The whole ``--json`` object of a trace read into memory (``cmd`` streams the same shape)."""
    return {"runs": [run_obj(r) for r in trace.runs], **_tail_obj(trace, rank_differences(trace))}


def explain(run: Run) -> list[str]:
    """Lines explaining a failed or incomplete start: where, why, and which flag to change."""
    if run.status == "incomplete":
        return [f"incomplete: no done/failed record; last seen in state {run.last_state!r} "
                "(the process was killed or is still running)"]
    info = run.failure
    if info is None:
        return []
    out = [f"failed in state {info.state!r}: [{info.code}] {info.message}"]  # printed with markup off
    if info.flags:
        out.append("flag to change: " + ", ".join(f"{f.name}={f.value!r}" for f in info.flags))
    if info.allowed:
        out.append("allowed: " + ", ".join(info.allowed))
    if info.remedy:
        out.append("remedy: " + info.remedy)
    return out


def _decision_lines(d: dict[str, Any]) -> list[str]:
    out = []
    if "device" in d:
        dv = d["device"]
        out.append(f"device: {dv['type']}:{dv['index']} {dv['name']} cc={dv['compute_capability']} "
                   f"blas_init={dv['blas_init']}")
    if "resolved" in d:
        r = d["resolved"]
        rules = r["rules"]
        out.append(f"resolved: prefill={r['prefill']} ({rules.get('prefill', '?')}), decode={r['decode']} "
                   f"({rules.get('decode', '?')}), draft override={r['is_draft_override']}")
        for half, rej in r["rejected"].items():
            out += [f"  rejected for {half}: {x['backend']}: {'; '.join(x['reasons'])}" for x in rej]
    for name, s in d.get("settings", {}).items():
        out.append(f"setting: {name}={s['value']} (from {s['source']})")
    if "plan" in d:
        p = d["plan"]
        out.append(f"plan: mode={p['mode']} hybrid={p['hybrid']} instances="
                   + ", ".join(f"{i['role']}:{i['backend']}@{i['workspace']}" for i in p["instances"]))
    out += [f"skipped ({s['state']}): {s['what']}: {s['reason']}" for s in d.get("skips", [])]
    return out


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=120)


def render_run(c: Any, run: Run) -> None:
    """One run's status line, timeline table, decisions and explanation (plain text: no markup)."""
    from rich.table import Table
    from rich.text import Text

    colour = {"ok": "green", "failed": "red"}.get(run.status, "yellow")
    head = Text("run ", style="bold") + Text(f"{run.run_id} rank {run.rank}", style="bold")
    if run.launch_id:
        head += Text(f" launch {run.launch_id}")
    c.print(head + Text(": ") + Text(run.status, style=colour))
    t = Table(title_justify="left")
    for col in ("state", "start (ms)", "duration (ms)", "outcome"):
        t.add_column(col)
    outer, inner = run.runner_states(), run.states()
    t0 = min([s["start_ns"] for s in outer + inner] or [0])

    def row(s: dict[str, Any], indent: str = "") -> None:
        t.add_row(Text(indent + s["state"]), f"{(s['start_ns'] - t0) / 1e6:.2f}", f"{s['duration_ms']:.2f}",
                  Text(s["outcome"]))

    for s in outer or inner:  # a runner's table nests the setup machine under its attention step
        row(s)
        if outer and s["state"] == "attention":
            for i in inner:
                row(i, "  ")
    c.print(t)
    for line in _decision_lines(run.decisions()) + explain(run):
        c.print("  " + line, markup=False)


def render_tail(c: Any, src: Any, differences: list[dict[str, Any]]) -> None:
    """Rank differences and the skipped-lines summary."""
    for d in differences:
        vals = ", ".join(f"rank {k}: {v!r}" for k, v in d["values"].items())
        c.print(f"ranks differ in run {d['run_id']}: {d['key']}: {vals}", markup=False)
    if src.skipped_lines or src.unreadable_files:
        c.print(f"skipped {src.skipped_lines} unreadable line(s)"
                + "".join(f"; {s.path}:{s.line} {s.reason}" for s in src.skipped[:5])
                + "".join(f"; {p}: unreadable file" for p in src.unreadable_files), markup=False)


def render(trace: Trace) -> None:
    """Every run of a trace read into memory, then the tail (``cmd`` streams the same output)."""
    c = _console()
    for run in trace.runs:
        render_run(c, run)
    render_tail(c, trace, rank_differences(trace))


def _first_then_rest(runs: Iterator[Run]) -> Optional[Iterator[Run]]:
    """None when ``runs`` is empty, else an iterator over all of them (the first one peeked)."""
    first = next(runs, None)
    if first is None:
        return None

    def chain() -> Iterator[Run]:
        yield first
        yield from runs

    return chain()


def cmd(ns: argparse.Namespace) -> int:
    reader = TraceReader(ns.logs)
    runs = _first_then_rest(reader.runs())
    if runs is None:
        raise nothing_readable(reader)
    if ns.perfetto:
        from pipeline.perfetto import write_chrome_trace

        kept = list(runs)  # the timeline holds every run anyway
        runs = iter(kept)
        try:
            n = write_chrome_trace(Trace(runs=kept), ns.perfetto)
        except OSError as e:
            from pipeline.errors import UsageError

            raise UsageError(f"cannot write {ns.perfetto!r}: {e.strerror or e}", code="usage",
                             flags=[("--perfetto", ns.perfetto)], remedy="pick a writable file path") from None
        if not ns.json:
            print(f"perfetto: wrote {n} trace events to {ns.perfetto}", file=sys.stderr)
    diffs, ok = RankDifferences(), True
    if ns.json:
        out = sys.stdout
        out.write('{"runs":[')
        for i, run in enumerate(runs):
            diffs.add(run)
            ok &= run.ok
            out.write(("," if i else "") + msgspec.json.encode(run_obj(run)).decode())
        tail = msgspec.json.encode(_tail_obj(reader, diffs.finish())).decode()
        out.write("]," + tail[1:] + "\n")
        out.flush()
    else:
        c = _console()
        for run in runs:
            diffs.add(run)
            ok &= run.ok
            render_run(c, run)
        render_tail(c, reader, diffs.finish())
    return EXIT_OK if ok else EXIT_FAILED
