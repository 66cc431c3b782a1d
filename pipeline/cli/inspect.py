"""``attn-setup inspect LOG [LOG …]``: what a start did, read back from its trace.

Details: docs/internals.md, ``pipeline.cli.inspect``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator, Optional

import msgspec

from pipeline.cli.startup import slow_line, slow_phases, summary_of, summary_rows
from pipeline.core.errors import EXIT_FAILED, EXIT_OK
from pipeline.core.events import SlowPhase, StartupSummary
from pipeline.core.model_spec import format_layer_ids
from pipeline.core.value_text import value_text
from pipeline.observe.ranks import rank_differences, RankDifferences, RankSummary, summary_lines
from pipeline.observe.runs import device_text, nothing_readable, Run, Trace
from pipeline.observe.trace import TraceReader


def failure_of(run: Run) -> Any:
    """The run's failure ErrorInfo in the command line's words, as ``run --json`` prints it
    (:func:`pipeline.cli.output.cli_error`): the flags of the command that wrote the trace (its
    ``command_started``; ``run``'s for a trace written by the library) wherever a flag sets the field."""
    info = run.failure
    if info is None:
        return None
    from pipeline.cli.output import cli_error, command_dests
    from pipeline.core.events import CommandStarted

    started = run.first(CommandStarted)
    return cli_error(info, command_dests(started.command if started is not None else "run"))


def explain(run: Run) -> list[str]:
    """Lines explaining a failed or incomplete start: where, why, which flag to change (command-line flags only),
    the other facts of the error (an ``env`` variable, a ``field`` such as ``limit_bytes``, an ``arg``) one a line."""
    if run.status == "incomplete":
        return [f"incomplete: no done/failed record; last seen in state {run.last_state!r} "
                "(the process was killed or is still running)"]
    info = failure_of(run)
    if info is None:
        return []
    from pipeline.cli.output import change_lines, entry_rows

    out = [f"failed in state {info.state!r}: [{info.code}] {info.message}"]  # printed with markup off
    rows = entry_rows(info)
    flags = [text for label, text in rows if label == "flag"]  # only flags are flags to change
    change = _named_by(flags, info.remedy or "") or flags
    out += change_lines(change)
    out += [f"flag {text}" for text in flags if text not in change]   # context, as run's error block labels it
    out += [f"{label} {text}" for label, text in rows if label != "flag"]
    if info.allowed:
        out.append("allowed: " + ", ".join(info.allowed))
    if info.remedy:
        out.append("remedy: " + info.remedy)
    return out


def _named_by(flags: list[str], remedy: str) -> list[str]:
    """The entries (``"--flag = value"``) whose flag the remedy names, as a whole word: the flags to change when the
    error carries context flags too (a capability refusal names ``--device`` and ``--model`` beside the
    ``--attention-backend`` its remedy changes). Empty when the remedy names none of them (then all are listed)."""
    import re

    return [t for t in flags if re.search(rf"(?<![\w-]){re.escape(t.split(' = ', 1)[0])}(?![\w-])", remedy)]


def _decision_lines(d: dict[str, Any]) -> list[str]:
    out = []
    if "device" in d:
        out.append(f"device: {device_text(d['device'])}")  # as run's report prints it
    if "resolved" in d:
        r = d["resolved"]
        rules = r["rules"]
        out.append(f"resolved: prefill={r['prefill']} ({rules.get('prefill', '?')}), decode={r['decode']} "
                   f"({rules.get('decode', '?')}), draft override={r['is_draft_override']}")
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


def _safe(text: Any, newlines: bool = False) -> str:
    """A string from a log, safe to print: control characters (terminal escapes) shown escaped, each on its own —
    the rest of the text as written (an em dash stays a dash). ``newlines``: line ends kept (a message that holds a
    table), for the caller to split."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or (newlines and ch == "\n") else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def _text_lines(line: str, indent: str = "  ", more: str = "    ") -> list[str]:
    """One line that may hold line ends (:func:`_safe` with ``newlines``) as lines: the first at ``indent``, the
    ones after it at ``more`` (a table in an error message stays aligned under its sentence)."""
    first, *rest = _safe(line, newlines=True).split("\n")
    return [indent + first] + [more + r for r in rest]


_COLOUR = {"ok": "\x1b[32m", "failed": "\x1b[31m"}


def run_lines(run: Run, colour: bool = False) -> list[str]:
    """One run as plain text lines: status, the timeline table, decisions, explanation.

    Fixed-width text rather than rich tables: a log of 100,000 launches must print in seconds,
    and every string read from a log goes out as text (never markup), control characters escaped.
    """
    status = run.status
    if colour:
        status = f"{_COLOUR.get(status, chr(27) + '[33m')}{status}\x1b[0m"
    head = f"run {_safe(run.run_id)} rank {run.rank}" + (f" launch {_safe(run.launch_id)}" if run.launch_id else "")
    outer, inner = run.runner_states(), run.states()
    t0 = min([s["start_ns"] for s in outer + inner] or [0])
    rows = []
    for s in outer or inner:  # a runner's table nests the setup machine under its attention step
        rows.append(("", s))
        if outer and s["state"] == "attention":
            rows += [("  ", i) for i in inner]
    cells = [(ind + _safe(s["state"]), f"{(s['start_ns'] - t0) / 1e6:.2f}", f"{s['duration_ms']:.2f}",
              _safe(s["outcome"])) for ind, s in rows]
    w = max([len("state")] + [len(c[0]) for c in cells])
    sw = max([len("start (ms)")] + [len(c[1]) for c in cells])
    dw = max([len("duration (ms)")] + [len(c[2]) for c in cells])
    lines = [f"{head}: {status}", f"  {'state':<{w}}  {'start (ms)':>{sw}}  {'duration (ms)':>{dw}}  outcome"]
    lines += [f"  {a:<{w}}  {b:>{sw}}  {c:>{dw}}  {d}" for a, b, c, d in cells]
    lines += ["  " + _safe(line) for line in _decision_lines(run.decisions())]
    lines += verification_lines(*verification_obj(run))
    lines += [x for line in explain(run) for x in _text_lines(line)]
    summary = summary_of(run.all(StartupSummary))
    if summary is not None:
        rows = summary_rows(summary)
        pw = max(len(r[0]) for r in rows)
        lines.append("  startup summary (seconds):")
        lines += [_safe(f"    {a:<{pw}}  {b:>9}  {c}").rstrip() for a, b, c in rows]
    slow = slow_line(run.all(SlowPhase))
    if slow:
        lines.append("  " + _safe(slow))
    return lines


def verification_obj(run: Run) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(verified, model_steps)`` as ``run --json`` reports them, read from the run's ``instance_verified`` and
    ``model_step_verified`` records (empty lists for a run that stopped before its checks)."""
    from pipeline.core import events as ev

    verified = [{"role": r.role, "backend": r.backend, "max_rel_err": r.max_rel_err, "tol": r.tol,
                 "passed": r.passed} for r in run.all(ev.InstanceVerified)]
    steps = [{"step": c.step, "mode": c.mode, "batch_size": c.batch_size, "graph": c.graph,
              "max_rel_err": c.max_rel_err, "tol": c.tol, "passed": c.passed, "reference": c.reference}
             for c in run.all(ev.ModelStepVerified)]
    return verified, steps


def _table(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    return [f"  {title}:"] + ["    " + "  ".join(f"{c:<{w}}" for c, w in zip(r, widths)).rstrip()
                              for r in [head] + rows]


def verification_lines(verified: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[str]:
    """``run``'s two verification tables as text: each built instance and each model step against the float64
    reference, with max rel err, tolerance and verdict."""
    from pipeline.runtime.runner import tol_text

    out: list[str] = []
    if verified:
        out += _table("verification vs float64 reference (max|out-ref|/max|ref|)",
                      ["role", "backend", "max rel err", "tol", "passed"],
                      [[_safe(v["role"]), _safe(v["backend"]), f"{v['max_rel_err']:.2e}", tol_text(v["tol"]),
                        "yes" if v["passed"] else "NO"] for v in verified])
    if steps:
        refs = any(s["reference"].startswith("mla-") for s in steps)
        out += _table("attention stack steps vs float64 dense reference (max|dout-dref|/max|dref|)",
                      ["step", "bs", "graph"] + (["reference"] if refs else []) + ["max rel err", "tol", "passed"],
                      [[_safe(s["step"]), str(s["batch_size"]), "yes" if s["graph"] else "no"]
                       + ([_safe(s["reference"])] if refs else [])
                       + [f"{s['max_rel_err']:.2e}", tol_text(s["tol"]), "yes" if s["passed"] else "NO"]
                       for s in steps])
    return out


def _fit(lines: list[str], cols: Optional[int]) -> list[str]:
    """Lines broken at spaces to ``cols`` columns (:func:`pipeline.cli.output.wrap`), unchanged when None."""
    if not cols:
        return lines
    from pipeline.cli.output import wrap_lines

    return wrap_lines(lines, cols, "  ")


def terminal_cols() -> int:
    """The width human output follows (``COLUMNS``, else the terminal's, else 80: :mod:`pipeline.cli.output`)."""
    from pipeline.cli.output import width

    return width()


def render_run(out: Any, run: Run, colour: bool = False, cols: Optional[int] = None) -> None:
    """Write :func:`run_lines` to ``out`` (a text stream), wrapped at words to ``cols`` when given."""
    out.write("\n".join(_fit(run_lines(run, colour), cols)) + "\n")


def render_tail(out: Any, src: Any, differences: list[dict[str, Any]], ranks: Optional[RankSummary] = None,
                cols: Optional[int] = None) -> None:
    """Per-rank last states, waits and the critical path (several ranks), rank differences, skipped lines."""
    lines = [_safe(x) for x in summary_lines(ranks)] if ranks is not None else []
    for d in differences:
        vals = ", ".join(f"rank {k}: {value_text(v)}" for k, v in d["values"].items())
        lines.append(_safe(f"ranks differ in run {d['run_id']}: {d['key']}: {vals}"))
    if src.skipped_lines or src.unreadable_files:
        lines.append(_safe(f"skipped {src.skipped_lines} unreadable line(s)"
                           + "".join(f"; {s.path}:{s.line} {s.reason}" for s in src.skipped[:5])
                           + "".join(f"; {p}: unreadable file" for p in src.unreadable_files)))
    if lines:
        out.write("\n".join(_fit(lines, cols)) + "\n")


def _is_tty(out: Any) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):
        return False


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
    verified, steps = verification_obj(run)
    return {"run_id": run.run_id, "rank": run.rank, "launch_id": run.launch_id, "ok": run.ok, "status": run.status,
            "last_state": run.last_state, "states": run.states(), "runner_states": run.runner_states(),
            "decisions": run.decisions(), "verified": verified, "model_steps": steps,
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
    for r in d["ranks"]:  # each failure in the command line's words, as inspect shows it (failure_of)
        for side in ("failure_a", "failure_b"):
            if r[side] is not None:
                from pipeline.cli.output import cli_error, command_dests
                from pipeline.core.contracts import ErrorInfo

                r[side] = msgspec.to_builtins(cli_error(msgspec.convert(r[side], ErrorInfo), command_dests("run")))
    if ns.json:
        sys.stdout.write(msgspec.json.encode({"diff": d}).decode() + "\n")
    else:
        sys.stdout.write("\n".join(_fit(diff_lines(d, _safe), terminal_cols())) + "\n")
    return EXIT_OK if d["ok"] else EXIT_FAILED  # as inspect's: 1 when a start read failed or is incomplete


def cmd(ns: argparse.Namespace) -> int:
    if getattr(ns, "diff", False):
        return _diff(ns)
    from pipeline.cli.flags import check_log_paths

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

