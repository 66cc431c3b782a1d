"""The writer never writes a record its reader drops, and secrets are redacted without corrupting a line.

Both are hypothesis properties over every record type (field values generated from the Structs' own
types: extreme integers, NaN/±inf/1e308 floats, markup, key names and lone surrogates in strings);
the reference is the record itself, compared field by field after the round trip.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.observe import trace as tr
from pipeline.core.contracts import SCHEMA_VERSION
from pipeline.core.eventlog import REDACTED, EventLog

SURROGATES = st.sampled_from(["\ud800", "\udcff", "a\udfffb"])
TEXT = st.one_of(st.text(max_size=12), SURROGATES, st.sampled_from(["[bold]", "[/]", "[red]x[/red]", "NaN",
                                                                    "Infinity", "run_id", "\x1b[31m", "🙂"]))
EXTREME_INT = st.one_of(st.integers(), st.sampled_from([0, -1, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 10**30, -10**30]))
EXTREME_FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                          st.sampled_from([1e308, -1e308, 5e-324, -0.0, math.inf, -math.inf, math.nan]))
JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), EXTREME_INT, EXTREME_FLOAT, TEXT),
                       lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(TEXT, kids, max_size=3)),
                       max_leaves=8)
WRITER_SET = {"schema_version", "ts_ns", "run_id", "rank", "launch_id"}  # EventLog.emit fills these itself


def _strategy(t: Any) -> st.SearchStrategy:
    """Values of a msgspec type (msgspec.inspect), extremes included; constraints respected."""
    if isinstance(t, mi.AnyType):
        return JSONISH
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        if t.ge is not None or t.le is not None:
            return st.integers(min_value=t.ge, max_value=t.le)
        return EXTREME_INT
    if isinstance(t, mi.FloatType):
        return EXTREME_FLOAT
    if isinstance(t, mi.StrType):
        return TEXT
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.UnionType):
        return st.one_of(*[_strategy(u) for u in t.types])
    if isinstance(t, mi.ListType):
        return st.lists(_strategy(t.item_type), max_size=3)
    if isinstance(t, mi.TupleType):
        return st.tuples(*[_strategy(u) for u in t.item_types])
    if isinstance(t, mi.DictType):
        return st.dictionaries(_strategy(t.key_type), _strategy(t.value_type), max_size=3)
    if isinstance(t, mi.StructType):
        return st.builds(t.cls, **{f.name: _strategy(f.type) for f in t.fields})
    raise AssertionError(f"no strategy for {t!r}: extend the test for the new field type")


def _record(cls: type) -> st.SearchStrategy:
    info = mi.type_info(cls)
    fields = {f.name: _strategy(f.type) for f in info.fields if f.name not in WRITER_SET}
    return st.builds(cls, schema_version=st.just(SCHEMA_VERSION), ts_ns=st.integers(0, 2**63 - 1),
                     run_id=TEXT, rank=st.integers(0, 2**31), launch_id=TEXT, **fields)


ANY_RECORD = st.one_of(*[_record(c) for c in ev.EVENT_TYPES])


def _same(a: Any, b: Any) -> bool:
    """Equality of builtins where NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _clean(s: str) -> str:  # what UTF-8 can hold: a lone surrogate as its \\udXXX text
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _expected(x: Any, typed_float: bool = False) -> Any:
    """The record's builtins as they must read back: strings cleaned; non-finite floats stay floats in
    typed float fields and become their text inside free-form (Any) values."""
    if isinstance(x, str):
        return _clean(x)
    if isinstance(x, float) and not math.isfinite(x) and not typed_float:
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {_clean(k) if isinstance(k, str) else k: _expected(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_expected(v) for v in x]
    return x


def _typed_floats(rec: ev.Event) -> set[str]:
    spec = wire.FLOAT_FIELDS[ev.event_name(type(rec))] or {}
    return {k for k, v in spec.items() if v in ("f", "f?")}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_RECORD)
def test_every_record_round_trips(rec):
    """encode never raises; the line is JSON; the reader keeps it (no skip, no dropped field) and it
    reads back equal, NaN and ±inf included; a file of it reads with nothing skipped."""
    line = wire.encode(rec)
    json.loads(line)  # strict JSON: no NaN/Infinity literals, valid UTF-8
    back, reason, dropped = tr.decode_record(line)
    assert reason == "" and dropped == 0 and type(back) is type(rec)
    assert wire.decode_line(line) == back or _same(msgspec.to_builtins(wire.decode_line(line)),
                                                   msgspec.to_builtins(back))
    got, want = msgspec.to_builtins(back), msgspec.to_builtins(rec)
    floats = _typed_floats(rec)
    assert got.keys() == want.keys()
    spec = wire.FLOAT_FIELDS[ev.event_name(type(rec))] or {}
    nested = {k: v for k, v in spec.items() if isinstance(v, tuple) and v[0] in ("seq", "map")}

    def typed(item: dict, fields: dict) -> dict:
        return {f: (x if fields.get(f) in ("f", "f?") else _expected(x)) for f, x in item.items()}

    for k in want:
        if k in nested:  # Structs with typed float fields in a list (startup_summary's phases) or a map (evidence)
            kind, fields = nested[k]
            exp = ([typed(item, fields) for item in want[k]] if kind == "seq"
                   else {_expected(key): typed(item, fields) for key, item in want[k].items()})
            assert _same(got[k], exp), k
            continue
        assert _same(got[k], _expected(want[k], typed_float=k in floats)), k


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ANY_RECORD, min_size=1, max_size=6))
def test_a_file_of_records_reads_back_whole(recs):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl"
        p.write_bytes(b"".join(wire.encode(r) + b"\n" for r in recs))
        t = tr.read_trace(p)
    assert t.skipped_lines == 0 and t.dropped_fields == 0
    distinct = {wire.encode(r) for r in recs}
    assert sum(len(r.records) for r in t.runs) == len(distinct)


def test_old_null_for_nan_reads_as_nan():
    """A trace from before the text form (msgspec wrote NaN as null) keeps its failed verification."""
    line = (b'{"event":"instance_verified","schema_version":1,"ts_ns":5,"run_id":"r","rank":0,"state":"done",'
            b'"outcome":"failed","role":"primary","backend":"torch_native","max_rel_err":null,"tol":0.02,'
            b'"passed":false}')
    rec, reason, _ = tr.decode_record(line)
    assert reason == "" and math.isnan(rec.max_rel_err) and rec.passed is False


# -- secrets -------------------------------------------------------------------------------------

KEY_NAMES = sorted({f for c in ev.EVENT_TYPES for f in c.__struct_encode_fields__} | {"event"})
SECRET = st.one_of(st.text(alphabet="0123456789", min_size=1, max_size=4),
                   st.text(alphabet=':,"{}[]\\-.+ <>/', min_size=1, max_size=3),
                   st.sampled_from(KEY_NAMES + ["true", "false", "null", "ok", "<redacted>", "red", "\\"]),
                   st.text(min_size=1, max_size=6))


def _strings(x: Any, path: str = "$") -> list[tuple[str, str]]:
    if isinstance(x, str):
        return [(path, x)]
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _strings(v, f"{path}.{k}")]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _strings(v, f"{path}[{i}]")]
    return []


def _closed_values() -> set[str]:
    """Every Literal/Enum value any record type allows (redaction leaves those fields alone)."""
    out: set[str] = set()

    def walk(t: Any, seen: set) -> None:
        if isinstance(t, mi.LiteralType):
            out.update(v for v in t.values if isinstance(v, str))
        elif isinstance(t, mi.EnumType):
            out.update(m.value for m in t.cls)
        elif isinstance(t, mi.UnionType):
            for u in t.types:
                walk(u, seen)
        elif isinstance(t, (mi.ListType, mi.VarTupleType)):
            walk(t.item_type, seen)
        elif isinstance(t, mi.DictType):
            walk(t.value_type, seen)
        elif isinstance(t, mi.StructType) and t.cls not in seen:
            for f in t.fields:
                walk(f.type, seen | {t.cls})

    for c in ev.EVENT_TYPES:
        walk(mi.type_info(c), set())
    return out


CLOSED = _closed_values()


def _nonfinite_paths(x: Any, path: str = "$") -> set[str]:
    if isinstance(x, float) and not math.isfinite(x):
        return {path}
    if isinstance(x, dict):
        return {p for k, v in x.items() for p in _nonfinite_paths(v, f"{path}.{_clean(k) if isinstance(k, str) else k}")}
    if isinstance(x, (list, tuple)):
        return {p for i, v in enumerate(x) for p in _nonfinite_paths(v, f"{path}[{i}]")}
    return set()


def _skeleton(x: Any) -> Any:
    """Everything but string values: keys, numbers, booleans, nulls, shape."""
    if isinstance(x, dict):
        return {k: _skeleton(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_skeleton(v) for v in x]
    return "<str>" if isinstance(x, str) else x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(secrets=st.lists(SECRET, min_size=1, max_size=3), recs=st.lists(ANY_RECORD, min_size=1, max_size=4))
def test_redaction_is_structural(secrets, recs):
    """With any secret values (digits, JSON punctuation, key names, unicode): every line is valid JSON
    and a readable record; keys, numbers and the envelope are untouched; no string value keeps a
    secret outside the markers; the application's logger gets the same redacted values."""
    import structlog

    with tempfile.TemporaryDirectory() as d, structlog.testing.capture_logs() as app:
        p = Path(d) / "s.jsonl"
        log = EventLog("run-1", 0, p, secrets=tuple(secrets))
        for r in recs:
            fields = {f: getattr(r, f) for f in r.__struct_fields__ if f not in WRITER_SET | {"state", "outcome"}}
            log.emit(type(r), state=r.state, outcome=r.outcome, **fields)
        log.emit(ev.StepSkipped, state="resolve", what="x", reason=f"a{secrets[0]}b \"{secrets[-1]}\"")
        log.close()
        lines = p.read_bytes().splitlines()
    assert len(lines) == len(recs) + 1 and len(app) == len(recs) + 1
    real = [s for s in secrets if s]
    for line, rec, entry in zip(lines, log.records, app):
        obj = json.loads(line)
        back, reason, _ = tr.decode_record(line)
        assert reason == "", (reason, line[:200])
        plain = wire.to_wire(rec)
        assert _skeleton(obj) == _skeleton(plain)
        from pipeline.core.wire import MACHINE_NAMES

        keep = wire.ENVELOPE + MACHINE_NAMES.get(plain["event"], ())   # a transition's state names: never rewritten
        for k in keep:
            assert obj[k] == plain[k]
        numbers = _nonfinite_paths(msgspec.to_builtins(rec))  # written as "NaN"/"Infinity" text: numbers, not strings
        # Literal/Enum fields are never redacted (a redacted value would make the record invalid)
        body = {k: v for k, v in wire.to_wire(rec, lambda text: "\0").items() if k not in keep}
        untouched = {p for p, v in _strings(body) if v != "\0" and v} - numbers
        assert {v for p, v in _strings(wire.to_wire(rec)) if p in untouched} <= CLOSED
        numbers |= untouched
        for path, value in _strings({k: v for k, v in obj.items() if k not in keep}):
            if path in numbers:
                continue
            for piece in value.split(REDACTED):
                assert not any(s in piece for s in real), (path, value, secrets)
        app_obj = {k: v for k, v in entry.items() if k != "log_level"}
        for path, value in _strings(app_obj):
            if path.split(".")[1].split("[")[0] in keep or path in numbers:
                continue
            for piece in value.split(REDACTED):
                assert not any(s in piece for s in real), (path, value, secrets)


@pytest.mark.parametrize("value", ["1", ":", "run_id", '"'])
def test_issue_secret_values_keep_the_log_readable(tmp_path, value):
    """The reported values: ATTN_SETUP_SECRET_TOKEN=1 / ':' / 'run_id' corrupted every line before."""
    from conftest import CONFIGS
    from pipeline.core.contracts import PoolFacts, SetupRequest
    from pipeline.core.model_spec import load_model_spec
    from pipeline.testing import record_trace

    req = SetupRequest(model=load_model_spec(CONFIGS / "llama-3.1-8b.json"), device="cpu",
                       pool=PoolFacts(max_reqs=2, max_context_len=32, num_token_slots=64), secrets={"TOKEN": value})
    t = record_trace(req, tmp_path / "t.jsonl")
    assert t.skipped_lines == 0 and t.runs[0].status == "ok"
    raw = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert raw[0]["request"]["secrets"] == {"TOKEN": REDACTED} and all(isinstance(r["ts_ns"], int) for r in raw)
    assert all(set(r) >= {"event", "run_id", "rank", "state", "ts_ns"} for r in raw)


def test_a_value_nested_deeper_than_readers_keep_is_cut_not_dropped():
    """A free-form value 300 levels deep: the record is written (the deep part as text) and read back."""
    deep: Any = "leaf"
    for _ in range(300):
        deep = [deep]
    rec = ev.RunnerStarted(ts_ns=1, run_id="r", state="init-distributed", config={"deep": deep, "n": math.inf})
    back, reason, _ = tr.decode_record(wire.encode(rec))
    assert reason == "" and back.config["n"] == "Infinity"
    x, depth = back.config["deep"], 0
    while isinstance(x, list):
        x, depth = x[0], depth + 1
    assert x == wire.TOO_DEEP and 40 <= depth < tr.MAX_DEPTH
