"""Reading traces back: JSON-lines event logs → typed records, grouped into runs by (run_id, rank, launch).

The reader is tolerant: a line that is not JSON (a crash mid-write, a truncated copy), nests too
deeply, is longer than :data:`MAX_LINE_BYTES`, or is not a known valid record is counted (with its
reason: ``not_json``, ``too_deep``, ``line_too_long``, ``unknown_event``, ``newer_schema``,
``invalid_record``) and skipped; everything else is kept. Several files merge: records are grouped
by ``(run_id, rank, launch_id)`` — two launches that share a run id and a log file stay two runs —
ordered by ``ts_ns``, and a line read twice (a file passed twice, overlapping copies) counts once.

Only regular files are read: a FIFO, a device or a directory is refused (``UsageError``
``not_a_regular_file``, exit 2) instead of blocking or reading forever.

Streaming (:class:`TraceReader`): the first pass reads only each line's envelope (run id, rank,
launch id, time) and remembers, per run, the byte ranges its lines occupy (one range per
contiguous piece); the second pass reads one run at a time from those ranges, yields it and lets
it go. Memory is therefore bounded by the index (a few dozen bytes per contiguous piece of a run)
plus the largest single run, not by the file — ``attn-setup inspect`` on a 1 GB log stays within a
few hundred MB (``benchmarks/inspect_large_log.py``). :func:`read_trace` keeps every run (for
replay, graph and tests).

Schema policy for old traces
----------------------------
``schema_version`` (see :mod:`pipeline.core.events`) rises only when a field is removed or changes
meaning; adding a field with a default keeps the version. Therefore:

- a record with ``1 <= schema_version <= SCHEMA_VERSION`` is read; versions below the current one
  pass through :data:`UPGRADERS` (``{old_version: fn(dict) -> dict}``, applied in order) first;
  ``schema_version <= 0`` (never written by any version) is ``invalid_record``;
- a record with a *newer* version is skipped and counted (``reason="newer_schema"``): this reader
  cannot know what its fields mean;
- a record of the current version carrying fields this reader does not know (written by a newer
  attn-setup that added fields) is read with those fields dropped, counted in
  :attr:`Trace.dropped_fields`;
- an unknown ``event`` tag (or one that is not a string) is skipped and counted (``reason="unknown_event"``).

Nothing here imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterator, Optional, Sequence, Union

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import SCHEMA_VERSION, ErrorInfo
from pipeline.core.errors import UsageError
from pipeline.observe.runview import timeline, verification_failure

UPGRADERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_BY_TAG = {ev.event_name(c): c for c in ev.EVENT_TYPES}
_BY_CLASS = frozenset(c for c in ev.EVENT_TYPES if not c.__subclasses__())  # exact types: indexable
MAX_LINE_BYTES = 4 << 20   # a run_started line of a 4096-layer model with a draft model is ~0.2 MB
MAX_DEPTH = ev.MAX_DEPTH   # our records nest 6 deep; the writer never writes deeper than this
SKIP_DETAILS = 100         # skipped lines listed with file:line (all are counted)


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


def _depth(obj: Any) -> int:
    """Nesting depth of decoded JSON (iterative: a hostile line must not exhaust the stack)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def _may_be_deep(line: bytes) -> bool:
    return line.count(b"[") + line.count(b"{") > MAX_DEPTH


def decode_record(line: bytes) -> tuple[Optional[ev.Event], str, int]:
    """(record or None, skip reason or "", number of unknown fields dropped) for one line.

    Never raises for any input: every failure is a skip reason (see the module docstring).
    """
    if len(line) > MAX_LINE_BYTES:
        return None, "line_too_long", 0
    if not _may_be_deep(line):
        try:  # the fast path: a current record as written
            rec = ev._decoder.decode(line)
            if rec.schema_version == SCHEMA_VERSION:
                return rec, "", 0
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None, "not_json", 0
    except RecursionError:
        return None, "too_deep", 0
    if not isinstance(obj, dict) or type(obj.get("event")) is not str or obj["event"] not in _BY_TAG:
        return None, "unknown_event", 0
    if _depth(obj) > MAX_DEPTH:
        return None, "too_deep", 0
    version = obj.get("schema_version", 1)
    if type(version) is not int:
        return None, "invalid_record", 0
    if version > SCHEMA_VERSION:
        return None, "newer_schema", 0
    if version < 1:
        return None, "invalid_record", 0
    try:
        obj = ev.restore_floats(_upgrade(obj))
        try:
            return msgspec.convert(obj, ev.AnyEvent), "", 0
        except msgspec.ValidationError:
            cls = _BY_TAG[obj["event"]]
            known = set(cls.__struct_encode_fields__) | {"event"}
            kept = {k: v for k, v in obj.items() if k in known}
            if len(kept) == len(obj):
                return None, "invalid_record", 0
            try:
                return msgspec.convert(kept, ev.AnyEvent), "", len(obj) - len(kept)
            except msgspec.ValidationError:
                return None, "invalid_record", 0
    except RecursionError:
        return None, "too_deep", 0
    except Exception:  # noqa: BLE001 - an upgrader choking on a hostile record: skip it, never crash
        return None, "invalid_record", 0


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


_BLOCK = 1 << 20


def _ts(r: ev.Event) -> int:
    return r.ts_ns


class _Envelope(msgspec.Struct):
    """What the first pass reads of a line (other fields are skipped unparsed)."""

    event: str
    ts_ns: int
    run_id: str
    rank: int = 0
    launch_id: str = ""


_envelope = msgspec.json.Decoder(_Envelope)


class _Entry:
    """Pass-1 index of one run: its first time and its pieces ``[file, start, end, first line]``."""

    __slots__ = ("first_ts", "pieces")

    def __init__(self, ts: int) -> None:
        self.first_ts = ts
        self.pieces: list[int] = []  # flat: file index, start offset, end offset, first line number, ...


class TraceReader:
    """Stream the runs of one or more trace files (see the module docstring): :meth:`runs` yields
    each :class:`Run` complete and in order, holding one run at a time.

    After (or during) iteration: :attr:`skipped` (the first :data:`SKIP_DETAILS` skipped lines, in
    file order), :attr:`skipped_lines` (all of them), :attr:`dropped_fields`,
    :attr:`unreadable_files` (missing or unreadable paths). Raises :class:`UsageError`
    ``not_a_regular_file`` (exit 2, naming ``LOG``) for a FIFO, device or directory.
    """

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> None:
        self.paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        self.skipped: list[SkippedLine] = []
        self.skipped_lines = 0
        self.dropped_fields = 0
        self.unreadable_files: list[str] = []
        self._files: dict[int, IO[bytes]] = {}
        self._index: Optional[dict[tuple[str, int, str], _Entry]] = None

    def _skip(self, fi: int, line: int, reason: str) -> None:
        self.skipped_lines += 1
        self.skipped.append(SkippedLine(self.paths[fi], line, reason))
        if len(self.skipped) > 2 * SKIP_DETAILS:
            self._trim_skipped()

    def _trim_skipped(self) -> None:
        order = {p: i for i, p in enumerate(self.paths)}
        self.skipped.sort(key=lambda s: (order.get(s.path, 0), s.line))
        del self.skipped[SKIP_DETAILS:]

    def _open(self, fi: int) -> Optional[IO[bytes]]:
        from pipeline.core.files import open_regular

        if fi not in self._files:
            try:
                self._files[fi] = open_regular(self.paths[fi], "rb", flag="LOG", what="the trace")
            except UsageError as e:
                if e.info.code != "file_unreadable":
                    raise
                self.unreadable_files.append(self.paths[fi])
                return None
        return self._files[fi]

    def _lines(self, fh: IO[bytes], start: int, end: Optional[int]) -> Iterator[tuple[int, bytes]]:
        """(offset, line) from ``start`` up to ``end``; lines over :data:`MAX_LINE_BYTES` come back as
        ``b""`` after the rest of them was read past (never held whole)."""
        fh.seek(start)
        offset = start
        while end is None or offset < end:
            raw = fh.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            at = offset
            offset += len(raw)
            if len(raw) > MAX_LINE_BYTES:
                while not raw.endswith(b"\n"):
                    raw = fh.readline(1 << 20)
                    if not raw:
                        break
                    offset += len(raw)
                yield at, b""
                continue
            yield at, raw

    def scan(self) -> "TraceReader":
        """Pass 1 (once): the index of runs. Returns self."""
        if self._index is not None:
            return self
        index: dict[tuple[str, int, str], _Entry] = {}
        for fi in range(len(self.paths)):
            fh = self._open(fi)
            if fh is None:
                continue
            n = 0
            try:
                for at, raw in self._lines(fh, 0, None):
                    n += 1
                    if not raw:
                        self._skip(fi, n, "line_too_long")
                        continue
                    line = raw.strip()
                    if not line:
                        continue
                    try:
                        env = _envelope.decode(line)
                    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                        self._skip(fi, n, decode_record(line)[1] or "invalid_record")
                        continue
                    key = (env.run_id, env.rank, env.launch_id)
                    e = index.get(key)
                    if e is None:
                        e = index[key] = _Entry(env.ts_ns)
                    elif env.ts_ns < e.first_ts:
                        e.first_ts = env.ts_ns
                    p = e.pieces
                    if p and p[-4] == fi and p[-2] == at:  # continues the run's last piece
                        p[-2] = at + len(raw)
                    else:
                        p += (fi, at, at + len(raw), n)
            except OSError:
                self.unreadable_files.append(self.paths[fi])
        self._index = index
        return self

    @property
    def empty(self) -> bool:
        """No line of any file had a record's envelope (call after :meth:`scan`)."""
        return not self.scan()._index

    def _order(self) -> list[tuple[tuple[str, int, str], _Entry]]:
        first: dict[str, int] = {}
        for (run_id, _, _), e in self._index.items():
            first[run_id] = min(first.get(run_id, e.first_ts), e.first_ts)
        # launches in time order; the ranks of one run id in rank order, a rank's launches by time
        return sorted(self._index.items(), key=lambda kv: (first[kv[0][0]], kv[0][0], kv[0][1], kv[1].first_ts,
                                                            kv[0][2]))

    def _piece_lines(self, fh: IO[bytes], start: int, end: int) -> Iterator[bytes]:
        """The lines of one piece, read in blocks (a piece holds only lines pass 1 kept: each at most
        :data:`MAX_LINE_BYTES`, newline-terminated except possibly the file's last)."""
        fh.seek(start)
        left = end - start
        while left > 0:
            block = fh.read(min(left, _BLOCK))
            if not block:
                return  # the file shrank since pass 1
            left -= len(block)
            if left > 0:
                cut = block.rfind(b"\n") + 1
                if 0 < cut < len(block):  # keep the partial last line for the next block
                    fh.seek(cut - len(block), os.SEEK_CUR)
                    left += len(block) - cut
                    block = block[:cut]
            lines = block.split(b"\n")  # \n only, as pass 1 counted them
            if lines and not lines[-1]:
                lines.pop()
            yield from lines

    def _read_run(self, key: tuple[str, int, str], e: _Entry) -> Optional[Run]:
        run = Run(key[0], key[1], launch_id=key[2])
        records = run.records
        seen: set[bytes] = set()
        p = e.pieces
        for i in range(0, len(p), 4):
            fi, start, end, n = p[i:i + 4]
            fh = self._open(fi)
            if fh is None:
                continue
            try:
                for k, raw in enumerate(self._piece_lines(fh, start, end)):
                    line = raw.strip()
                    if not line:
                        continue
                    rec, reason, dropped = decode_record(line)
                    if rec is None:
                        self._skip(fi, n + k, reason)
                        continue
                    if line in seen:
                        continue
                    seen.add(line)
                    if dropped:
                        self.dropped_fields += dropped
                    records.append(rec)
                    if run.started_at is None and type(rec) is ev.RunStarted:
                        run.started_at = (self.paths[fi], n + k)
            except OSError:
                if self.paths[fi] not in self.unreadable_files:
                    self.unreadable_files.append(self.paths[fi])
        if not records:
            return None
        records.sort(key=_ts)  # pieces of one trace may come in any file order
        return run

    def runs(self) -> Iterator[Run]:
        """Pass 2: every run with at least one valid record, in order (see :meth:`_order`)."""
        self.scan()
        try:
            for key, e in self._order():
                run = self._read_run(key, e)
                if run is not None:
                    yield run
        finally:
            self._trim_skipped()
            self.close()

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def read_trace(paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> Trace:
    """Read one or more JSON-lines traces (tolerant; see the module docstring), every run kept.

    Never raises for bad content: missing or unreadable files go to ``unreadable_files``, bad lines
    to ``skipped``. Call :meth:`Trace.require_records` to insist on at least one record. Raises
    :class:`UsageError` (``not_a_regular_file``, exit 2) for a path that is not a regular file.
    """
    reader = TraceReader(paths)
    runs = list(reader.runs())
    return Trace(runs=runs, skipped=reader.skipped, dropped_fields=reader.dropped_fields,
                 unreadable_files=reader.unreadable_files, paths=reader.paths, skipped_count=reader.skipped_lines)


def as_trace(obj: Any) -> Trace:
    """A Trace from a path, a list of paths, a Trace, a Run or a list of records."""
    if isinstance(obj, Trace):
        return obj
    if isinstance(obj, Run):
        return Trace(runs=[obj])
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], ev.Event):
        groups: dict[tuple[str, int, str], Run] = {}
        for r in obj:
            groups.setdefault((r.run_id, r.rank, r.launch_id), Run(r.run_id, r.rank, launch_id=r.launch_id)).records.append(r)
        return Trace(runs=list(groups.values()))
    return read_trace(obj)
