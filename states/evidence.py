"""Auto-selection by measurement: the measured table and the order it gives auto's candidates.

The table (``pipeline/data/auto_evidence.json``, written by ``benchmarks/auto_evidence.py`` on one GPU) holds one row
per (device class, phase, layer kind, KV dtype) with each candidate backend's median time in µs on a stated shape.
A row applies when the device class matches, the installed ``flashinfer-python`` is the measured one exactly and
``torch`` / ``triton`` match major.minor, and every capable candidate the row does not exclude was timed: then the
fastest of them goes first (the capability records still decide what is allowed). Otherwise the fixed priority
stands and the evidence says ``unmeasured`` with the reason. A winner less than :data:`MIN_GAIN` faster than the
priority's choice leaves the priority in place (``measured``, with the reason). Torch-free: msgspec only.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Callable, Literal, Mapping, Optional, Sequence

import msgspec
from packaging.version import InvalidVersion, Version

import pipeline
from pipeline.core.contracts import DeviceFacts, Evidence, ModelSpec

DATA_PATH = pathlib.Path(pipeline.__file__).resolve().parent / "data" / "auto_evidence.json"
SCRIPT = "benchmarks/auto_evidence.py"
# The model's layer kind for the table: its most specific kind, most specific first, with its words.
LAYER_KINDS = {"mla": "MLA layers", "sinks": "sink layers", "softcap": "softcapped layers",
               "chunked": "chunked layers", "sliding": "sliding-window layers", "full": "full layers"}
_EXACT = ("flashinfer-python",)  # compared exactly; the others major.minor
# A measured winner replaces the fixed priority's choice only when at least this much faster: same-process runs of
# one kernel differ by up to ~3 % (benchmarks/RESULTS.md), so a smaller gap is noise, not a ranking.
MIN_GAIN = 1.05
NO_ROW = "no measured row"  # the reason's start when the table has nothing for this request (human output omits it)


class Row(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One measured choice: ``times_us`` backend → median µs (``relative``: relative units, only the ratio was
    recorded); ``failed`` backend → the error of a measurement that did not run; ``excluded`` backend → why it was
    not timed (the reference)."""

    device_class: str
    phase: Literal["prefill", "decode"]
    layer_kind: str
    kv_dtype: str
    shape: str
    times_us: dict[str, float] = {}
    failed: dict[str, str] = {}
    excluded: dict[str, str] = {}
    relative: bool = False
    source: str = SCRIPT


class Table(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The measured table: stamped with the date, the GPU's name, its device class (``h200``) and arch, and the
    package versions (distribution → version) it was measured with."""

    date: str
    gpu: str
    device_class: str
    arch: str
    versions: dict[str, str]
    rows: list[Row] = []
    source: str = SCRIPT


def write(table: Table, path: pathlib.Path | str) -> None:
    """Write ``table`` as indented JSON (the file :func:`load` reads)."""
    pathlib.Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(table), indent=2) + b"\n")


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> Table:
    return msgspec.json.decode(pathlib.Path(path).read_bytes(), type=Table)


def load(path: Optional[pathlib.Path | str] = None) -> Table | str:
    """The table at ``path`` (default :data:`DATA_PATH`), or why there is none (missing or unreadable file)."""
    p = pathlib.Path(path or DATA_PATH)
    try:
        return _load(str(p), p.stat().st_mtime)
    except FileNotFoundError:
        return f"no measured table ({p.name} missing)"
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return f"the measured table {p.name} is unreadable: {e}"


def device_class(device: DeviceFacts) -> str:
    """The device's class in the table: the first word of the GPU's name after the vendor's (``NVIDIA H200`` →
    ``h200``), else its arch (``sm90``), else its type (``cpu``)."""
    words = [w for w in device.name.split() if w.upper() not in ("NVIDIA", "AMD", "TESLA")]
    return words[0].lower() if words and device.type != "cpu" else device.arch or device.type


def layer_kind(model: ModelSpec) -> str:
    """The model's layer kind for the table: the most specific of its layers' (:data:`LAYER_KINDS` order)."""
    kinds = model.layer_kinds()
    have = {"mla": any(k.is_mla for k in kinds), "sinks": any(k.has_sinks for k in kinds),
            "softcap": any(k.logit_softcap for k in kinds), "chunked": any(k.kind == "chunked" for k in kinds),
            "sliding": any(k.kind == "sliding" for k in kinds)}
    return next((k for k, v in have.items() if v), "full")


def kv_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The KV dtype in the table: ``kv_cache_dtype`` (``fp8_e4m3`` …), or for ``auto`` the compute dtype, where
    bfloat16 and float16 are one class, ``16bit`` (the same bytes read, the same tensor-core rate; rows are timed
    in bfloat16)."""
    kv = compute_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return "16bit" if kv in ("bfloat16", "float16") else kv


def _same(dist: str, want: str, have: str) -> bool:
    try:
        w, h = Version(want), Version(have)
    except InvalidVersion:
        return want == have
    return w.public == h.public if dist in _EXACT else w.release[:2] == h.release[:2]


def version_mismatch(measured: Mapping[str, str], installed: Mapping[str, bool | str]) -> Optional[str]:
    """Why the installed packages are not the measured ones (None when they are): FlashInfer exactly, torch /
    triton major.minor. An absent package is not compared (its backends are not capable anyway); one assumed
    present without a version (``plan --installed NAME``) is unknown."""
    for dist, want in measured.items():
        have = installed.get(dist, False)
        if have is True:
            return (f"the installed {dist} version is not known; measured on {want} (plan --installed "
                    f"{dist}=={want} assumes it)")
        if have and not _same(dist, want, str(have)):
            return f"measured on {dist} {want}, installed {have}"
    return None


def _unmeasured(reason: str) -> Evidence:
    return Evidence(kind="unmeasured", reason=reason)


def order(half: str, candidates: Sequence[str], capable: Callable[[str], bool], *, model: ModelSpec,
          device: DeviceFacts, kv: str, installed: Mapping[str, bool | str], explicit: bool,
          table: Table | str | None = None, speculative: bool = False) -> tuple[list[str], Evidence]:
    """Auto's candidates for ``half`` (``prefill``/``decode``) in the order to try, and the evidence for it.

    ``candidates``: the fixed priority; ``capable(name)``: whether the capability records allow ``name`` here;
    ``kv``: the KV dtype (:func:`kv_dtype`); ``table``: default :func:`load`; ``speculative``: the prefill half
    serves target verify / draft extend, which the table does not time (unmeasured). When a row applies, its fastest
    capable backend takes the place of the first capable candidate (those refused before it stay, so the rejected
    list is the fixed priority's); otherwise the order is unchanged.
    """
    cands = list(candidates)
    if explicit:
        return cands, Evidence(kind="explicit")
    if speculative and half == "prefill":  # the prefill half runs target verify / draft extend: not what was timed
        return cands, _unmeasured("the table times plain extend, not speculative target verify or draft extend")
    table = load() if table is None else table
    if isinstance(table, str):
        return cands, _unmeasured(f"{NO_ROW}: {table}")
    cls, kind = device_class(device), layer_kind(model)
    row = next((r for r in table.rows if r.device_class in (cls, device.arch) and r.phase == half
                and r.layer_kind == kind and r.kv_dtype == kv), None)
    if row is None:
        return cands, _unmeasured(f"{NO_ROW} for {half} of {LAYER_KINDS[kind]} with {kv} KV on {cls}")
    bad = version_mismatch(table.versions, installed)
    if bad:
        return cands, _unmeasured(bad)
    able = [n for n in cands if capable(n) and n not in row.excluded]
    missing = [n for n in able if n not in row.times_us]
    if missing:
        why = "; ".join(f"{n}: {row.failed[n]}" if n in row.failed else f"{n}: not timed" for n in missing)
        return cands, _unmeasured(f"not measured for {half} of {LAYER_KINDS[kind]} on {cls}: {why}")
    if len(able) < 2:
        return cands, _unmeasured(f"only {able[0] if able else 'no backend'} measured and capable here: "
                                  "nothing to compare")
    best, nxt = sorted(able, key=lambda n: row.times_us[n])[:2]  # stable: a tie keeps the priority
    keep, reason = able[0], ""
    if best != keep and row.times_us[keep] / row.times_us[best] < MIN_GAIN:  # within noise: the priority stands
        best, nxt = keep, best
        reason = f"{nxt} measured less than {MIN_GAIN:.2f}× faster: the fixed priority stands"
    first = next(i for i, n in enumerate(cands) if capable(n))
    ranked = cands[:first] + [best] + [n for n in cands[first:] if n != best]
    return ranked, Evidence(kind="measured", source=f"{row.source}, {table.date}", device=table.gpu,
                            versions=dict(table.versions), next=nxt, reason=reason,
                            ratio_vs_next=round(row.times_us[nxt] / row.times_us[best], 3), layers=LAYER_KINDS[kind])


def text(half: str, backend: str, ev: Evidence) -> str:
    """The human line: ``decode: triton — 1.51× flashinfer for sink layers on NVIDIA H200 (source, date)``."""
    if ev.kind == "measured":
        return (f"{half}: {backend} — {ev.ratio_vs_next:.2f}× {ev.next} for {ev.layers} on {ev.device} "
                f"({ev.source})" + (f"; {ev.reason}" if ev.reason else ""))
    if ev.kind == "explicit":
        return f"{half}: {backend} — explicit"
    return f"{half}: {backend} — unmeasured: {ev.reason} (fixed priority)"


def as_json(evidence: Mapping[str, Evidence]) -> dict[str, object]:
    """``resolved.evidence``: per half ``{source, device, versions, next, ratio_vs_next}``, ``"unmeasured"`` or
    ``"explicit"``."""
    return {h: {"source": e.source, "device": e.device, "versions": dict(e.versions), "next": e.next,
                "ratio_vs_next": e.ratio_vs_next} if e.kind == "measured" else e.kind for h, e in evidence.items()}
