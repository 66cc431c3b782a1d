"""Where the event records hold floats, and how a non-finite one is written and read back.

JSON has no NaN or infinity (msgspec would write ``null``, which a reader then refuses for a ``float`` field), so
the records write them as the text ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (:func:`_float_text`, protobuf's
JSON spelling). Reading back, :class:`FloatFields` says per record type where its float fields are
(:func:`_float_spec`, nested Structs and containers included) and :func:`_restore` turns the text there into the
float again — and a ``null`` in a float field, what older versions wrote, into NaN. The codec
(:mod:`pipeline.core.event_wire`) holds the record union and uses these; import from :mod:`pipeline.core.events`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterator, Mapping

import msgspec.inspect as mi

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
    """Event tag → where its float fields are (see :func:`_float_spec`; for ``"NaN"``/``"Infinity"`` text), over
    ``by_tag`` (tag → record type; an unknown tag is a KeyError, as for a dict).

    Computed per tag on first lookup, not at import: ``msgspec.inspect.type_info`` over every record type
    took ~70 % of this module's import time, paid by every process (``plan`` included) whether or not it
    ever reads a record with a non-finite float.
    """

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
