"""The ranks of one launch read together: where they decided differently (``inspect``'s ``rank_differences``).

Details: docs/internals.md, ``pipeline.observe.ranks``.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.observe.runs import Run, Trace

__all__ = ['RANK_LOCAL', 'RankDifferences', 'rank_differences', 'RankSummary', 'critical_path', 'rank_rows', 'summary_lines']


# Keys that legitimately differ between the ranks of one launch (each rank owns its GPU).
RANK_LOCAL = ("device.index", "lazy_mem.rank")


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": leaf}`` of nested dicts (iterative; nesting is bounded by :data:`MAX_DEPTH` on read)."""
    out: dict[str, Any] = {}
    stack = [(prefix, obj)]
    while stack:
        pre, x = stack.pop()
        if isinstance(x, dict) and x:
            stack.extend((f"{pre}.{k}" if pre else str(k), v) for k, v in reversed(list(x.items())))
        else:
            out[pre] = x
    return out


def _key(v: Any) -> bytes:
    try:
        return msgspec.json.encode(v)
    except Exception:  # noqa: BLE001 - a value msgspec cannot encode still compares by its repr
        return repr(v).encode()


def _flat_decisions(r: Run) -> dict[str, Any]:
    d = r.decisions()
    d["args"] = r.started.request.get("args", {}) if r.started else {}
    return _flatten(d)


def _differences(run_id: str, flat: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if len(flat) < 2:
        return out
    keys = sorted(set().union(*flat.values()) - set(RANK_LOCAL))
    for k in keys:
        vals = {rank: f.get(k) for rank, f in flat.items()}
        if len({_key(v) for v in vals.values()}) > 1:
            out.append({"run_id": run_id, "key": k, "values": vals})
    return out


class RankDifferences:
    """:func:`rank_differences` computed run by run (runs of one run_id arrive together, as
    :class:`TraceReader` yields them); each rank's latest launch is compared."""

    def __init__(self) -> None:
        self.found: list[dict[str, Any]] = []
        self._run_id: Optional[str] = None
        self._runs: dict[int, Run] = {}  # the latest launch of each rank of the current run id

    def add(self, run: Run) -> None:
        if run.run_id != self._run_id:
            self.finish()
            self._run_id = run.run_id
        self._runs[run.rank] = run

    def finish(self) -> list[dict[str, Any]]:
        # a rank that never recorded its request (stopped before run_started: killed, stalled) decided nothing to
        # compare; counting it would list every field as differing (16 such lines)
        runs = {k: r for k, r in self._runs.items() if r.started is not None}
        if self._run_id is not None and len(runs) > 1:  # one rank: nothing to compare, nothing flattened
            self.found += _differences(self._run_id, {k: _flat_decisions(r) for k, r in runs.items()})
        self._run_id, self._runs = None, {}
        return self.found


def rank_differences(trace: Trace) -> list[dict[str, Any]]:
    """Where the ranks of one run_id decided differently: ``[{run_id, key, values: {rank: value}}]``.

    Compares the flattened :meth:`Run.decisions` (and the request's attention args) of every rank
    of a run_id (a rank with several launches: its latest); rank-local keys (:data:`RANK_LOCAL`)
    are ignored.
    """
    by_id: dict[str, dict[int, Run]] = {}
    for r in trace.runs:
        by_id.setdefault(r.run_id, {})[r.rank] = r
    out = []
    for run_id, runs in by_id.items():
        if len(runs) >= 2:
            out += _differences(run_id, {rank: _flat_decisions(r) for rank, r in runs.items()})
    return out


def _states(run: Any, runner: bool) -> list[dict[str, Any]]:
    rows = run.runner_states() if runner else run.states()
    return [r for r in rows if r["state"] != "failed"]  # the terminal pseudo-state takes no time


def critical_path(run_id: str, runs: dict[int, Any]) -> dict[str, Any]:
    """``{run_id, states: [{state, rank, duration_ms}], total_ms}`` over ``runs`` (rank → Run).

    A state's row names the rank that spent longest in it (the lowest rank on a tie); states are
    listed in the order the slowest-starting rank entered them. ``total_ms`` is the sum of the rows."""
    best: dict[str, tuple[float, int]] = {}
    order: list[str] = []
    runner = any(r.runner_states() for r in runs.values())  # one kind of state for every rank
    for rank in sorted(runs):
        for s in _states(runs[rank], runner):
            name, ms = s["state"], float(s["duration_ms"])
            if name not in best:
                order.append(name)
            if name not in best or ms > best[name][0]:
                best[name] = (ms, rank)
    rows = [{"state": n, "rank": best[n][1], "duration_ms": round(best[n][0], 3)} for n in order]
    return {"run_id": run_id, "states": rows, "total_ms": round(sum(r["duration_ms"] for r in rows), 3)}


def rank_rows(run_id: str, runs: dict[int, Any]) -> list[dict[str, Any]]:
    """Per rank: ``{run_id, rank, status, last_state, waited_for: [rank], stalled: [...]}``.

    ``last_state``: the state a failed rank failed in (its error's state), else where it was last seen."""
    out = []
    for rank in sorted(runs):
        run = runs[rank]
        st = run.all(ev.RankStalled)
        reached = run.failure.state if run.status == "failed" and run.failure is not None else run.last_state
        out.append({"run_id": run_id, "rank": rank, "status": run.status, "last_state": reached,
                    "waited_for": sorted({s.stalled_rank for s in st}),
                    "stalled": [{"stalled_rank": s.stalled_rank, "last_state": s.last_state,
                                 "seconds_since_heartbeat": s.seconds_since_heartbeat, "doing": s.doing,
                                 "waiting_at": s.waiting_at, "waited_s": s.waited_s} for s in st]})
    return out


class RankSummary:
    """Collects :func:`rank_rows` and :func:`critical_path` run id by run id (``add`` each run, then ``finish``)."""

    def __init__(self) -> None:
        self.ranks: list[dict[str, Any]] = []
        self.paths: list[dict[str, Any]] = []
        self._run_id: Optional[str] = None
        self._runs: dict[int, Any] = {}

    def add(self, run: Any) -> None:
        if run.run_id != self._run_id:
            self._flush()
            self._run_id = run.run_id
        self._runs[run.rank] = run  # a rank's latest launch wins, as in rank_differences

    def _flush(self) -> None:
        if self._run_id is not None and len(self._runs) > 1:
            self.ranks += rank_rows(self._run_id, self._runs)
            self.paths.append(critical_path(self._run_id, self._runs))
        self._run_id, self._runs = None, {}

    def finish(self) -> "RankSummary":
        self._flush()
        return self


def summary_lines(s: RankSummary) -> list[str]:
    """The text ``inspect`` prints after the runs (nothing for single-rank logs)."""
    lines: list[str] = []
    for p in s.paths:
        rows = [r for r in s.ranks if r["run_id"] == p["run_id"]]
        lines.append(f"ranks of run {p['run_id']}:")
        for r in rows:
            waited = (" · waited for " + "; ".join(
                f"rank {x['stalled_rank']} (last state {x['last_state']!r}"
                + (f", last heard {x['seconds_since_heartbeat']:g} s before" if x["seconds_since_heartbeat"] is not None
                   else "") + (f", doing: {x['doing']}" if x["doing"] else "") + f", at {x['waiting_at']})"
                for x in r["stalled"])) if r["stalled"] else ""
            lines.append(f"  rank {r['rank']}: {r['status']}, last state {r['last_state']}{waited}")
        w = max([len("state")] + [len(x["state"]) for x in p["states"]])
        lines.append(f"critical path of run {p['run_id']} (per state the slowest rank):")
        lines.append(f"  {'state':<{w}}  rank  duration (ms)")
        lines += [f"  {x['state']:<{w}}  {x['rank']:>4}  {x['duration_ms']:>13.2f}" for x in p["states"]]
        lines.append(f"  {'total':<{w}}        {p['total_ms']:>13.2f}")
    return lines

