"""Reading traces back: JSON-lines event logs → typed records, grouped into runs by (run_id, rank).

The reader is tolerant: a line that is not JSON (a crash mid-write, a truncated copy) or not a
known record is counted in :attr:`Trace.skipped_lines` with its reason and skipped; everything else
is kept. Several files merge: records are grouped by ``(run_id, rank)`` and ordered by ``ts_ns``.

Schema policy for old traces
----------------------------
``schema_version`` (see :mod:`pipeline.events`) rises only when a field is removed or changes
meaning; adding a field with a default keeps the version. Therefore:

- a record with ``schema_version <= SCHEMA_VERSION`` is read; versions below the current one pass
  through :data:`UPGRADERS` (``{old_version: fn(dict) -> dict}``, applied in order) first;
- a record with a *newer* version is skipped and counted (``reason="newer_schema"``): this reader
  cannot know what its fields mean;
- a record of the current version carrying fields this reader does not know (written by a newer
  attn-setup that added fields) is read with those fields dropped, counted in
  :attr:`Trace.dropped_fields`;
- an unknown ``event`` tag is skipped and counted (``reason="unknown_event"``).

Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import msgspec

from pipeline import events as ev
from pipeline.contracts import SCHEMA_VERSION, ErrorInfo
from pipeline.errors import UsageError

UPGRADERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_BY_TAG = {ev.event_name(c): c for c in ev.EVENT_TYPES}
# step_skipped ``what`` values that mean a whole state did no work (npu-lazy-mem, capture-cuda-graphs)
STEP_SKIPS = ("npu_lazy_mem", "cuda_graph_capture")
TERMINAL = ("done", "failed")


@dataclass
class SkippedLine:
    """One line that was not read: file, 1-based line number and why."""

    path: str
    line: int
    reason: str


def _upgrade(obj: dict[str, Any]) -> dict[str, Any]:
    for v in sorted(UPGRADERS):
        if obj.get("schema_version", 1) <= v:
            obj = UPGRADERS[v](obj)
            obj["schema_version"] = v + 1
    return obj


def decode_record(line: bytes) -> tuple[Optional[ev.Event], str, int]:
    """(record or None, skip reason or "", number of unknown fields dropped) for one line."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None, "not_json", 0
    if not isinstance(obj, dict) or obj.get("event") not in _BY_TAG:
        return None, "unknown_event", 0
    version = obj.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        return None, "newer_schema", 0
    obj = _upgrade(obj)
    try:
        return msgspec.convert(obj, ev.AnyEvent), "", 0
    except msgspec.ValidationError:
        cls = _BY_TAG[obj["event"]]
        known = set(cls.__struct_encode_fields__) | {"event"}
        kept = {k: v for k, v in obj.items() if k in known}
        try:
            return msgspec.convert(kept, ev.AnyEvent), "", len(obj) - len(kept)
        except msgspec.ValidationError:
            return None, "invalid_record", 0


@dataclass
class Run:
    """The records of one start, one rank: ``(run_id, rank)``, ordered by time.

    ``status`` is ``ok`` (reached ``done``, every verified instance passed), ``failed`` (a
    ``run_failed``/``run_interrupted`` record, or a failed verification) or ``incomplete`` (neither:
    the process died without a last word); :attr:`last_state` is the state it was last seen in.
    """

    run_id: str
    rank: int
    records: list[ev.Event] = field(default_factory=list)

    def first(self, cls: type) -> Any:
        return next((r for r in self.records if isinstance(r, cls)), None)

    def all(self, cls: type) -> list[Any]:
        return [r for r in self.records if isinstance(r, cls)]

    @property
    def started(self) -> Optional[ev.RunStarted]:
        return self.first(ev.RunStarted)

    @property
    def last_state(self) -> str:
        """The state the run was last seen in: the target of its latest transition (setup or runner)."""
        moves = [r for r in self.records if isinstance(r, (ev.StateTransition, ev.RunnerTransition))]
        return moves[-1].to if moves else (self.records[0].state if self.records else "device-init")

    @property
    def failure(self) -> Optional[ErrorInfo]:
        """The ErrorInfo of the failure (run_failed, run_interrupted, or failed verification)."""
        for cls in (ev.RunFailed, ev.RunInterrupted):
            r = self.first(cls)
            if r is not None:
                return r.error
        bad = [r for r in self.all(ev.InstanceVerified) if not r.passed]
        if bad:
            return ErrorInfo(code="verification_failed", state="done",
                             message="instances failed verification against the float64 reference: "
                                     + ", ".join(f"{r.role} ({r.backend}: {r.max_rel_err:.2e} > {r.tol:.0e})"
                                                 for r in bad),
                             remedy="the backend computes wrong attention for this model; report it with the log")
        steps = [r for r in self.all(ev.ModelStepVerified) if not r.passed]
        if steps:
            return ErrorInfo(code="verification_failed", state="ready",
                             message="model steps failed verification against the float64 reference: "
                                     + ", ".join(f"{r.step} ({'graph' if r.graph else 'eager'}: {r.max_rel_err:.2e} > "
                                                 f"{r.tol:.0e})" for r in steps),
                             remedy="the backend computes wrong attention for this model; report it with the log")
        return None

    @property
    def status(self) -> str:
        """failed · ok (the setup machine reached done; for a runner's trace, the runner reached ready) · incomplete."""
        if self.failure is not None:
            return "failed"
        if self.first(ev.RunnerStarted) is not None:
            ready = any(t.to == "ready" for t in self.all(ev.RunnerTransition))
            return "ok" if ready else "incomplete"
        return "ok" if self.first(ev.RunFinished) is not None else "incomplete"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def decisions(self) -> dict[str, Any]:
        """What each state decided, as builtins: device, resolved, settings, plan, lazy_mem, skips, annotated."""
        b = msgspec.to_builtins
        out: dict[str, Any] = {}
        d = self.first(ev.DeviceInitialized)
        if d is not None:
            out["device"] = {**b(d.facts), "blas_init": d.blas_init}
        r = self.first(ev.BackendsResolved)
        if r is not None:
            out["resolved"] = {"prefill": r.prefill, "decode": r.decode, "is_draft_override": r.is_draft_override,
                               "rules": dict(r.rules), "rejected": b(r.rejected)}
            if r.not_attention:
                out["resolved"]["not_attention"] = b(r.not_attention)
        settings = {s.field: {"value": s.value, "source": s.source} for s in self.all(ev.SettingResolved)}
        if settings:
            out["settings"] = settings
        p = self.first(ev.BuildPlanned)
        if p is not None:
            out["plan"] = {"mode": p.mode.value, "hybrid": p.hybrid, "instances": b(p.instances),
                           "workspaces": b(p.workspaces)}
        lazy = self.first(ev.LazyMemInitialized)
        skip = next((s for s in self.all(ev.StepSkipped) if s.what == "npu_lazy_mem"), None)
        if lazy is not None:
            out["lazy_mem"] = {"run": True, "bytes": lazy.bytes, "rank": lazy.rank_arg, "world_size": lazy.world_size}
        elif skip is not None:
            out["lazy_mem"] = {"run": False, "reason": skip.reason}
        out["skips"] = [{"state": s.state, "what": s.what, "reason": s.reason}
                        for s in self.records if isinstance(s, (ev.StepSkipped, ev.FeatureDowngraded))]
        a = self.first(ev.BackendsAnnotated)
        if a is not None:
            out["annotated"] = {"target": a.target, "prefill": a.prefill, "decode": a.decode}
        return out

    def states(self) -> list[dict[str, Any]]:
        """``[{state, start_ns, duration_ms, outcome}]``: one row per setup-machine state entered, in order.

        ``outcome``: ok · skipped (npu-lazy-mem skipped its work) · failed (left by ``fail``) ·
        incomplete (the state the run was last seen in, when it never ended). Empty when the run is
        a runner's that failed before its attention step started the setup machine.
        """
        if not self.records or (self.started is None and self.first(ev.RunnerStarted) is not None):
            return []
        return self._timeline(ev.StateTransition, self.started or self.records[0], TERMINAL)

    def runner_states(self) -> list[dict[str, Any]]:
        """The same rows for the runner's outer machine (``attn-setup run``; empty for a bare setup run).

        The ``attention`` row spans the whole setup machine (:meth:`states`).
        """
        first = self.first(ev.RunnerStarted)
        if first is None:
            return []
        return self._timeline(ev.RunnerTransition, first, ("ready", "failed"))

    def _timeline(self, cls: type, first: ev.Event, terminal: tuple[str, str]) -> list[dict[str, Any]]:
        """Rows from the ``cls`` transitions after ``first``; ``terminal`` = (success state, failed state)."""
        # a state whose own step was skipped (state names of the two machines do not overlap); other
        # step_skipped records (cuda_graph in resolve, rank_agreement) are decisions inside a state that ran
        skipped = {r.state for r in self.all(ev.StepSkipped) if r.what in STEP_SKIPS}
        start, cur = first.ts_ns, first.state
        rows: list[dict[str, Any]] = []
        for t in self.all(cls):
            outcome = "failed" if t.to == "failed" else ("skipped" if t.from_state in skipped else "ok")
            # the state began duration_ms before it was left (its own clock, which also covers setup
            # done before the first record was written)
            begin = min(start, t.ts_ns - int(t.duration_ms * 1e6))
            rows.append({"state": t.from_state, "start_ns": begin, "duration_ms": t.duration_ms, "outcome": outcome})
            start, cur = t.ts_ns, t.to
        if cur in terminal:
            rows.append({"state": cur, "start_ns": start, "duration_ms": 0.0,
                         "outcome": "ok" if cur == terminal[0] else "failed"})
        else:
            end = self.records[-1].ts_ns
            failed = self.status == "failed"
            rows.append({"state": cur, "start_ns": start, "duration_ms": max(0, end - start) / 1e6,
                         "outcome": "failed" if failed else "incomplete"})
        return rows


@dataclass
class Trace:
    """Every run read from one or more trace files, and what could not be read."""

    runs: list[Run]
    skipped: list[SkippedLine] = field(default_factory=list)
    dropped_fields: int = 0
    unreadable_files: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    @property
    def skipped_lines(self) -> int:
        return len(self.skipped)

    def run(self, run_id: Optional[str] = None, rank: Optional[int] = None) -> Run:
        """The one run matching ``run_id``/``rank`` (the first when not given); raises UsageError."""
        for r in self.runs:
            if (run_id is None or r.run_id == run_id) and (rank is None or r.rank == rank):
                return r
        raise UsageError(f"no run with run_id={run_id!r} rank={rank!r} in {', '.join(map(str, self.paths))}",
                         code="run_not_found",
                         flags=[("run_id", run_id), ("rank", rank)],
                         allowed=[f"{r.run_id}/rank{r.rank}" for r in self.runs],
                         remedy="pick a run_id/rank listed by 'attn-setup inspect'")

    def require_records(self) -> "Trace":
        """Self, or UsageError (exit 2, ``trace_unreadable``) when no record could be read at all."""
        if not self.runs:
            why = [f"{p}: unreadable" for p in self.unreadable_files]
            why += [f"{s.path}:{s.line}: {s.reason}" for s in self.skipped[:5]]
            raise UsageError("no readable trace record in " + ", ".join(self.paths or ["(no file)"])
                             + (" (" + "; ".join(why) + ")" if why else " (empty)"),
                             code="trace_unreadable", flags=[("LOG", list(self.paths))],
                             remedy="pass the JSON-lines file written by 'attn-setup run --log-file'")
        return self


# Keys that legitimately differ between the ranks of one launch (each rank owns its GPU).
RANK_LOCAL = ("device.index", "lazy_mem.rank")


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def rank_differences(trace: Trace) -> list[dict[str, Any]]:
    """Where the ranks of one run_id decided differently: ``[{run_id, key, values: {rank: value}}]``.

    Compares the flattened :meth:`Run.decisions` (and the request's attention args) of every rank
    of a run_id; rank-local keys (:data:`RANK_LOCAL`) are ignored.
    """
    out = []
    by_id: dict[str, list[Run]] = {}
    for r in trace.runs:
        by_id.setdefault(r.run_id, []).append(r)
    for run_id, runs in by_id.items():
        if len(runs) < 2:
            continue
        flat = {}
        for r in runs:
            d = r.decisions()
            d["args"] = r.started.request.get("args", {}) if r.started else {}
            flat[r.rank] = _flatten(d)
        keys = sorted(set().union(*flat.values()) - set(RANK_LOCAL))
        for k in keys:
            vals = {rank: f.get(k) for rank, f in flat.items()}
            if len({msgspec.json.encode(v) for v in vals.values()}) > 1:
                out.append({"run_id": run_id, "key": k, "values": vals})
    return out


def _lines(path: str) -> Iterable[bytes]:
    with open(path, "rb") as fh:
        yield from fh


def read_trace(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> Trace:
    """Read one or more JSON-lines traces (tolerant; see the module docstring).

    Never raises for bad content: missing or unreadable files go to ``unreadable_files``, bad lines
    to ``skipped``. Call :meth:`Trace.require_records` to insist on at least one record.
    """
    plist = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
    trace = Trace(runs=[], paths=plist)
    groups: dict[tuple[str, int], Run] = {}
    seen: set[bytes] = set()  # the same line read twice (a file passed twice, overlapping copies) counts once
    for path in plist:
        try:
            for n, raw in enumerate(_lines(path), 1):
                if not raw.strip():
                    continue
                line = raw.strip()
                rec, reason, dropped = decode_record(line)
                if rec is None:
                    trace.skipped.append(SkippedLine(path, n, reason))
                    continue
                if line in seen:
                    continue
                seen.add(line)
                trace.dropped_fields += dropped
                groups.setdefault((rec.run_id, rec.rank), Run(rec.run_id, rec.rank)).records.append(rec)
        except OSError:
            trace.unreadable_files.append(path)
    for r in groups.values():  # pieces of one trace may come in any file order
        r.records.sort(key=lambda x: x.ts_ns)
    first_ts: dict[str, int] = {}
    for r in groups.values():  # launches in time order, the ranks of one launch in rank order
        first_ts[r.run_id] = min(first_ts.get(r.run_id, r.records[0].ts_ns), r.records[0].ts_ns)
    trace.runs = sorted(groups.values(), key=lambda r: (first_ts[r.run_id], r.run_id, r.rank))
    return trace


def as_trace(obj: Any) -> Trace:
    """A Trace from a path, a list of paths, a Trace, a Run or a list of records."""
    if isinstance(obj, Trace):
        return obj
    if isinstance(obj, Run):
        return Trace(runs=[obj])
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], ev.Event):
        groups: dict[tuple[str, int], Run] = {}
        for r in obj:
            groups.setdefault((r.run_id, r.rank), Run(r.run_id, r.rank)).records.append(r)
        return Trace(runs=list(groups.values()))
    return read_trace(obj)
