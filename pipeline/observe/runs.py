"""The runs read back from traces, and one definition of what a run's records say.

:class:`Run` is one start, one rank, one launch: its status, failure, decisions, its state timelines (which state
ran, was skipped, failed or never ended: :func:`timeline`) and its verification failure
(:func:`pipeline.runtime.runner.verification_failure`); :class:`Trace` is every run read and what could not be (:class:`SkippedLine`,
:func:`nothing_readable`). ``attn-setup run``'s report (from the records it just wrote) and ``inspect``, ``graph``
and Perfetto (from a trace file) read them here, so they cannot disagree.

The machines, their terminal states and the ``step_skipped`` ``what`` that marks a whole state as skipped
come from the step tables (:data:`pipeline.setup.table.SETUP`, :data:`pipeline.runtime.table.RUNNER`), not
from a list spelled here. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import DeviceFacts, ErrorInfo
from pipeline.core.errors import UsageError
from pipeline.core.steps import StepTable


@functools.lru_cache(maxsize=None)
def machines() -> dict[str, StepTable]:
    """``{"setup": SETUP, "runner": RUNNER}`` (imported on first use: reading a trace needs them, ``plan`` does not)."""
    from pipeline.runtime.table import RUNNER
    from pipeline.setup.table import SETUP

    return {SETUP.machine: SETUP, RUNNER.machine: RUNNER}


@functools.lru_cache(maxsize=None)
def step_skips() -> frozenset[str]:
    """``step_skipped`` ``what`` values that mean a whole state did no work (npu-lazy-mem, capture-cuda-graphs), from
    the tables; other step_skipped records (cuda_graph in resolve, rank_agreement) are decisions inside a state
    that ran."""
    return frozenset(s.skip for t in machines().values() for s in t.steps if s.skip)

_NS_LIMIT = 1 << 62


def ms_to_ns(ms: float) -> int:
    """Milliseconds → integer ns, saturating: NaN → 0, ±inf and absurd values clamp to ±2**62 ns.

    Recorded durations come from files that may hold anything (``1e308``, ``"NaN"``); a timeline
    must still be drawable from them.
    """
    if ms != ms:
        return 0
    ns = ms * 1e6
    return int(max(-_NS_LIMIT, min(_NS_LIMIT, ns))) if math.isfinite(ns) else (_NS_LIMIT if ns > 0 else -_NS_LIMIT)


def s_to_ns(sec: float) -> int:
    """Seconds → integer ns, saturating like :func:`ms_to_ns`."""
    return ms_to_ns(sec * 1e3) if sec == sec else 0


def timeline(records: Sequence[ev.Event], machine: str, first: Optional[ev.Event] = None,
             failed: bool = False) -> list[dict[str, Any]]:
    """``[{state, start_ns, duration_ms, outcome}]``: one row per state of ``machine`` (``setup``/``runner``)
    entered, in order, from its transition records after ``first`` (default: the first record).

    ``outcome``: ok · skipped (the state's own step was skipped: :func:`step_skips`) · failed (left by ``fail``,
    or the last state of a run that ``failed`` without reaching a terminal state) · incomplete (the state the run
    was last seen in, when it never ended). A state began ``duration_ms`` before it was left (its own clock, which
    also covers work done before the first record was written). Empty without records.
    """
    if not records:
        return []
    table = machines()[machine]
    first = records[0] if first is None else first
    skipped = {r.state for r in records if isinstance(r, ev.StepSkipped) and r.what in step_skips()}
    start, cur = first.ts_ns, first.state
    rows: list[dict[str, Any]] = []
    for t in records:
        if type(t) is not table.event:
            continue
        outcome = "failed" if t.to == table.failed else ("skipped" if t.from_state in skipped else "ok")
        rows.append({"state": t.from_state, "start_ns": min(start, t.ts_ns - ms_to_ns(t.duration_ms)),
                     "duration_ms": t.duration_ms, "outcome": outcome})
        start, cur = t.ts_ns, t.to
    if cur in table.terminal:
        rows.append({"state": cur, "start_ns": start, "duration_ms": 0.0,
                     "outcome": "ok" if cur == table.success else "failed"})
    else:
        rows.append({"state": cur, "start_ns": start, "duration_ms": max(0, records[-1].ts_ns - start) / 1e6,
                     "outcome": "failed" if failed else "incomplete"})
    return rows


def outcomes(records: Sequence[ev.Event], machine: str) -> list[dict[str, Any]]:
    """``[{state, outcome, duration_ms}]`` of the states ``machine`` left or ended in (run's report: ``states``,
    ``runner_states``): :func:`timeline`'s rows without the start and without a state never left; durations
    rounded to µs."""
    table = machines()[machine]
    if not any(type(r) is table.event for r in records):
        return []
    rows = timeline(records, machine)
    if rows[-1]["state"] not in table.terminal:
        rows = rows[:-1]
    return [{"state": r["state"], "outcome": r["outcome"], "duration_ms": round(r["duration_ms"], 3)} for r in rows]


def device_view(facts: DeviceFacts, spelled_as: Optional[str] = None, **extra: Any) -> dict[str, Any]:
    """The device as every command's JSON shows it (``run``, ``plan``, ``inspect``): the
    :class:`~pipeline.core.contracts.DeviceFacts` fields (``type``, ``index``, ``name`` …), ``arch`` (``sm90``,
    None without a compute capability), ``spelled_as`` (the device as the user wrote it, when that differs) and
    ``extra`` (``blas_init`` where device-init ran)."""
    return {**msgspec.to_builtins(facts), "arch": facts.arch, "spelled_as": spelled_as, **extra}


def device_from(records: Iterable[ev.Event]) -> Optional[dict[str, Any]]:
    """:func:`device_view` of a run's ``device_initialized`` record (None when device-init did not run)."""
    d = next((r for r in records if isinstance(r, ev.DeviceInitialized)), None)
    return None if d is None else device_view(d.facts, d.spelled_as, blas_init=d.blas_init)


def device_text(d: dict[str, Any]) -> str:
    """A :func:`device_view` in one line, as ``run`` and ``inspect`` both print it after ``device:``:
    ``cuda:0 NVIDIA H200 (sm90), written as CUDA:0`` (``cpu x86_64`` on a CPU: one device, no index)."""
    where = d["type"] if d["type"] == "cpu" else f"{d['type']}:{d['index']}"
    text = f"{where} {d.get('name') or ''}".rstrip() + (f" ({d['arch']})" if d.get("arch") else "")
    return text + (f", written as {d['spelled_as']}" if d.get("spelled_as") else "")


_BY_CLASS = frozenset(c for c in ev.EVENT_TYPES if not c.__subclasses__())  # exact types: indexable


@dataclass
class SkippedLine:
    """One line that was not read: file, 1-based line number and why."""

    path: str
    line: int
    reason: str


@dataclass
class Run:
    """The records of one start, one rank, one launch: ``(run_id, rank, launch_id)``, ordered by time.

    ``status`` is ``ok`` only when the run wrote its terminal success record and nothing failed,
    ``failed`` (a ``run_failed``/``run_interrupted`` record, a failed verification, a command
    that exited non-zero) or ``incomplete`` (no terminal record: the process died without a last
    word); :attr:`last_state` is the state it was last seen in. See :attr:`status` for which
    record ends which kind of run.
    """

    run_id: str
    rank: int
    records: list[ev.Event] = field(default_factory=list)
    launch_id: str = ""
    started_at: Optional[tuple[str, int]] = None  # (file, line) of its run_started record, when read from a file
    _index: dict[type, list[Any]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _indexed: Optional[tuple[int, int, int]] = field(default=None, init=False, repr=False, compare=False)
    _memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def _by_type(self) -> dict[type, list[Any]]:
        """Records grouped by exact type, in order (rebuilt, with the memo, when ``records`` changed)."""
        recs = self.records
        key = (id(recs), len(recs), id(recs[-1]) if recs else 0)
        if self._indexed != key:
            index: dict[type, list[Any]] = {}
            for r in recs:
                index.setdefault(type(r), []).append(r)
            self._index, self._indexed, self._memo = index, key, {}
        return self._index

    def _memoized(self, name: str, compute: Callable[[], Any]) -> Any:
        self._by_type()
        if name not in self._memo:
            self._memo[name] = compute()
        return self._memo[name]

    def first(self, cls: type) -> Any:
        if cls in _BY_CLASS:
            found = self._by_type().get(cls)
            return found[0] if found else None
        return next((r for r in self.records if isinstance(r, cls)), None)

    def all(self, cls: type) -> list[Any]:
        if cls in _BY_CLASS:
            return list(self._by_type().get(cls, ()))
        return [r for r in self.records if isinstance(r, cls)]

    @property
    def started(self) -> Optional[ev.RunStarted]:
        return self.first(ev.RunStarted)

    @property
    def last_state(self) -> str:
        """The state the run was last seen in: the target of its latest transition (setup or runner)."""
        return self._memoized("last_state", self._last_state)

    def _last_state(self) -> str:
        moves = [m for m in (self.all(ev.StateTransition)[-1:] + self.all(ev.RunnerTransition)[-1:])]
        if moves:
            return max(moves, key=lambda m: (m.ts_ns, self.records.index(m))).to
        return self.records[0].state if self.records else "device-init"

    @property
    def failure(self) -> Optional[ErrorInfo]:
        """The ErrorInfo of the failure: the earliest run_failed / run_interrupted record (the cause;
        a SIGINT writes run_interrupted and then the unwinding's run_failed), else a failed
        verification, else a ``command_finished`` with a non-zero exit code."""
        return self._memoized("failure", self._failure)

    def _failure(self) -> Optional[ErrorInfo]:
        ends = [r for r in (self.first(ev.RunFailed), self.first(ev.RunInterrupted)) if r is not None]
        if ends:
            return min(ends, key=lambda r: (r.ts_ns, self.records.index(r))).error
        from pipeline.runtime.runner import verification_failure

        verification = verification_failure(self.records)
        if verification is not None:
            return verification
        fin = self.first(ev.CommandFinished)
        if fin is not None and fin.exit_code != 0:
            return ErrorInfo(code="command_failed", state=self.last_state,
                             message=f"'attn-setup {fin.command}' exited with code {fin.exit_code}",
                             remedy="rerun the command and read its error output")
        return None

    @property
    def status(self) -> str:
        """failed · ok · incomplete, from the records that end each kind of run.

        - a command-line launch (``command_started``): ok only with ``command_finished`` exit 0 —
          ``attn-setup run`` verifies after the runner is ready, so ``ready`` alone is not the end;
        - a runner's trace (``runner_started``): ok once the runner reached ``ready``;
        - a setup-machine trace: ok once it wrote ``run_finished`` (reached ``done``).

        Any failure (see :attr:`failure`) makes it ``failed``; without the terminal record it is
        ``incomplete``.
        """
        return self._memoized("status", self._status)

    def _status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.first(ev.CommandStarted) is not None:
            return "ok" if self.first(ev.CommandFinished) is not None else "incomplete"
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
        device = device_from(self.records)
        if device is not None:
            out["device"] = device
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
        first = self.started or next((r for r in self.records if not isinstance(r, ev.CommandStarted)),
                                     self.records[0])
        return timeline(self.records, "setup", first, self.status == "failed")

    def runner_states(self) -> list[dict[str, Any]]:
        """The same rows for the runner's outer machine (``attn-setup run``; empty for a bare setup run).

        The ``attention`` row spans the whole setup machine (:meth:`states`).
        """
        first = self.first(ev.RunnerStarted)
        if first is None:
            return []
        return timeline(self.records, "runner", first, self.status == "failed")


@dataclass
class Trace:
    """Every run read from one or more trace files, and what could not be read."""

    runs: list[Run]
    skipped: list[SkippedLine] = field(default_factory=list)
    dropped_fields: int = 0
    unreadable_files: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    skipped_count: int = 0

    @property
    def skipped_lines(self) -> int:
        """How many lines were skipped (``skipped`` lists the first :data:`SKIP_DETAILS` of them)."""
        return max(self.skipped_count, len(self.skipped))

    def run(self, run_id: Optional[str] = None, rank: Optional[int] = None) -> Run:
        """The one run matching ``run_id``/``rank`` (the first when not given); raises UsageError."""
        for r in self.runs:
            if (run_id is None or r.run_id == run_id) and (rank is None or r.rank == rank):
                return r
        asked = " and ".join([f"run id {run_id!r}"] * (run_id is not None) + [f"rank {rank}"] * (rank is not None))
        raise UsageError(f"no run with {asked or 'any run id'} in {', '.join(map(str, self.paths))}",
                         code="run_not_found",
                         flags=[(k, v) for k, v in (("run_id", run_id), ("rank", rank)) if v is not None],
                         allowed=[f"{r.run_id}/rank{r.rank}" for r in self.runs],
                         remedy="pick a run_id/rank listed by 'attn-setup inspect'")

    def require_records(self) -> "Trace":
        """Self, or UsageError (exit 2, ``trace_unreadable``) when no record could be read at all."""
        if not self.runs:
            raise nothing_readable(self)
        return self


def nothing_readable(t: Any) -> UsageError:
    """The ``trace_unreadable`` error (exit 2) for a trace (or reader) with no readable record."""
    why = [f"{p}: unreadable" for p in t.unreadable_files]
    why += [f"{s.path}:{s.line}: {s.reason}" for s in t.skipped[:5]]
    return UsageError("no readable trace record in " + ", ".join(t.paths or ["(no file)"])
                      + (" (" + "; ".join(why) + ")" if why else " (empty)"),
                      code="trace_unreadable", flags=[("LOG", list(t.paths))],
                      remedy="pass the JSON-lines file written by 'attn-setup run --log-file'")

