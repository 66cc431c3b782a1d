"""``attn-setup inspect``'s text view: one run as fixed-width lines, and the tail after the runs.

:func:`run_lines` — status, the timeline table (a runner's states with the setup machine's nested under
``attention``), the decisions, the explanation of a failure (:func:`explain`) and the startup summary;
:func:`render_tail` — per-rank last states and waits, rank differences, skipped lines. Every string read from a
log goes out as plain text with control characters escaped (:func:`_safe`), wrapped at words to the terminal's
width. :func:`failure_of` words a run's failure as the command line does (the ``--json`` view uses it too).
"""

from __future__ import annotations

from typing import Any, Optional

from pipeline.cli.startup import summary_of, summary_rows
from pipeline.core.events import StartupSummary
from pipeline.core.model_spec import format_layer_ids
from pipeline.observe.rank_summary import RankSummary, summary_lines
from pipeline.observe.runview import device_text
from pipeline.observe.trace import Run


def failure_of(run: Run) -> Any:
    """The run's failure ErrorInfo in the command line's words, as ``run --json`` prints it
    (:func:`pipeline.cli.wording.cli_error`): the flags of the command that wrote the trace (its
    ``command_started``; ``run``'s for a trace written by the library) wherever a flag sets the field."""
    info = run.failure
    if info is None:
        return None
    from pipeline.cli.wording import cli_error, command_dests
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
    from pipeline.cli.report import flag_label, flag_value_text, typed_without_value

    out = [f"failed in state {info.state!r}: [{info.code}] {info.message}"]  # printed with markup off
    flags = [f for f in info.flags if flag_label(f.name) == "flag"]  # only flags are flags to change
    bare = typed_without_value(info)
    if flags:
        out.append("flag to change: " + ", ".join(f"{f.name} = {flag_value_text(f.value, bare)}" for f in flags))
    out += [f"{flag_label(f.name)} {f.name} = {flag_value_text(f.value, bare)}" for f in info.flags
            if f not in flags]
    if info.allowed:
        out.append("allowed: " + ", ".join(info.allowed))
    if info.remedy:
        out.append("remedy: " + info.remedy)
    return out


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


def _safe(text: Any) -> str:
    """A string from a log, safe to print: control characters (terminal escapes) shown escaped."""
    text = str(text)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


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
    lines += ["  " + _safe(line) for line in _decision_lines(run.decisions()) + explain(run)]
    summary = summary_of(run.all(StartupSummary))
    if summary is not None:
        rows = summary_rows(summary)
        pw = max(len(r[0]) for r in rows)
        lines.append("  startup summary (seconds):")
        lines += [_safe(f"    {a:<{pw}}  {b:>9}  {c}").rstrip() for a, b, c in rows]
    return lines


def _fit(lines: list[str], cols: Optional[int]) -> list[str]:
    """Lines broken at spaces to ``cols`` columns (:func:`pipeline.cli.console.wrap`), unchanged when None."""
    if not cols:
        return lines
    from pipeline.cli.console import wrap_lines

    return wrap_lines(lines, cols, "  ")


def terminal_cols() -> int:
    """The width human output follows (``COLUMNS``, else the terminal's, else 80: :mod:`pipeline.cli.console`)."""
    from pipeline.cli.console import width

    return width()


def render_run(out: Any, run: Run, colour: bool = False, cols: Optional[int] = None) -> None:
    """Write :func:`run_lines` to ``out`` (a text stream), wrapped at words to ``cols`` when given."""
    out.write("\n".join(_fit(run_lines(run, colour), cols)) + "\n")


def render_tail(out: Any, src: Any, differences: list[dict[str, Any]], ranks: Optional[RankSummary] = None,
                cols: Optional[int] = None) -> None:
    """Per-rank last states, waits and the critical path (several ranks), rank differences, skipped lines."""
    lines = [_safe(x) for x in summary_lines(ranks)] if ranks is not None else []
    for d in differences:
        vals = ", ".join(f"rank {k}: {v!r}" for k, v in d["values"].items())
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
