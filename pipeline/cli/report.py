"""The run/plan report: one JSON object (``--json``) or rich tables, built from the event records."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import BuildPlan, DtypeChoice, ErrorInfo, Resolution, SetupWarning
from pipeline.core.model_spec import format_layer_ids
from pipeline.cli.error_lines import flag_label, typed_without_value  # noqa: F401 (importable from here as before)


def _resolved(prefill: str, decode: str, is_draft_override: bool, rules: Any, dtype: Any,
              not_attention: Any, speculative: Any = None) -> dict[str, Any]:
    out = {"prefill": prefill, "decode": decode, "is_draft_override": is_draft_override, "rules": dict(rules),
           "dtype": None if dtype is None else {"value": dtype.value, "source": dtype.source},
           "not_attention": msgspec.to_builtins(list(not_attention))}
    if speculative is not None:
        out["speculative"] = msgspec.to_builtins(speculative)
    return out


def resolved_obj(res: Optional[Resolution]) -> Optional[dict[str, Any]]:
    """The ``resolved`` object of run/plan JSON, from a Resolution.

    ``{prefill, decode, is_draft_override, rules, dtype: {value, source}, not_attention: [{kind, layer_ids}]}``
    — ``dtype.source`` is ``field`` or ``auto:<rule>`` (:data:`pipeline.core.dtypes.AUTO_RULES`);
    ``not_attention`` lists the layers no attention backend serves (linear attention, mamba); with speculative
    decoding, ``speculative: {algorithm, num_steps, topk, num_draft_tokens, source}`` (the settled shape).
    """
    if res is None:
        return None
    return _resolved(res.pair.prefill, res.pair.decode, res.pair.is_draft_override, res.rules, res.dtype,
                     res.not_attention, res.speculative)


def resolved_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """The same object from a run's ``backends_resolved`` and ``setting_resolved`` (dtype) records
    (None if the run never resolved)."""
    records = list(records)
    e = next((r for r in records if isinstance(r, ev.BackendsResolved)), None)
    d = next((r for r in records if isinstance(r, ev.SettingResolved) and r.field == "dtype"), None)
    return None if e is None else _resolved(e.prefill, e.decode, e.is_draft_override, e.rules,
                                            None if d is None else DtypeChoice(value=str(d.value), source=d.source),
                                            e.not_attention, e.speculative)


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


def layer_rule_warnings(request: Any) -> list[dict[str, Any]]:
    """``layer_rule_default`` warnings (:class:`~pipeline.core.contracts.SetupWarning`) for the model and the draft
    model whose layers a default rule read (:func:`pipeline.core.model_spec.layer_rule_note`: a ``model_type`` without
    a layer rule and no layer list in the config), each naming the rule applied and how to override it."""
    from pipeline.core.model_spec import layer_rule_note

    out = []
    for what, spec in (("model", request.model), ("draft_model", request.draft_model)):
        if spec is None or not spec.source or spec.source == "dict":
            continue
        try:
            note = layer_rule_note(spec.source)
        except Exception:  # noqa: BLE001 - the config was read once already; a note is never an error
            note = None
        if note:
            out.append(msgspec.to_builtins(SetupWarning(code="layer_rule_default", what=what, message=note)))
    return out


def warning_line(warnings: list[dict[str, Any]]) -> Optional[str]:
    """The one warning line run/plan print for their warnings (None without any): what fell back or was
    downgraded and why — each warning's message, as ``--json``'s ``warnings`` give it, in the command line's
    words —, the flags that accept or avoid it, and that ``--strict`` refuses it. The rejected candidates'
    own reasons are in the ``rejected`` lines."""
    # layer_rule_default: each its own line (render_tables); slow_phase: one line under the startup summary
    warnings = [w for w in warnings if w["code"] not in ("layer_rule_default", "slow_phase")]
    if not warnings:
        return None
    from pipeline.cli.wording import cli_flags, cli_text

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
    from pipeline.cli.console import console

    return console()


def flag_value_text(value: Any, no_value: bool = False) -> str:
    """A flag's value for people: ``'x'`` quoted (an empty string as ``''``), numbers as typed, ``not set`` for a
    missing value (None), ``(no value)`` for a flag typed without one (``no_value``:
    :func:`pipeline.cli.error_lines.typed_without_value`), lists joined and every rank's values as
    ``rank 0: 8; rank 1: 16`` (:func:`pipeline.core.value_text.value_text`: never a Python repr)."""
    from pipeline.core.value_text import value_text

    return value_text(value, no_value)


def render_error(info: ErrorInfo) -> None:
    """Print one ErrorInfo as a readable block on stderr, wrapped at words to the terminal's width."""
    from rich.markup import escape

    from pipeline.cli.console import console, print_line, width, wrap

    c = console(stderr=True)
    head = wrap(f"error [{info.code}] in state {info.state}: {info.message}", width(c))
    c.print(f"[bold red]error[/]{escape(head[0][len('error'):])}", soft_wrap=True)
    for part in head[1:]:
        c.print(part, markup=False, soft_wrap=True)
    from pipeline.cli.error_lines import entry_rows

    for label, text in entry_rows(info):
        print_line(c, f"  {label:<6} {text}", indent="    ")
    if info.json_path:
        print_line(c, f"  at     {info.json_path}", indent="    ")
    if info.allowed:
        print_line(c, f"  allowed: {', '.join(info.allowed)}", indent="    ")
    if info.remedy:
        print_line(c, f"  remedy: {info.remedy}", indent="    ")


def states_table(title: str, states: list[dict[str, Any]]) -> tuple[str, list[str], list[list[str]]]:
    """``(title, columns, rows)`` of ``[{state, outcome, duration_ms}]``, for :func:`pipeline.cli.console.print_table`."""
    return (title, ["state", "outcome", "duration ms"],
            [[s["state"], s["outcome"], f"{s['duration_ms']:.2f}"] for s in states])


def render_tables(report: dict[str, Any], rejected: Optional[dict[str, Any]] = None, verdict: bool = True) -> None:
    """States, decisions, skips, the one warning line and verification on stdout, at the terminal's width, then the
    verdict (``ok`` / ``failed``, :func:`render_verdict`) unless ``verdict`` is False: a caller with more lines to
    print (``plan``) prints the verdict itself, last."""
    from pipeline.cli.console import print_line, print_table

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
    from pipeline.cli.wording import cli_text

    for reason, whats in by_reason.items():
        print_line(c, f"skipped: {', '.join(dict.fromkeys(whats))}: {cli_text(reason)}")
    line = warning_line(report.get("warnings") or [])
    if line:
        print_line(c, line, style="bold yellow")
    for w in report.get("warnings") or []:
        if w["code"] == "layer_rule_default":
            print_line(c, f"warning: {w['what']}: {w['message']}", style="bold yellow")
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
