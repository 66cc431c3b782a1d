"""The event records' wire form: one JSON line per record (:func:`encode`) and back (:func:`decode_line`).

Non-finite floats are written ``"NaN"``/``"Infinity"``/``"-Infinity"`` (protobuf's JSON spelling) and read back as
floats in ``float`` fields (:data:`FLOAT_FIELDS`; ``null`` there reads as NaN), strings elsewhere. Lone surrogates are
written ``\\udXXX``, secrets redacted, too-deep free-form values ``"<nested too deep>"``: every record encodes and reads
back (tests/test_event_wire.py).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Iterator, Mapping, Optional

import msgspec
import msgspec.inspect as mi

from pipeline.core.events import EVENT_TYPES, AnyEvent, Event


NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float_text(x: float) -> str:
    return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")


def _float_spec(t: Any, memo: dict[type, Any]) -> Any:
    """Where a msgspec type holds floats: "f" (a float), "f?" (a float or None), a dict field → spec (a
    Struct), ("seq", spec) / ("map", spec) for containers, or None (no float inside)."""
    if isinstance(t, mi.FloatType):
        return "f"
    if isinstance(t, mi.UnionType):
        specs = [s for s in (_float_spec(u, memo) for u in t.types) if s is not None]
        if not specs:
            return None
        return "f?" if specs[0] == "f" and t.includes_none else specs[0]
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        s = _float_spec(t.item_type, memo)
        return None if s is None else ("seq", s)
    if isinstance(t, mi.TupleType):
        specs = [s for s in (_float_spec(u, memo) for u in t.item_types) if s is not None]
        return ("seq", specs[0]) if specs else None
    if isinstance(t, mi.DictType):
        s = _float_spec(t.value_type, memo)
        return None if s is None else ("map", s)
    if isinstance(t, mi.StructType):
        if t.cls in memo:
            return memo[t.cls]
        memo[t.cls] = None
        fields = {f.encode_name: s for f in t.fields if (s := _float_spec(f.type, memo)) is not None}
        memo[t.cls] = fields or None
        return memo[t.cls]
    return None


def _restore(x: Any, spec: Any) -> Any:
    if spec == "f" or spec == "f?":
        if type(x) is str:
            return NONFINITE.get(x, x)
        # null in a float field that cannot be None: what msgspec wrote for NaN/inf before the text
        # form existed (a trace from an older attn-setup) — read it as NaN rather than drop the record
        return math.nan if x is None and spec == "f" else x
    if isinstance(spec, dict):
        if type(x) is not dict:
            return x
        return {k: (_restore(v, spec[k]) if k in spec else v) for k, v in x.items()}
    kind, inner = spec
    if kind == "seq" and type(x) is list:
        return [_restore(v, inner) for v in x]
    if kind == "map" and type(x) is dict:
        return {k: _restore(v, inner) for k, v in x.items()}
    return x


class FloatFields(Mapping[str, Any]):
    """Event tag → where its float fields are (:func:`_float_spec`) over ``by_tag`` (unknown tag: KeyError); computed
    per tag on first lookup to keep import cheap."""

    def __init__(self, by_tag: Mapping[str, type]) -> None:
        self._by_tag = by_tag
        self._memo: dict[type, Any] = {}
        self._specs: dict[str, Any] = {}
        self._lock = threading.Lock()  # the memo holds a placeholder while a Struct is being walked

    def __getitem__(self, tag: str) -> Any:
        try:
            return self._specs[tag]
        except KeyError:
            cls = self._by_tag[tag]  # KeyError for an unknown tag, as a dict
            with self._lock:
                if tag not in self._specs:
                    self._specs[tag] = _float_spec(mi.type_info(cls), self._memo)
            return self._specs[tag]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_tag)

    def __len__(self) -> int:
        return len(self._by_tag)


_BY_TAG: dict[str, type[Event]] = {c.__struct_config__.tag: c for c in EVENT_TYPES}  # type: ignore[misc]
_decoder = msgspec.json.Decoder(AnyEvent)
_encoder = msgspec.json.Encoder()

# Envelope fields: identifiers the library writes itself, never redacted.
ENVELOPE = ("event", "schema_version", "ts_ns", "run_id", "rank", "launch_id", "state", "outcome")
# A transition's states and trigger: a machine's closed names, never user text, never redacted.
MACHINE_NAMES = {"runner_transition": ("from", "to", "trigger"), "state_transition": ("from", "to", "trigger")}


def clean_str(s: str) -> str:
    """Public name of :func:`_clean_str` (the redactor escapes secrets the same way)."""
    return _clean_str(s)


def _clean_str(s: str) -> str:
    """``s`` unchanged, or with lone surrogates written as ``\\udXXX`` text (UTF-8 cannot hold them)."""
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


MAX_DEPTH = 64  # readers skip records nested deeper (``too_deep``); ours nest 6 deep
_VALUE_DEPTH = MAX_DEPTH - 8  # below a field, leaving room for the record around it
TOO_DEEP = "<nested too deep>"


def _wire(x: Any, redact: Optional[Callable[[str], str]], depth: int = 0, closed: Any = None) -> Any:
    """Builtins ready for JSON: non-finite floats as text, strings cleaned (and redacted unless ``closed``), too-deep
    containers as :data:`TOO_DEEP`."""
    t = type(x)
    if t is str:
        return redact(_clean_str(x)) if redact is not None and closed is not True else _clean_str(x)
    if t is float:
        return x if math.isfinite(x) else _float_text(x)
    if t is dict or t is list or t is tuple:
        if depth >= _VALUE_DEPTH:
            return TOO_DEEP
        sub = closed[1] if isinstance(closed, tuple) else None
        if t is dict:
            keyed = closed if isinstance(closed, dict) else None
            return {_clean_str(k) if type(k) is str else k:
                    _wire(v, redact, depth + 1, keyed.get(k) if keyed is not None else sub) for k, v in x.items()}
        return [_wire(v, redact, depth + 1, sub) for v in x]
    return x


def _closed_spec(t: Any, memo: dict[type, Any]) -> Any:
    """Where a msgspec type holds Literal/Enum values: True, a dict field → spec (a Struct),
    ("seq"/"map", spec) for containers, or None."""
    if isinstance(t, (mi.LiteralType, mi.EnumType)):
        return True
    if isinstance(t, mi.UnionType):
        specs = [x for x in (_closed_spec(u, memo) for u in t.types) if x is not None]
        return specs[0] if specs else None
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        inner = _closed_spec(t.item_type, memo)
        return None if inner is None else ("seq", inner)
    if isinstance(t, mi.TupleType):
        specs = [x for x in (_closed_spec(u, memo) for u in t.item_types) if x is not None]
        return ("seq", specs[0]) if specs else None
    if isinstance(t, mi.DictType):
        inner = _closed_spec(t.value_type, memo)
        return None if inner is None else ("map", inner)
    if isinstance(t, mi.StructType):
        if t.cls in memo:
            return memo[t.cls]
        memo[t.cls] = None
        fields = {f.encode_name: x for f in t.fields if (x := _closed_spec(f.type, memo)) is not None}
        memo[t.cls] = fields or None
        return memo[t.cls]
    return None


_CLOSED: dict[type, dict[str, Any]] = {}


def to_wire(event: Event, redact: Optional[Callable[[str], str]] = None) -> dict[str, Any]:
    """The record as the JSON object written: builtins, non-finite floats as text, lone surrogates escaped and, with
    ``redact``, every string value outside the envelope (:data:`ENVELOPE`) and Literal/Enum fields redacted after
    escaping (keys never)."""
    cls = type(event)
    closed = _CLOSED.get(cls)
    if closed is None:
        closed = _CLOSED[cls] = _closed_spec(mi.type_info(cls), {}) or {}
    obj = msgspec.to_builtins(event)
    keep = ENVELOPE + MACHINE_NAMES.get(obj.get("event"), ())
    return {k: (_wire(v, None) if k in keep else _wire(v, redact, 0, closed.get(k))) for k, v in obj.items()}


def _finite(x: Any) -> bool:
    return x is None or type(x) is not float or math.isfinite(x)


_LEAVES = (str, int, bool, type(None), bytes)  # values that never need the wire form (nor nest)


def _needs_wire(x: Any, depth: int = 0) -> bool:
    """Whether a free-form value holds a non-finite float or nests too deep for the fast path."""
    t = type(x)
    if t is float:
        return not math.isfinite(x)
    if t is dict:
        items: Any = x.values()
    elif t is list or t is tuple:
        items = x
    elif isinstance(x, msgspec.Struct):
        items = [getattr(x, f) for f in x.__struct_fields__]
    else:
        return False
    if depth >= _VALUE_DEPTH - 2:  # a Struct's builtins may add a level or two
        return True
    for v in items:
        if type(v) in _LEAVES:
            continue
        if _needs_wire(v, depth + 1):
            return True
    return False


def encode(event: Event, redact: Optional[Callable[[str], str]] = None) -> bytes:
    """One JSON line (no newline), see :func:`to_wire`; never raises for a well-typed record (values deeper than
    :data:`MAX_DEPTH` become :data:`TOO_DEEP`). Without ``redact`` the common case is encoded by msgspec directly."""
    if redact is None:
        floats, anys = _fast_plan(type(event))
        if floats is not None and all(_finite(getattr(event, f)) for f in floats) and not any(
                _needs_wire(getattr(event, f)) for f in anys):
            try:
                return _encoder.encode(event)
            except UnicodeEncodeError:  # a lone surrogate: the wire form escapes it
                pass
    return _encoder.encode(to_wire(event, redact))


def _contains_any(t: Any, seen: set[type]) -> bool:
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.UnionType):
        return any(_contains_any(u, seen) for u in t.types)
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return _contains_any(t.item_type, seen)
    if isinstance(t, mi.TupleType):
        return any(_contains_any(u, seen) for u in t.item_types)
    if isinstance(t, mi.DictType):
        return _contains_any(t.value_type, seen)
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return False
        seen.add(t.cls)
        return any(_contains_any(f.type, seen) for f in t.fields)
    return False


_PLANS: dict[type, tuple[Optional[tuple[str, ...]], tuple[str, ...]]] = {}


def _fast_plan(cls: type) -> tuple[Optional[tuple[str, ...]], tuple[str, ...]]:
    """(top-level float fields, fields that may hold free-form values) of ``cls``; floats None when a
    float sits deeper inside a typed field (then the wire form is always built)."""
    plan = _PLANS.get(cls)
    if plan is None:
        info = mi.type_info(cls)
        spec = _float_spec(info, {}) or {}
        nested = any(v not in ("f", "f?") for v in spec.values())
        by_enc = {f.encode_name: f.name for f in info.fields}
        floats = None if nested else tuple(by_enc[k] for k in spec)
        anys = tuple(f.name for f in info.fields if _contains_any(f.type, set()))
        plan = _PLANS[cls] = (floats, anys)
    return plan


FLOAT_FIELDS: Mapping[str, Any] = FloatFields(_BY_TAG)


def restore_floats(obj: dict[str, Any]) -> dict[str, Any]:
    """The decoded JSON object of a record with ``"NaN"``/``"Infinity"``/``"-Infinity"`` turned back
    into floats where the record type has a ``float`` field (nested Structs included)."""
    spec = FLOAT_FIELDS.get(obj.get("event")) if type(obj.get("event")) is str else None
    return obj if spec is None else _restore(obj, spec)


def decode_line(line: bytes | str) -> Event:
    """Decode one JSON line into its typed record (raises ``msgspec.DecodeError``/``ValidationError``)."""
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError:
        obj = msgspec.json.decode(line)
        if not isinstance(obj, dict):
            raise
        return msgspec.convert(restore_floats(obj), AnyEvent)

