"""Where the ranks of one launch decided differently (``attn-setup inspect``'s ``rank_differences``).

Each rank's :meth:`~pipeline.observe.trace.Run.decisions` (and its request's attention args) are flattened to
``{"a.b.c": leaf}`` and compared key by key; the keys each rank owns (:data:`RANK_LOCAL`) are left out.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from pipeline.observe.trace import Run, Trace

__all__ = ["RANK_LOCAL", "RankDifferences", "rank_differences"]

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
        # compare; counting it would list every field as differing (adversarial pass #5: 16 such lines)
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
