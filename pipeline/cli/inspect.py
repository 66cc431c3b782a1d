"""``attn-setup inspect LOG [LOG …]``: what a start did, read back from its trace.

Per run (``run_id``, rank): a timeline table (state, start, duration, outcome; for an ``attn-setup
run`` trace the runner's states with the setup machine's nested under ``attention``), the decisions, and
for a failed start a short explanation (failed state, cause, the flag to change). Several logs
merge by (run_id, rank, launch); where the ranks of one run_id decided differently is listed. Truncated or
corrupt lines are counted and skipped. Exit codes: 0 every start succeeded · 1 a start failed or
is incomplete · 2 nothing was readable (or a LOG is not a regular file); ``--diff`` the same over each rank's
last start in either log.

Logs are read streaming (:class:`pipeline.observe.trace.TraceReader`): runs are reported one at a time
and let go, so memory stays bounded on huge logs; only ``--perfetto`` keeps every run (the
timeline file holds them all anyway). Every string read from a log is printed as plain text (never
rich markup), control characters escaped.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator, Optional

import msgspec

from pipeline.cli.inspect_text import (  # noqa: F401 (the text view's names, importable from here as before)
    _COLOUR, _decision_lines, _fit, _is_tty, _safe, explain, failure_of, render_run, render_tail, run_lines,
    terminal_cols,
)
from pipeline.cli.startup import slow_phases, summary_of, summary_rows  # noqa: F401
from pipeline.core.errors import EXIT_FAILED, EXIT_OK
from pipeline.core.events import SlowPhase, StartupSummary
from pipeline.core.model_spec import format_layer_ids  # noqa: F401 (importable from here before the split)
from pipeline.observe.ranks import RankSummary, summary_lines  # noqa: F401
from pipeline.observe.ranks import RankDifferences, rank_differences
from pipeline.observe.trace import TraceReader
from pipeline.observe.runs import Run, Trace, nothing_readable


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="timeline, decisions and failure explanation from trace file(s)")
    p.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines trace(s) written by 'attn-setup run'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--perfetto", metavar="OUT.json", default=None,
                   help="also write a Chrome trace-event JSON timeline (open in ui.perfetto.dev; default: none)")
    p.add_argument("--diff", action="store_true",
                   help="compare two starts: inspect --diff A.jsonl B.jsonl prints, per rank, each state's and "
                        "phase's time delta (B - A) and every decision that changed; exit 0 when every start "
                        "in both started, 1 when one failed or is incomplete, 2 when a log is unreadable")
    return p


def run_obj(run: Run) -> dict[str, Any]:
    """The ``--json`` shape of one run (``failure`` worded as :func:`failure_of` says)."""
    failure = failure_of(run)
    return {"run_id": run.run_id, "rank": run.rank, "launch_id": run.launch_id, "ok": run.ok, "status": run.status,
            "last_state": run.last_state, "states": run.states(), "runner_states": run.runner_states(),
            "decisions": run.decisions(),
            "failure": None if failure is None else msgspec.to_builtins(failure),
            "summary": summary_of(run.all(StartupSummary)), "slow_phases": slow_phases(run.all(SlowPhase))}


def _tail_obj(src: Any, differences: list[dict[str, Any]], ranks: Optional[RankSummary] = None) -> dict[str, Any]:
    ranks = ranks or RankSummary()
    return {"skipped_lines": src.skipped_lines,
            "skipped": [{"path": s.path, "line": s.line, "reason": s.reason} for s in src.skipped],
            "unreadable_files": src.unreadable_files, "rank_differences": differences,
            "ranks": ranks.ranks, "critical_path": ranks.paths}


def _summary(runs: list[Run]) -> RankSummary:
    s = RankSummary()
    for r in runs:
        s.add(r)
    return s.finish()


def report_obj(trace: Trace) -> dict[str, Any]:
    """The whole ``--json`` object of a trace read into memory (``cmd`` streams the same shape)."""
    return {"runs": [run_obj(r) for r in trace.runs],
            **_tail_obj(trace, rank_differences(trace), _summary(trace.runs))}


def render(trace: Trace) -> None:
    """Every run of a trace read into memory, then the tail (``cmd`` streams the same output)."""
    cols = terminal_cols()
    for run in trace.runs:
        render_run(sys.stdout, run, _is_tty(sys.stdout), cols)
    render_tail(sys.stdout, trace, rank_differences(trace), _summary(trace.runs), cols)


def _first_then_rest(runs: Iterator[Run]) -> Optional[Iterator[Run]]:
    """None when ``runs`` is empty, else an iterator over all of them (the first one peeked)."""
    first = next(runs, None)
    if first is None:
        return None

    def chain() -> Iterator[Run]:
        yield first
        yield from runs

    return chain()


def _diff(ns: argparse.Namespace) -> int:
    """``--diff A B``: :mod:`pipeline.observe.trace_diff`; UsageError (exit 2) unless exactly two readable logs."""
    from pipeline.core.errors import UsageError
    from pipeline.observe.trace_diff import diff_lines, diff_logs

    if len(ns.logs) != 2:
        raise UsageError(f"--diff compares two logs, got {len(ns.logs)}", code="usage",
                         flags=[("--diff", " ".join(ns.logs))], allowed=["exactly 2 LOG paths"],
                         remedy="run: attn-setup inspect --diff A.jsonl B.jsonl")
    for path in ns.logs:
        reader = TraceReader([path])
        if _first_then_rest(reader.runs()) is None:
            raise nothing_readable(reader)
    d = diff_logs(*ns.logs)
    if ns.json:
        sys.stdout.write(msgspec.json.encode({"diff": d}).decode() + "\n")
    else:
        sys.stdout.write("\n".join(_fit(diff_lines(d, _safe), terminal_cols())) + "\n")
    return EXIT_OK if d["ok"] else EXIT_FAILED  # as inspect's: 1 when a start read failed or is incomplete


def cmd(ns: argparse.Namespace) -> int:
    if getattr(ns, "diff", False):
        return _diff(ns)
    from pipeline.cli.log_paths import check_log_paths

    check_log_paths(ns.logs)
    reader = TraceReader(ns.logs)
    runs = _first_then_rest(reader.runs())
    if runs is None:
        raise nothing_readable(reader)
    if ns.perfetto:
        from pipeline.observe.perfetto import write_chrome_trace

        kept = list(runs)  # the timeline holds every run anyway
        runs = iter(kept)
        try:
            n = write_chrome_trace(Trace(runs=kept), ns.perfetto, flag="--perfetto")
        except OSError as e:
            from pipeline.core.errors import UsageError

            raise UsageError(f"cannot write {ns.perfetto!r}: {e.strerror or e}; nothing was written (a file already "
                             "there is unchanged)", code="usage",
                             flags=[("--perfetto", ns.perfetto)], remedy="pick a writable file path") from None
        if not ns.json:
            print(f"perfetto: wrote {n} trace events to {ns.perfetto}", file=sys.stderr)
    diffs, ok, ranks = RankDifferences(), True, RankSummary()
    if ns.json:
        out = sys.stdout
        out.write('{"runs":[')
        for i, run in enumerate(runs):
            diffs.add(run)
            ranks.add(run)
            ok &= run.ok
            out.write(("," if i else "") + msgspec.json.encode(run_obj(run)).decode())
        tail = msgspec.json.encode(_tail_obj(reader, diffs.finish(), ranks.finish())).decode()
        out.write("]," + tail[1:] + "\n")
        out.flush()
    else:
        out = sys.stdout
        colour, cols = _is_tty(out), terminal_cols()
        for run in runs:
            diffs.add(run)
            ranks.add(run)
            ok &= run.ok
            render_run(out, run, colour, cols)
        render_tail(out, reader, diffs.finish(), ranks.finish(), cols)
        out.flush()
    return EXIT_OK if ok else EXIT_FAILED
