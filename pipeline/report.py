"""The run/plan report: one JSON object (``--json``) or rich tables, built from the event records."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import msgspec

from pipeline import events as ev
from pipeline.contracts import BuildPlan, ErrorInfo, Resolution


def states_from(records: Iterable[ev.Event]) -> list[dict[str, Any]]:
    """``[{state, outcome, duration_ms}]`` in order, from the transition and skip records."""
    out: list[dict[str, Any]] = []
    skipped = {r.state for r in records if isinstance(r, ev.StepSkipped) and r.what == "npu_lazy_mem"}
    last = None
    for r in records:
        if isinstance(r, ev.StateTransition):
            failed = r.to == "failed"
            outcome = "failed" if failed else ("skipped" if r.from_state in skipped else "ok")
            out.append({"state": r.from_state, "outcome": outcome, "duration_ms": round(r.duration_ms, 3)})
            last = r.to
    if last in ("done", "failed"):
        out.append({"state": last, "outcome": "ok" if last == "done" else "failed", "duration_ms": 0.0})
    return out


def _resolved(prefill: str, decode: str, is_draft_override: bool, rules: Any) -> dict[str, Any]:
    return {"prefill": prefill, "decode": decode, "is_draft_override": is_draft_override, "rules": dict(rules)}


def resolved_obj(res: Optional[Resolution]) -> Optional[dict[str, Any]]:
    """The ``resolved`` object of run/plan JSON, from a Resolution."""
    if res is None:
        return None
    return _resolved(res.pair.prefill, res.pair.decode, res.pair.is_draft_override, res.rules)


def resolved_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """The same object from a run's ``backends_resolved`` record (None if the run never resolved)."""
    e = next((r for r in records if isinstance(r, ev.BackendsResolved)), None)
    return None if e is None else _resolved(e.prefill, e.decode, e.is_draft_override, e.rules)


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
    """States, decisions, skips and verification as rich tables on stdout."""
    from rich.table import Table

    c = _console()
    if report.get("states"):
        c.print(states_table("states", report["states"]))
    res = report.get("resolved")
    if res:
        c.print(f"resolved: prefill={res['prefill']} ({res['rules']['prefill']}), "
                f"decode={res['decode']} ({res['rules']['decode']}), draft override={res['is_draft_override']}")
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
    for s in report.get("skips") or []:
        c.print(f"skipped: {s['what']}: {s['reason']}", markup=False)
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
