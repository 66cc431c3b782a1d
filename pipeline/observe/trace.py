"""Reading traces back: JSON-lines event logs → typed records, grouped into runs by (run_id, rank, launch).

Details: docs/internals.md, ``pipeline.observe.trace``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, IO, Iterator, Optional, Sequence, Union

import msgspec

from pipeline.core import events as ev, wire
from pipeline.core.contracts import SCHEMA_VERSION
from pipeline.core.errors import UsageError
from pipeline.observe.runs import Run, SkippedLine, Trace


UPGRADERS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}
_BY_TAG = {ev.event_name(c): c for c in ev.EVENT_TYPES}
MAX_LINE_BYTES = 4 << 20   # a run_started line of a 4096-layer model with a draft model is ~0.2 MB
MAX_DEPTH = wire.MAX_DEPTH   # our records nest 6 deep; the writer never writes deeper than this


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

    Never raises for any input: every failure is a skip reason (see docs/internals.md, ``pipeline.observe.trace``).
    """
    if len(line) > MAX_LINE_BYTES:
        return None, "line_too_long", 0
    if not _may_be_deep(line):
        try:  # the fast path: a current record as written
            rec = wire._decoder.decode(line)
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
        obj = wire.restore_floats(_upgrade(obj))
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


BLOCK = 1 << 20


def capped_lines(fh: IO[bytes], start: int, end: Optional[int]) -> Iterator[tuple[int, bytes]]:
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


def piece_lines(fh: IO[bytes], start: int, end: int) -> Iterator[bytes]:
    """The lines of one piece, read in blocks (a piece holds only lines pass 1 kept: each at most
    :data:`MAX_LINE_BYTES`, newline-terminated except possibly the file's last)."""
    fh.seek(start)
    left = end - start
    while left > 0:
        block = fh.read(min(left, BLOCK))
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


SKIP_DETAILS = 100         # skipped lines listed with file:line (all are counted)


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
    """Stream the runs of one or more trace files (see docs/internals.md, ``pipeline.observe.trace``): :meth:`runs` yields
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
                for at, raw in capped_lines(fh, 0, None):
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

    def _read_run(self, key: tuple[str, int, str], e: _Entry) -> Optional[Run]:
        run = Run(key[0], key[1], launch_id=key[2])
        by_file: dict[int, list[ev.Event]] = {}  # one launch writes one file in order: its lines' order is the truth
        seen: set[bytes] = set()
        p = e.pieces
        for i in range(0, len(p), 4):
            fi, start, end, n = p[i:i + 4]
            fh = self._open(fi)
            if fh is None:
                continue
            try:
                for k, raw in enumerate(piece_lines(fh, start, end)):
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
                    by_file.setdefault(fi, []).append(rec)
                    if run.started_at is None and type(rec) is ev.RunStarted:
                        run.started_at = (self.paths[fi], n + k)
            except OSError:
                if self.paths[fi] not in self.unreadable_files:
                    self.unreadable_files.append(self.paths[fi])
        if not by_file:
            return None
        # by file position, not wall clock (a clock stepped back mid-run garbled inspect); pieces of one trace
        # in several files (copies, a split log) in the order of their first records' time
        for fi in sorted(by_file, key=lambda f: (by_file[f][0].ts_ns, f)):
            run.records.extend(by_file[fi])
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
    """Read one or more JSON-lines traces (tolerant; see docs/internals.md, ``pipeline.observe.trace``), every run kept.

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

