"""The command line's output: the run/plan report (one JSON object with ``--json``, or rich tables), errors in the
command line's words, text at the console's width, and stdout/stderr that survive a reader leaving early.

Details: docs/internals.md, ``pipeline.cli.output``.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
import textwrap
from typing import Any, Iterable, Mapping, Optional, Sequence

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import BuildPlan, DtypeChoice, ErrorInfo, Resolution, SetupWarning
from pipeline.core.errors import EXIT_OK, OutputWriteFailed
from pipeline.core.model_spec import format_layer_ids
from pipeline.core.value_text import value_text
from states import evidence as ev_mod


def _resolved(prefill: str, decode: str, is_draft_override: bool, rules: Any, dtype: Any,
              not_attention: Any, speculative: Any = None, evidence: Any = None) -> dict[str, Any]:
    out = {"prefill": prefill, "decode": decode, "is_draft_override": is_draft_override, "rules": dict(rules),
           "dtype": None if dtype is None else {"value": dtype.value, "source": dtype.source},
           "not_attention": msgspec.to_builtins(list(not_attention))}
    if speculative is not None:
        out["speculative"] = msgspec.to_builtins(speculative)
    if evidence:  # traces recorded before the measured table have none
        out["evidence"] = ev_mod.as_json(evidence)
        out["evidence_text"] = {h: ev_mod.text(h, out[h], e) for h, e in evidence.items()}
    return out


def resolved_obj(res: Optional[Resolution]) -> Optional[dict[str, Any]]:
    """The ``resolved`` object of run/plan JSON, from a Resolution.

    ``{prefill, decode, is_draft_override, rules, dtype: {value, source}, not_attention: [{kind, layer_ids}]}``
    — ``dtype.source`` is ``field`` or ``auto:<rule>`` (:data:`pipeline.core.dtypes.AUTO_RULES`);
    ``not_attention`` lists the layers no attention backend serves (linear attention, mamba); with speculative
    decoding, ``speculative: {algorithm, num_steps, topk, num_draft_tokens, source}`` (the settled shape);
    ``evidence: {prefill, decode}`` (:func:`states.evidence.as_json`) with ``evidence_text``, each half's line.
    """
    if res is None:
        return None
    return _resolved(res.pair.prefill, res.pair.decode, res.pair.is_draft_override, res.rules, res.dtype,
                     res.not_attention, res.speculative, res.evidence)


def resolved_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """The same object from a run's ``backends_resolved`` and ``setting_resolved`` (dtype) records
    (None if the run never resolved)."""
    records = list(records)
    e = next((r for r in records if isinstance(r, ev.BackendsResolved)), None)
    d = next((r for r in records if isinstance(r, ev.SettingResolved) and r.field == "dtype"), None)
    return None if e is None else _resolved(e.prefill, e.decode, e.is_draft_override, e.rules,
                                            None if d is None else DtypeChoice(value=str(d.value), source=d.source),
                                            e.not_attention, e.speculative, e.evidence)


def _layers_text(ids: list[int]) -> str:
    return format_layer_ids(ids)


def plan_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """The ``plan`` object from a run's ``build_planned`` record (None if the run never planned)."""
    return plan_obj(next((r for r in records if isinstance(r, ev.BuildPlanned)), None))


def plan_obj(plan: Optional[BuildPlan | ev.BuildPlanned]) -> Optional[dict[str, Any]]:
    """The ``plan`` object of run/plan JSON, from a BuildPlan (or the record that logged it)."""
    if plan is None:
        return None
    return {"mode": plan.mode.value, "hybrid": plan.hybrid, "instances": msgspec.to_builtins(plan.instances),
            "workspaces": msgspec.to_builtins(plan.workspaces)}


def skips_from(records: Iterable[ev.Event]) -> list[dict[str, str]]:
    return [{"what": r.what, "reason": r.reason} for r in records
            if isinstance(r, (ev.StepSkipped, ev.FeatureDowngraded))]


def warnings_from(records: Iterable[ev.Event]) -> list[dict[str, Any]]:
    """The ``warnings`` list of run JSON from the ``reference_fallback`` / ``feature_downgraded`` records,
    in the shape ``plan`` gives (:class:`~pipeline.core.contracts.SetupWarning`)."""
    out: list[SetupWarning] = []
    for r in records:
        if isinstance(r, ev.ReferenceFallback):
            out.append(SetupWarning(code="reference_fallback", what="+".join(r.halves), message=r.message,
                                    avoid=dict(r.avoid), rejected=dict(r.rejected)))
        elif isinstance(r, ev.FeatureDowngraded):
            out.append(SetupWarning(code="feature_downgraded", what=r.what, message=r.reason, avoid=dict(r.avoid)))
    return [msgspec.to_builtins(w) for w in out]


def warning_line(warnings: list[dict[str, Any]]) -> Optional[str]:
    """The one warning line run/plan print for their warnings (None without any): what fell back or was
    downgraded and why — each warning's message, as ``--json``'s ``warnings`` give it, in the command line's
    words —, the flags that accept or avoid it, and that ``--strict`` refuses it. The rejected candidates'
    own reasons are in the ``rejected`` lines."""
    # slow_phase: one line under the startup summary
    warnings = [w for w in warnings if w["code"] != "slow_phase"]
    if not warnings:
        return None

    parts, avoid = [], {}
    for w in warnings:
        avoid.update(w["avoid"])
        if w["code"] == "reference_fallback":
            parts.append(cli_text(w["message"]))
        else:
            parts.append(f"{w['what']} downgraded: {cli_text(w['message'])}")
    return f"warning: {'; '.join(parts)} (--strict refuses this; to accept or avoid it: {cli_flags(avoid)})"


def fmt_bytes(n: int) -> str:
    """A byte count for people: ``512 B``, ``32.0 KiB``, ``384.0 MiB``, ``1.50 GiB`` (JSON keeps bytes)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}" if unit == "GiB" else f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def emit_json(obj: dict[str, Any]) -> None:
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    sys.stdout.flush()


def _console():

    return console()


def render_error(info: ErrorInfo) -> None:
    """Print one ErrorInfo as a readable block on stderr, wrapped at words to the terminal's width."""
    from rich.markup import escape


    c = console(stderr=True)
    head = wrap(f"error [{info.code}] in state {info.state}: {info.message}", width(c))
    c.print(f"[bold red]error[/]{escape(head[0][len('error'):])}", soft_wrap=True)
    for part in head[1:]:
        c.print(part, markup=False, soft_wrap=True)

    for label, text in entry_rows(info):
        print_line(c, f"  {label:<6} {text}", indent="    ")
    if info.json_path:
        print_line(c, f"  at     {info.json_path}", indent="    ")
    if info.allowed:
        print_line(c, f"  allowed: {', '.join(info.allowed)}", indent="    ")
    if info.remedy:
        print_line(c, f"  remedy: {info.remedy}", indent="    ")


def states_table(title: str, states: list[dict[str, Any]]) -> tuple[str, list[str], list[list[str]]]:
    """``(title, columns, rows)`` of ``[{state, outcome, duration_ms}]``, for :func:`pipeline.cli.output.print_table`."""
    return (title, ["state", "outcome", "duration ms"],
            [[s["state"], s["outcome"], f"{s['duration_ms']:.2f}"] for s in states])


def render_tables(report: dict[str, Any], rejected: Optional[dict[str, Any]] = None, verdict: bool = True) -> None:
    """States, decisions, skips, the one warning line and verification on stdout, at the terminal's width, then the
    verdict (``ok`` / ``failed``, :func:`render_verdict`) unless ``verdict`` is False: a caller with more lines to
    print (``plan``) prints the verdict itself, last."""

    c = _console()
    if report.get("states"):
        print_table(c, *states_table("states", report["states"]))
    res = report.get("resolved")
    if res:
        print_line(c, f"resolved: prefill={res['prefill']} ({res['rules']['prefill']}), "
                      f"decode={res['decode']} ({res['rules']['decode']}), draft override={res['is_draft_override']}")
        if res.get("dtype"):
            print_line(c, f"dtype: {res['dtype']['value']} ({res['dtype']['source']})")
        sp = res.get("speculative")
        if sp:
            print_line(c, f"speculative: {sp['algorithm']} {sp['num_steps']} steps, top-k {sp['topk']}, "
                          f"{sp['num_draft_tokens']} draft tokens per verify ({sp['source']})")
        for line in (res.get("evidence_text") or {}).values():  # a table with nothing for this request: no line
            if ev_mod.NO_ROW not in line:
                print_line(c, line)
        for g in res.get("not_attention") or []:
            print_line(c, f"not attention (no KV cache, computed by the model's own kernels): {g['kind']} layers "
                          f"{_layers_text(g['layer_ids'])}")
    for half, rej in (rejected or {}).items():
        for r in rej:
            print_line(c, f"  rejected for {half}: {r['backend']}: {'; '.join(r['reasons'])}", indent="    ")
    plan = report.get("plan")
    if plan:
        print_table(c, f"plan: mode={plan['mode']} hybrid={plan['hybrid']}", ["role", "backend", "workspace"],
                    [[i["role"], i["backend"], str(i["workspace"])] for i in plan["instances"]])
        for w in plan["workspaces"]:
            print_line(c, f"  workspace {w['id']}: {fmt_bytes(w['bytes'])}, owner {w['owner']}, "
                          f"shared by {', '.join(w['shared_by'])}", indent="    ")
    by_reason: dict[str, list[str]] = {}  # one line per reason (resolve's and capture's graph skip say the same)
    for s in report.get("skips") or []:
        by_reason.setdefault(s["reason"], []).append(s["what"])

    for reason, whats in by_reason.items():
        print_line(c, f"skipped: {', '.join(dict.fromkeys(whats))}: {cli_text(reason)}")
    line = warning_line(report.get("warnings") or [])
    if line:
        print_line(c, line, style="bold yellow")
    if report.get("verified"):
        print_table(c, "verification vs float64 reference (max|out-ref|/max|ref|)",
                    ["role", "backend", "max rel err", "tol", "passed"],
                    [[v["role"], v["backend"], f"{v['max_rel_err']:.2e}", f"{v['tol']:.0e}",
                      "yes" if v["passed"] else "NO"] for v in report["verified"]])
    if report.get("log_file"):
        print_line(c, f"log: {report['log_file']}")
    if verdict:
        render_verdict(report, c)


def render_verdict(report: dict[str, Any], c: Optional[Any] = None) -> None:
    """The verdict line on stdout: ``ok`` (green) when ``report["ok"]``, else ``failed`` (red); one word, never
    wrapped, whatever the console's width (a script reads the last line: ``COLUMNS=1`` must not split it)."""
    (c or _console()).print("[bold green]ok[/]" if report.get("ok") else "[bold red]failed[/]", soft_wrap=True)


# ASCII stand-ins for the glyphs human output uses; anything else that cannot be encoded becomes "?".
GLYPHS = str.maketrans({
    "└": "`-", "├": "|-", "│": "|", "─": "-", "━": "-", "═": "=", "→": "->", "←": "<-", "…": "...", "—": "--",
    "–": "-", "·": "-", "×": "x", "≥": ">=", "≤": "<=", "≈": "~", "✓": "ok", "✗": "x", "µ": "u", "•": "*",
})


def degrade(text: str, encoding: str) -> str:
    """``text`` as ``encoding`` can write it: our glyphs in ASCII, the rest replaced (``?``)."""
    text = text.translate(GLYPHS)
    return text.encode(encoding, "replace").decode(encoding, "replace")


class SafeText:
    """A text stream whose writes never raise ``UnicodeEncodeError`` (every other attribute is the stream's)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text``; what the stream cannot encode is degraded (:func:`degrade`) and written instead."""
        try:
            return self.stream.write(text)
        except UnicodeEncodeError:
            self.stream.write(degrade(text, getattr(self.stream, "encoding", None) or "ascii"))
            return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, … of the real stream
        return getattr(self.stream, name)


def safe(stream: Any) -> Any:
    """``stream`` wrapped in :class:`SafeText` (once; None stays None)."""
    return stream if stream is None or isinstance(stream, SafeText) else SafeText(stream)


def console(stderr: bool = False) -> Any:
    """A rich Console at the terminal's width (``COLUMNS`` honoured; 80 with no terminal), no highlighting, no emoji
    codes (a ``:name:`` read from a log or a config stays as typed)."""
    from rich.console import Console

    from pipeline.observe.progress import fixed_width

    return Console(stderr=stderr, highlight=False, soft_wrap=False, emoji=False,  # ":x:" in a log stays text
                   width=fixed_width())


def width(c: Optional[Any] = None) -> int:
    """The console's width in columns (at least 20, so that indented lines keep some text)."""
    return max(20, (c or console()).width)


def wrap(text: str, cols: int, indent: str = "  ") -> list[str]:
    """``text`` broken at spaces into lines of at most ``cols`` columns, later lines indented by ``indent``.

    Never splits a word or breaks at a hyphen; a word longer than the line stays whole (the line is then
    longer than ``cols``). Leading spaces of ``text`` are kept. A line end in ``text`` (a message that holds a
    table) stays one: each line after it starts indented, then wraps on its own.
    """
    lead = text[:len(text) - len(text.lstrip(" "))]
    if "\n" in text:
        first, *rest = text.split("\n")
        return wrap(first, cols, indent) + [x for r in rest for x in wrap(lead + indent + r, cols, indent)]
    if len(text) <= cols:
        return [text]
    return textwrap.wrap(text, cols, initial_indent="", subsequent_indent=lead + indent, break_long_words=False,
                         break_on_hyphens=False, drop_whitespace=True, replace_whitespace=False) or [text]


def wrap_lines(lines: Sequence[str], cols: int, indent: str = "  ") -> list[str]:
    """:func:`wrap` over several lines (embedded newlines kept as line ends)."""
    out: list[str] = []
    for line in lines:
        for part in str(line).split("\n"):
            out += wrap(part, cols, indent)
    return out


def print_stderr_lines(lines: Sequence[str]) -> None:
    """``notice:`` / ``warning:`` lines on stderr as plain text (never markup), broken at spaces to stderr's width as
    every other human line, flushed (they precede the report on stdout: one terminal, two streams)."""
    import sys

    for part in wrap_lines(lines, width(console(stderr=True))):
        print(part, file=sys.stderr, flush=True)


def print_line(c: Any, text: str, style: Optional[str] = None, indent: str = "  ") -> None:
    """One line of plain text (never markup), wrapped at words to the console's width."""
    for part in wrap_lines([text], width(c), indent):
        c.print(part, style=style, markup=False, soft_wrap=True, highlight=False)


def _min_width(cells: Sequence[str]) -> int:
    """The longest word (run of non-space characters, leading indentation included) of a column's cells."""
    best = 1
    for cell in cells:
        text = str(cell)
        lead = len(text) - len(text.lstrip(" "))
        words = text.split() or [""]
        best = max(best, lead + len(words[0]), *(len(w) for w in words))
    return best


def table_fits(columns: Sequence[str], rows: Sequence[Sequence[str]], cols: int) -> bool:
    """Whether a boxed table of these cells fits ``cols`` columns without cutting or splitting a word
    (each column at least its longest word, plus rich's one-space padding each side and the borders)."""
    mins = [_min_width([h, *(r[i] for r in rows)]) for i, h in enumerate(columns)]
    return sum(mins) + 3 * len(columns) + 1 <= cols


def column_widths(columns: Sequence[str], rows: Sequence[Sequence[str]], cols: int) -> list[int]:
    """Each column's text width in a table of ``cols`` columns: its longest line when everything fits, else its
    longest word plus a share of the room left, in proportion to how much wider its longest line is (rich's own
    collapse can leave a column narrower than its longest word, which it then ends with an ellipsis)."""
    mins = [_min_width([h, *(r[i] for r in rows)]) for i, h in enumerate(columns)]
    maxs = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(columns)]
    room = cols - 3 * len(columns) - 1
    if sum(maxs) <= room:
        return maxs
    spare, slack = room - sum(mins), [b - a for a, b in zip(mins, maxs)]
    total = sum(slack) or 1
    out = [a + spare * s // total for a, s in zip(mins, slack)]
    for i in sorted(range(len(out)), key=lambda i: slack[i] - (out[i] - mins[i]), reverse=True):
        if sum(out) >= room:
            break
        if out[i] < maxs[i]:
            out[i] += 1
    return out


def print_table(c: Any, title: Optional[str], columns: Sequence[str], rows: Sequence[Sequence[Any]],
                justify: Optional[Sequence[str]] = None) -> None:
    """A table on ``c`` that never cuts a cell: a rich table whose columns are at least their longest word
    wide when that fits the console, else one record per row (first cell, then ``  column: value`` lines).

    Cells are plain text (a log's strings can hold markup characters). ``justify``: per column
    (``left``/``right``), default left.
    """
    from rich.table import Table
    from rich.text import Text

    cells = [[str(x) for x in r] for r in rows]
    cols = width(c)
    if title:  # its own wrapped line: rich would wrap a title to the table's (narrower) width
        print_line(c, title)
    if table_fits(columns, cells, cols):
        t = Table()
        for i, (h, w) in enumerate(zip(columns, column_widths(columns, cells, cols))):
            t.add_column(h, width=w, overflow="fold", justify=(justify[i] if justify else "left"))  # type: ignore[arg-type]
        for r in cells:
            t.add_row(*(Text(x) for x in r))
        c.print(t)
        return
    for r in cells:
        print_line(c, r[0].strip() or "-", indent="    ")
        for h, v in zip(columns[1:], r[1:]):
            print_line(c, f"  {h}: {v}", indent="    ")


# One-word fields rewritten when they stand alone (the others — device, model, rank — are words of prose too).
BARE_ONE_WORD = ("strict",)
_VALUE = r"""'[^']*'|"[^"]*"|<[^<>]*>|True|False|-?\d+(?:\.\d+)?"""  # <…>: a value too long to print


def flag_of(field: str) -> str:
    """``attention_backend`` → ``--attention-backend``."""
    return "--" + field.replace("_", "-")


@functools.lru_cache(maxsize=1)
def cli_dests() -> frozenset[str]:
    """Every destination of a ``--long-option`` of every ``attn-setup`` subcommand (whose flag is its kebab case)."""
    import argparse

    from pipeline.cli.flags import build_parser

    out: set[str] = set()

    def walk(p: argparse.ArgumentParser) -> None:
        for a in p._actions:  # argparse keeps no public list of actions
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    walk(sub)
            elif any(o == flag_of(a.dest) for o in a.option_strings):
                out.add(a.dest)

    walk(build_parser())
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def command_dests(command: str | None) -> frozenset[str]:
    """The flag destinations of one subcommand (``plan`` has no ``--device``), plus the main parser's;
    every subcommand's (:func:`cli_dests`) when ``command`` is None or unknown."""
    import argparse

    from pipeline.cli.flags import build_parser

    parser = build_parser()
    out = {a.dest for a in parser._actions if any(o == flag_of(a.dest) for o in a.option_strings)}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) and command in a.choices:
            sub = a.choices[command]
            return frozenset(out | {b.dest for b in sub._actions if any(o == flag_of(b.dest) for o in b.option_strings)})
    return cli_dests()


def _value(raw: str) -> str:
    return raw[1:-1] if raw[:1] in "'\"" else raw


def to_cli(text: str, dests: Iterable[str] | None = None) -> str:
    """Rewrite the field names of a library remedy into the command line's flags.

    ``field='x'`` → ``--field x``; ``field=True`` → ``--field``; ``field=3`` → ``--field 3``; a bare
    snake_case ``field`` (or ``strict``) → ``--field``. Names inside dotted paths (``pool.max_reqs``),
    environment variables and words that are not flag destinations are left alone.
    """
    names = sorted(set(cli_dests() if dests is None else dests), key=len, reverse=True)
    if not names or not text:
        return text
    alt = "|".join(re.escape(n) for n in names)
    lead = r"(?<![\w.$\-])"

    def assign(m: re.Match) -> str:
        field, raw = m.group(1), m.group(2)
        if raw == "True":
            return flag_of(field)
        if raw == "False":
            return f"drop {flag_of(field)}"
        return f"{flag_of(field)} {_value(raw)}"

    text = re.sub(rf"{lead}({alt})=({_VALUE})", assign, text)
    bare = [n for n in names if "_" in n or n in BARE_ONE_WORD]
    if bare:
        text = re.sub(rf"{lead}({'|'.join(re.escape(n) for n in bare)})(?![\w(=\-]|\.\w)",
                      lambda m: flag_of(m.group(1)), text)
    return text


def cli_flags(fix: Mapping[str, Any]) -> str:
    """Field assignments as the flags that make them: ``--attention-backend torch_native --disable-cuda-graph``.

    A ``False`` boolean is dropping the flag: ``drop --enable-two-batch-overlap``.
    """
    parts = []
    for k, v in fix.items():
        if v is True:
            parts.append(flag_of(k))
        elif v is False:
            parts.append(f"drop {flag_of(k)}")
        else:
            parts.append(f"{flag_of(k)} {v}")
    return " ".join(parts)


# Entries of the library's flags list that no flag or field sets: the message already names them (``missing_package``:
# "package 'flashinfer-python' is not installed"; ``unsupported_package`` / ``installed_version`` /
# ``supported_versions``: "package 'flashinfer-python' is 0.6.13, a version attn-setup does not support (it supports
# flashinfer-python==0.7.2 …)"), and the command line lists only what the user can change.
NOT_FLAGS = frozenset({"missing_package", "unsupported_package", "installed_version", "supported_versions"})
_PATH = re.compile(r"(?<![\w.$\-])(?:pool|args)\.([a-z_][a-z0-9_]*)\b")
_NONE_ASSIGN = re.compile(r"(?<![\w.])([A-Za-z_][\w.]*)\s*(?:=|is|:)\s*None\b")
_OPTIONAL = re.compile(r"\s*\|\s*None\b")


def flag_name(name: str, dests: Iterable[str] | None = None) -> str:
    """One ErrorInfo flag entry's name on the command line: ``pool.max_reqs`` / ``args.max_reqs`` / ``max_reqs``
    → ``--max-reqs`` when a flag sets that field; any other name (``--model``, ``MASTER_ADDR``, a config key
    such as ``num_attention_heads``, ``run_id``) is returned unchanged."""
    known = cli_dests() if dests is None else frozenset(dests)
    field = name.split(".", 1)[1] if name.startswith(("pool.", "args.")) else name
    return flag_of(field) if field in known and "." not in field else name


def cli_text(text: str, dests: Iterable[str] | None = None) -> str:
    """A message or remedy in the command line's words: field paths and names that a flag sets become that
    flag (:func:`to_cli`), ``X=None`` becomes ``X not set`` and ``T | None`` becomes ``T or not set``."""
    if not text:
        return text
    known = cli_dests() if dests is None else frozenset(dests)
    text = _PATH.sub(lambda m: m.group(1) if m.group(1) in known else m.group(0), text)
    text = _NONE_ASSIGN.sub(lambda m: f"{m.group(1)} not set", text)
    text = _OPTIONAL.sub(" or not set", text)
    return to_cli(text, known)


def cli_error(info: ErrorInfo, dests: Iterable[str] | None = None) -> ErrorInfo:
    """The ErrorInfo as the command line shows it, in one vocabulary (see docs/internals.md, ``pipeline.cli.output``).

    Flag entries are renamed by :func:`flag_name`, those in :data:`NOT_FLAGS` left out, and deduplicated (the same name twice keeps its first
    value: ``--model`` given and the loader's own ``path`` entry for the same file); the message, the
    allowed values and the remedy go through :func:`cli_text`. ``dests``: the flag destinations to use
    (default: every subcommand's, :func:`cli_dests`).
    """
    from pipeline.core.errors import Flag

    known = cli_dests() if dests is None else frozenset(dests)
    flags: list[Flag] = []
    seen: set[str] = set()
    derived = next((f.value for f in info.flags if f.name == "derived" and isinstance(f.value, dict)), {})
    for f in info.flags:
        name = f.name if f.name in derived else flag_name(f.name, known)  # a derived field is no flag to change
        if f.name == "derived" and derived:
            f = Flag(name=f.name, value={k: flag_name(str(v), known) for k, v in derived.items()})
        if name in NOT_FLAGS:
            continue
        if name not in seen:
            seen.add(name)
            flags.append(Flag(name=name, value=f.value))
    return msgspec.structs.replace(info, flags=flags, message=cli_text(info.message, known),
                                   allowed=[cli_text(a, known) for a in info.allowed],
                                   remedy=cli_text(info.remedy, known))


DERIVED = "derived"


def flag_label(name: str) -> str:
    """How the error block labels one ErrorInfo flag: a command-line flag, a positional argument (``LOG``), an
    environment variable, else a field (a config key, a trace's run id: something no flag sets)."""
    from pipeline.cli.flags import FLAG_DOMAINS

    if name.startswith("-"):
        return "flag"
    if any(fd.flag == name for fd in FLAG_DOMAINS):  # the table's rows not spelled --x are the positional arguments
        return "arg"
    if name.isupper():
        return "env"
    return "field"


_TYPED_WITHOUT_VALUE = re.compile(r"expected (one|at least one) argument|arguments are required|unrecognized arguments")


def typed_without_value(info: Any) -> bool:
    """Whether ``info`` is argparse's refusal of a flag or argument typed without its value (``--log-file`` last,
    a missing ``LOG``, an unknown flag with nothing after it): its ``""`` values mean "none typed"."""
    return info.code == "usage" and _TYPED_WITHOUT_VALUE.search(info.message) is not None


def derived_of(info: Any) -> dict[str, str]:
    """``{field: what it follows from}`` of the error's ``derived`` entry (empty without one)."""
    for f in info.flags:
        if f.name == DERIVED and isinstance(f.value, dict):
            return {str(k): str(v) for k, v in f.value.items()}
    return {}


def entry_rows(info: Any) -> list[tuple[str, str]]:
    """Every entry of the error as ``(label, "name = value")``, in the error's order; a derived field is labelled
    ``derived`` and names what it is derived from: ``cuda_graph_bs = rank 0: 1,2,4,8; … (from --max-reqs)``."""
    derived, bare = derived_of(info), typed_without_value(info)
    rows = []
    for f in info.flags:
        if f.name == DERIVED and derived:
            continue
        text = f"{f.name} = {value_text(f.value, bare)}"
        if f.name in derived:
            rows.append(("derived", f"{text} (from {derived[f.name]})"))
        else:
            rows.append((flag_label(f.name), text))
    return rows


def change_lines(change: list[str]) -> list[str]:
    """The ``flag to change:`` line(s): one line naming every flag, or one line per flag when a value holds every
    rank's (its ``;`` would run into the next flag's)."""
    if not change:
        return []
    if any("; rank " in c for c in change):
        return [f"flag to change: {c}" for c in change]
    return ["flag to change: " + ", ".join(change)]


def open_std_fds() -> frozenset[int]:
    """Point each of the descriptors 0, 1 and 2 that is closed at /dev/null; returns the ones that were closed."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
    if closed:
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return frozenset(closed)
        for fd in closed:
            if fd != null:
                os.dup2(null, fd)
        if null not in closed:
            os.close(null)
    return frozenset(closed)


class ClosedStream:
    """stdout or stderr whose descriptor ``fd`` was closed when the process started: every write and flush raises
    EBADF, as a write to the closed descriptor would (what it is written on is /dev/null, :func:`open_std_fds`)."""

    encoding = "utf-8"

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, text: str) -> int:
        """Raise OSError(EBADF): the caller opened no stream here."""
        raise OSError(errno.EBADF, f"{os.strerror(errno.EBADF)} (descriptor {self.fd} was closed at start)")

    def flush(self) -> None:
        """Nothing buffered; a flush after a write that failed raises nothing new."""

    def fileno(self) -> int:
        """The descriptor (now /dev/null)."""
        return self.fd

    def isatty(self) -> bool:
        """Never a terminal."""
        return False


def std_stream(stream: Any, fd: int, closed: frozenset[int]) -> Any:
    """``stream`` (``sys.stdout`` or ``sys.stderr``), or a :class:`ClosedStream` when descriptor ``fd`` was closed at
    start (Python then gives None, or a stream on the /dev/null :func:`open_std_fds` put there)."""
    return ClosedStream(fd) if stream is None or fd in closed else stream


def quiet(stream: Any = None) -> None:
    """Point the stream's file descriptor (stdout's unless ``stream`` is given) at /dev/null, so that what is left —
    our later writes, a C library's, the interpreter's final flush — goes nowhere instead of raising again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, (stream or sys.stdout).fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (in-process callers)
        pass
    finally:
        os.close(devnull)


def _target(stream: Any) -> Optional[str]:
    """Where the stream's file descriptor points (``/dev/full``, a file on a full disk), when the system says."""
    inner = stream
    while not isinstance(inner, ClosedStream) and "stream" in getattr(inner, "__dict__", {}):  # SafeText's wrapped
        inner = inner.stream
    if isinstance(inner, ClosedStream):
        return f"closed (descriptor {inner.fd})"
    try:
        return os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError, AttributeError):
        return None


class ReaderMayLeave:
    """stdout or stderr (``name``) for a reader that may leave early: the first write or flush that meets a closed pipe
    sends the rest of that stream's output to /dev/null and the command carries on, so its exit code says how the
    command ended, not whether anyone read all of its output. Each stream leaves on its own (with ``2>&1`` both meet
    the closed pipe). Any other write error (``OSError``: a full disk, ``/dev/full``, EIO) does the same and is kept
    in :attr:`error` (with :attr:`target`, where the stream pointed), for :func:`settle` and :func:`report`."""

    def __init__(self, stream: Any, name: str = "stdout") -> None:
        self.stream, self.name, self.gone = stream, name, False
        self.error: Optional[OSError] = None
        self.target: Optional[str] = None

    def write(self, text: str) -> int:
        """Write ``text`` to the stream; after the reader left or a write failed, drop it (its length is returned)."""
        if not self.gone:
            try:
                return self.stream.write(text)
            except OSError as e:
                self._leave(e)
        return len(text)

    def flush(self) -> None:
        """Flush the stream; a closed pipe or a write error met here makes the stream leave (nothing raised)."""
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as e:
                self._leave(e)

    def _leave(self, e: OSError) -> None:
        self.gone = True
        if not isinstance(e, BrokenPipeError):
            self.error, self.target = e, _target(self.stream)
        quiet(self.stream)

    def __getattr__(self, name: str) -> Any:   # isatty, fileno, encoding, … of the real stream
        return getattr(self.stream, name)


def failed(streams: Iterable[Any]) -> list[Any]:
    """The wrapped streams whose output was lost to a write error other than a closed pipe, each flushed first."""
    out = []
    for s in streams:
        try:
            s.flush()
        except (OSError, ValueError, AttributeError):  # not ours (no wrapper), closed by the caller, or none
            pass
        if getattr(s, "error", None) is not None:
            out.append(s)
    return out


def settle(code: int, streams: Optional[Iterable[Any]] = None) -> int:
    """The exit code once the output is out: ``code``, or — when it is 0 and a write to stdout or stderr (default:
    ``sys.stdout``, ``sys.stderr``) failed other than on a closed pipe — :class:`OutputWriteFailed`'s (2). A failed
    command's own code is never replaced."""
    lost = failed((sys.stdout, sys.stderr) if streams is None else streams)
    return OutputWriteFailed.exit_code if lost and code == EXIT_OK else code


def error_of(lost: list[Any]) -> OutputWriteFailed:
    """The typed error naming each stream whose output was lost, where it pointed and why."""
    names = " and ".join(s.name for s in lost)
    why = " and ".join(f"{s.name} ({s.error.strerror or s.error})" for s in lost)
    return OutputWriteFailed(
        f"could not write to {why}: the command's output there is incomplete",
        state="output", flags=[(s.name, s.target or "not known") for s in lost],
        remedy=f"send {names} somewhere that takes the whole output (a file system with free space, a terminal or a "
               f"pipe) and run the command again")


def report(code: int, out: Any, err: Any) -> int:
    """:func:`settle` for :func:`pipeline.cli.main`'s two wrapped streams: the exit code, and the write error named on
    stderr (the error block) when stderr still works."""
    lost = failed((out, err))
    if not lost:
        return code
    if err not in lost:

        try:
            render_error(error_of(lost).info)   # sys.stderr is ``err`` here: a failure there is recorded, not raised
        except (OSError, ValueError):
            pass
        err.flush()
    return OutputWriteFailed.exit_code if code == EXIT_OK else code

