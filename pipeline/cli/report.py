"""The run/plan report: one JSON object (``--json``) or rich tables, built from the event records."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import BuildPlan, DtypeChoice, ErrorInfo, Resolution, SetupWarning
from pipeline.core.model_spec import format_layer_ids


def _resolved(prefill: str, decode: str, is_draft_override: bool, rules: Any, dtype: Any,
              not_attention: Any) -> dict[str, Any]:
    return {"prefill": prefill, "decode": decode, "is_draft_override": is_draft_override, "rules": dict(rules),
            "dtype": None if dtype is None else {"value": dtype.value, "source": dtype.source},
            "not_attention": msgspec.to_builtins(list(not_attention))}


def resolved_obj(res: Optional[Resolution]) -> Optional[dict[str, Any]]:
    """The ``resolved`` object of run/plan JSON, from a Resolution.

    ``{prefill, decode, is_draft_override, rules, dtype: {value, source}, not_attention: [{kind, layer_ids}]}``
    — ``dtype.source`` is ``field`` or ``auto:<rule>`` (:data:`pipeline.core.dtypes.AUTO_RULES`);
    ``not_attention`` lists the layers no attention backend serves (linear attention, mamba).
    """
    if res is None:
        return None
    return _resolved(res.pair.prefill, res.pair.decode, res.pair.is_draft_override, res.rules, res.dtype,
                     res.not_attention)


def resolved_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """The same object from a run's ``backends_resolved`` and ``setting_resolved`` (dtype) records
    (None if the run never resolved)."""
    records = list(records)
    e = next((r for r in records if isinstance(r, ev.BackendsResolved)), None)
    d = next((r for r in records if isinstance(r, ev.SettingResolved) and r.field == "dtype"), None)
    return None if e is None else _resolved(e.prefill, e.decode, e.is_draft_override, e.rules,
                                            None if d is None else DtypeChoice(value=str(d.value), source=d.source),
                                            e.not_attention)


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
    """The one short line run/plan print for their warnings (None without any): what fell back or was
    downgraded, the flags that accept or avoid it, and that ``--strict`` refuses it. The reasons are in
    the ``rejected``/``skipped`` lines and in ``--json``'s ``warnings``."""
    warnings = [w for w in warnings if w["code"] != "layer_rule_default"]  # each its own line (render_tables)
    if not warnings:
        return None
    from pipeline.backends.registry import reference_name
    from pipeline.cli.wording import cli_flags

    parts, avoid, reference = [], {}, reference_name()
    for w in warnings:
        avoid.update(w["avoid"])
        if w["code"] == "reference_fallback":
            parts.append(f"{w['what'].replace('+', ' and ')} fell back to {reference} (the reference backend)")
        else:
            parts.append(f"{w['what']} downgraded")
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
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False, width=120)


def render_error(info: ErrorInfo) -> None:
    """Print one ErrorInfo as a readable block on stderr."""
    from rich.console import Console

    c = Console(stderr=True, highlight=False, width=120)
    from rich.markup import escape

    c.print(f"[bold red]error[/] {escape(f'[{info.code}]')} in state {info.state}: {escape(info.message)}")
    for f in info.flags:
        c.print(f"  flag   {f.name} = {f.value!r}", markup=False)
    if info.json_path:
        c.print(f"  at     {info.json_path}", markup=False)
    if info.allowed:
        c.print(f"  allowed: {', '.join(info.allowed)}", markup=False)
    if info.remedy:
        c.print(f"  remedy: {info.remedy}", markup=False)


def states_table(title: str, states: list[dict[str, Any]]) -> Any:
    """A rich table of ``[{state, outcome, duration_ms}]``."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("state", "outcome", "duration ms"):
        t.add_column(col)
    for s in states:
        t.add_row(s["state"], s["outcome"], f"{s['duration_ms']:.2f}")
    return t


def render_tables(report: dict[str, Any], rejected: Optional[dict[str, Any]] = None) -> None:
    """States, decisions, skips, the one warning line and verification as rich tables on stdout."""
    from rich.markup import escape
    from rich.table import Table

    c = _console()
    if report.get("states"):
        c.print(states_table("states", report["states"]))
    res = report.get("resolved")
    if res:
        c.print(f"resolved: prefill={res['prefill']} ({res['rules']['prefill']}), "
                f"decode={res['decode']} ({res['rules']['decode']}), draft override={res['is_draft_override']}")
        if res.get("dtype"):
            c.print(f"dtype: {res['dtype']['value']} ({res['dtype']['source']})", markup=False)
        for g in res.get("not_attention") or []:
            c.print(f"not attention (no KV cache, computed by the model's own kernels): {g['kind']} layers "
                    f"{_layers_text(g['layer_ids'])}", markup=False)
    for half, rej in (rejected or {}).items():
        for r in rej:
            c.print(f"  rejected for {half}: {r['backend']}: {'; '.join(r['reasons'])}", markup=False)
    plan = report.get("plan")
    if plan:
        t = Table(title=f"plan: mode={plan['mode']} hybrid={plan['hybrid']}", title_justify="left")
        for col in ("role", "backend", "workspace"):
            t.add_column(col)
        for i in plan["instances"]:
            t.add_row(i["role"], i["backend"], str(i["workspace"]))
        c.print(t)
        for w in plan["workspaces"]:
            c.print(f"  workspace {w['id']}: {fmt_bytes(w['bytes'])}, owner {w['owner']}, "
                    f"shared by {', '.join(w['shared_by'])}", markup=False)
    by_reason: dict[str, list[str]] = {}  # one line per reason (resolve's and capture's graph skip say the same)
    for s in report.get("skips") or []:
        by_reason.setdefault(s["reason"], []).append(s["what"])
    for reason, whats in by_reason.items():
        c.print(f"skipped: {', '.join(dict.fromkeys(whats))}: {reason}", markup=False)
    line = warning_line(report.get("warnings") or [])
    if line:
        c.print(f"[bold yellow]{escape(line)}[/]", soft_wrap=True)
    for w in report.get("warnings") or []:
        if w["code"] == "layer_rule_default":
            c.print(f"[bold yellow]warning: {escape(w['what'])}: {escape(w['message'])}[/]", soft_wrap=True)
    if report.get("verified"):
        t = Table(title="verification vs float64 reference (max|out-ref|/max|ref|)", title_justify="left")
        for col in ("role", "backend", "max rel err", "tol", "passed"):
            t.add_column(col)
        for v in report["verified"]:
            t.add_row(v["role"], v["backend"], f"{v['max_rel_err']:.2e}", f"{v['tol']:.0e}", "yes" if v["passed"] else "NO")
        c.print(t)
    if report.get("log_file"):
        c.print(f"log: {report['log_file']}")
    c.print("[bold green]ok[/]" if report.get("ok") else "[bold red]failed[/]")
