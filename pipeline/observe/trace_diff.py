"""``attn-setup inspect --diff A.jsonl B.jsonl``: what changed between two starts, per rank.

Details: docs/internals.md, ``pipeline.observe.trace_diff``.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core.value_text import value_text
from pipeline.observe.ranks import _flatten
from pipeline.observe.trace import read_trace
from pipeline.observe.runs import Run

_VOLATILE = ("free", "memory_allocated")  # device facts that change between starts on one machine


def _last_per_rank(path: str) -> tuple[dict[int, Run], dict[int, int]]:
    """Each rank's last start in ``path`` (time order: the last launch wins) and how many starts the rank has there
    (a log appended to by several runs holds several)."""
    out: dict[int, Run] = {}
    count: dict[int, int] = {}
    for run in read_trace(path).runs:
        out[run.rank] = run
        count[run.rank] = count.get(run.rank, 0) + 1
    return out, count


def _durations(run: Run) -> dict[tuple[str, str], float]:
    d: dict[tuple[str, str], float] = {}
    for machine, rows in (("runner", run.runner_states()), ("setup", run.states())):
        for row in rows:
            key = (machine, row["state"])
            d[key] = d.get(key, 0.0) + float(row["duration_ms"])
    return d


def _phases(run: Run) -> dict[tuple[str, str], float]:
    s = run.all(ev.StartupSummary)
    return {} if not s else {(p.parent, p.name): p.seconds for p in s[-1].phases}


def decisions(run: Run) -> dict[str, Any]:
    """The run's decisions flattened to ``{"plan.mode": "tbo", …}`` plus ``graph_batch_sizes``."""
    d = run.decisions()
    ready = run.first(ev.RunnerReady)
    d["graph_batch_sizes"] = list(ready.graph_batch_sizes) if ready is not None else None
    d["args"] = run.started.request.get("args", {}) if run.started is not None else {}  # the flags asked for
    flat = _flatten(d)
    return {k: v for k, v in flat.items() if not (k.startswith("device.") and any(x in k for x in _VOLATILE))}


def _enc(v: Any) -> bytes:
    return msgspec.json.encode(v)


def diff_runs(a: Run, b: Run) -> dict[str, Any]:
    """One rank's differences (see docs/internals.md, ``pipeline.observe.trace_diff``); deltas are B − A."""
    da, db = _durations(a), _durations(b)
    states = [{"machine": m, "state": s, "a_ms": da.get((m, s)), "b_ms": db.get((m, s)),
               "delta_ms": None if (m, s) not in da or (m, s) not in db else round(db[(m, s)] - da[(m, s)], 3)}
              for (m, s) in list(da) + [k for k in db if k not in da]]
    pa, pb = _phases(a), _phases(b)
    phases = [{"parent": p, "phase": n, "a_s": pa.get((p, n)), "b_s": pb.get((p, n)),
               "delta_s": None if (p, n) not in pa or (p, n) not in pb else round(pb[(p, n)] - pa[(p, n)], 6)}
              for (p, n) in list(pa) + [k for k in pb if k not in pa]]
    fa, fb = decisions(a), decisions(b)
    changed = [{"key": k, "a": fa.get(k), "b": fb.get(k)} for k in list(fa) + [k for k in fb if k not in fa]
               if _enc(fa.get(k)) != _enc(fb.get(k))]
    changed.sort(key=lambda c: not c["key"].startswith("args."))  # the inputs asked for first: the likely cause
    return {"rank": a.rank, "run_a": a.run_id, "run_b": b.run_id, "status_a": a.status, "status_b": b.status,
            "failure_a": _failure(a), "failure_b": _failure(b), "states": states, "phases": phases,
            "decisions": changed}


def _failure(run: Run) -> Optional[dict[str, Any]]:
    return None if run.failure is None else msgspec.to_builtins(run.failure)


def diff_logs(path_a: str, path_b: str) -> dict[str, Any]:
    """``{a, b, ok, ranks: [diff_runs …], only_in_a, only_in_b}`` for two trace files (one start each, per rank);
    ``ok``: every start compared or listed (each rank's last in either file) started — ``inspect``'s exit 0."""
    (ra, na), (rb, nb) = _last_per_rank(path_a), _last_per_rank(path_b)
    ranks = [{**diff_runs(ra[k], rb[k]), "starts_a": na[k], "starts_b": nb[k]} for k in sorted(set(ra) & set(rb))]
    return {"a": path_a, "b": path_b, "ok": all(r.ok for r in [*ra.values(), *rb.values()]), "ranks": ranks,
            "only_in_a": sorted(set(ra) - set(rb)), "only_in_b": sorted(set(rb) - set(ra))}


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def diff_lines(d: dict[str, Any], safe: Any = str) -> list[str]:
    """Plain-text lines of :func:`diff_logs` (strings from the logs passed through ``safe``)."""
    lines = [safe(f"diff A={d['a']} B={d['b']} (delta = B - A)")]
    for r in d["ranks"]:
        lines.append(safe(f"rank {r['rank']}: A run {r['run_a']} ({r['status_a']}), B run {r['run_b']} "
                          f"({r['status_b']})"))
        for side in ("a", "b"):
            n = r.get(f"starts_{side}", 1)
            if n > 1:
                lines.append(safe(f"  {side.upper()} holds {n} starts of rank {r['rank']} (appended runs): comparing "
                                  f"the last, run {r['run_' + side]}; split the log to compare another"))
        inputs = [c for c in r["decisions"] if c["key"].startswith("args.")]
        for c in inputs:  # the cause first: what was asked differently, then how a failed side ended
            lines.append(safe(f"  changed input {c['key']}: {value_text(c['a'])} -> {value_text(c['b'])}"))
        for side in ("b", "a"):
            f = r.get(f"failure_{side}")
            if f is not None:
                lines.append(safe(f"  {side.upper()} failed in state {f['state']!r}: [{f['code']}] {f['message']}"))
                if f.get("remedy"):
                    lines.append(safe(f"    remedy: {f['remedy']}"))
        w = max([5] + [len(s["state"]) + 9 for s in r["states"]])
        lines.append(f"  {'state':<{w}}  {'A ms':>10}  {'B ms':>10}  {'delta ms':>10}")
        for s in r["states"]:
            label = safe(f"{s['machine']}:{s['state']}")
            lines.append(f"  {label:<{w}}  {_num(s['a_ms'], '.1f'):>10}  {_num(s['b_ms'], '.1f'):>10}  "
                         f"{_num(s['delta_ms'], '+.1f'):>10}")
        moved = [p for p in r["phases"] if p["delta_s"] is None or abs(p["delta_s"]) >= 0.001]
        for p in moved:
            name = f"{p['parent']}/{p['phase']}" if p["parent"] else p["phase"]
            if p["a_s"] is None or p["b_s"] is None:
                lines.append(safe(f"  phase {name}: only in {'B' if p['a_s'] is None else 'A'} "
                                  f"({_num(p['b_s'] if p['a_s'] is None else p['a_s'], '.3f')} s)"))
            else:
                lines.append(safe(f"  phase {name}: {p['a_s']:.3f} s -> {p['b_s']:.3f} s ({p['delta_s']:+.3f} s)"))
        for c in r["decisions"][len(inputs):]:
            lines.append(safe(f"  changed {c['key']}: {value_text(c['a'])} -> {value_text(c['b'])}"))
        if not r["decisions"]:
            lines.append("  no decision changed")
    for side, key in (("A", "only_in_a"), ("B", "only_in_b")):
        if d[key]:
            lines.append(f"only in {side}: rank(s) {', '.join(map(str, d[key]))}")
    return lines
