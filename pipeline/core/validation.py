"""Checks of values before anything is allocated: field checks run from the contracts' ``__post_init__``, and the value
domains and device spellings the library and the command line share (docs/internals.md)."""

from __future__ import annotations

import difflib
import enum
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from pipeline.core.errors import ConfigError


# Accepted device spellings: any case, ``gpu`` for ``cuda``; an optional ASCII index (0-9 digits, at most 6).
_DEVICE_ANY_CASE = re.compile(r"(auto|cpu)|(cuda|gpu|musa|npu|xpu|mps)(?::([0-9]{1,6}))?", re.ASCII | re.IGNORECASE)
DEVICE_ALIASES = {"gpu": "cuda"}
DEVICE_ALLOWED = ("auto", "cpu", "cuda[:N]", "musa[:N]", "npu[:N]", "xpu[:N]",
                  "any letter case (CUDA:0 = cuda:0)", "gpu[:N] = cuda[:N]")


def nearest_name(name: str, known: Any) -> Optional[str]:
    """The name in ``known`` nearest ``name`` for a "did you mean": difflib's ratio over lower-cased names (cutoff
    0.6), returned as spelled in ``known``; None when nothing is near enough. Raises nothing."""
    lower = {k.lower(): k for k in known}
    hit = difflib.get_close_matches(name.lower(), list(lower), n=1, cutoff=0.6)
    return lower[hit[0]] if hit else None


@dataclass(frozen=True)
class DeviceSpelling:
    """A device as written and as meant: ``canonical`` (``cuda:0``) and ``spelled_as`` (``CUDA:0``, None when
    the user wrote the canonical form)."""

    canonical: str
    spelled_as: Optional[str] = None


def device_spelling(text: Any) -> Optional[DeviceSpelling]:
    """The canonical device of an accepted spelling (``CUDA:0`` → ``cuda:0``, ``gpu`` → ``cuda``), or None when
    ``text`` is no device (``""``, ``cuda:x``, ``cuda:²``, ``tpu``)."""
    if not isinstance(text, str):
        return None
    m = _DEVICE_ANY_CASE.fullmatch(text)
    if m is None:
        return None
    if m.group(1):
        canonical = m.group(1).lower()
    else:
        kind = m.group(2).lower()
        canonical = DEVICE_ALIASES.get(kind, kind) + (f":{m.group(3)}" if m.group(3) is not None else "")
    return DeviceSpelling(canonical, None if canonical == text else text)


def check_spelling(device: str, spelled_as: Optional[str]) -> None:
    """Raise ConfigError (``invalid_value``, field ``device_spelled_as``) unless ``spelled_as`` is None or an
    accepted spelling of ``device`` (a request never records another device's spelling)."""
    if spelled_as is None:
        return
    spelled = device_spelling(spelled_as)
    if spelled is None or spelled.canonical != device:
        raise ConfigError(f"device_spelled_as={spelled_as!r} does not spell device={device!r}", code="invalid_value",
                          flags=[("device_spelled_as", spelled_as), ("device", device)],
                          allowed=[f"None, or a spelling of {device!r} (CUDA:0 for cuda:0)"],
                          remedy="pass device_spelled_as=None, or the text the user wrote for this device")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1 << 53 else repr(v)


@dataclass(frozen=True)
class Domain:
    """The values one setting takes. ``kind``: ``int`` (``lo``..``hi`` inclusive), ``float`` (finite;
    ``lo_open``/``hi_open``), ``choice`` (``any_case`` ignores case and blanks), ``text`` (non-empty), ``device``
    (:func:`device_spelling`), ``packages`` (comma-separated subset, ``''`` = none). ``hidden`` choices are admitted
    unlisted; ``example``: an in-domain value for remedies."""

    kind: str
    example: Any
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()  # admitted, not offered (names with their own, more specific refusal later)
    any_case: bool = False
    unit: str = ""

    def admits(self, v: Any) -> bool:
        """Whether ``v`` (as argparse converted it) is inside the domain."""
        if self.kind in ("int", "float"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (self.kind == "int" and isinstance(v, float)):
                return False
            if isinstance(v, float) and not math.isfinite(v):
                return False
            return self._above_lo(v) and self._below_hi(v)
        if self.kind == "choice":
            if not isinstance(v, str):
                return False
            return (v.strip().lower() if self.any_case else v) in self._choices() or v in self.hidden
        if self.kind == "text":
            return isinstance(v, str) and v.strip() != ""
        if self.kind == "device":
            return device_spelling(v) is not None
        if self.kind == "packages":
            names = [p.split("==")[0].strip().lower() for p in v.split(",") if p.strip()] if isinstance(v, str) \
                else [None]  # NAME or NAME==VERSION
            return all(n in self._choices() for n in names)
        raise ValueError(f"unknown domain kind {self.kind!r}")

    def nearest(self, v: Any) -> Optional[str]:
        """The listed choice nearest ``v`` (difflib, ignoring letter case), for "did you mean"; for ``packages`` the
        one nearest the first name of ``v`` that is not a choice. None when ``v`` is admitted, nothing is near
        enough, or the domain holds no names. Raises nothing."""
        if self.kind not in ("choice", "packages") or not isinstance(v, str) or self.admits(v):
            return None
        names = [p.split("==")[0].strip() for p in v.split(",") if p.strip()] if self.kind == "packages" \
            else [v.strip()]
        lowered = [c.lower() for c in self.choices]
        for name in names:
            if name.lower() not in lowered:
                return nearest_name(name, self.choices)
        return None

    def _choices(self) -> tuple[str, ...]:
        return tuple(c.lower() for c in self.choices) if self.any_case or self.kind == "packages" else self.choices

    def _above_lo(self, v: float) -> bool:
        return self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)

    def _below_hi(self, v: float) -> bool:
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def allowed(self) -> str:
        """The domain in words: ``an integer in [1, 4096]``, ``a finite number in (0, 1]``, ``one of: …``."""
        unit = f" ({self.unit})" if self.unit else ""
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a finite number"
            if self.lo is not None and self.hi is not None:
                return (f"{what} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
                        f"{')' if self.hi_open else ']'}{unit}")
            if self.lo is not None:
                return f"{what} {'>' if self.lo_open else '>='} {_num(self.lo)}{unit}"
            return what + unit
        if self.kind == "choice":
            return "one of: " + ", ".join(self.choices) + (" (any letter case)" if self.any_case else "")
        if self.kind == "text":
            return "a non-empty value"
        if self.kind == "device":
            return ", ".join(DEVICE_ALLOWED)
        return f"a comma-separated list of {', '.join(self.choices)} ('' = none)"


def check_draft_fields(r: Any) -> None:
    """Raise ConfigError when ``r`` sets a draft-only field without ``is_draft_worker``: ``invalid_value`` naming
    ``draft_model``; ``conflicting_options`` naming ``speculative_draft_attention_backend`` and ``is_draft_worker`` (unless
    ``speculative_algorithm`` is set: a speculative server's args, shared with its draft worker)."""
    if r.is_draft_worker:
        return
    if r.draft_model is not None:
        raise ConfigError(f"draft_model={r.draft_model.source or '<spec>'} is not allowed", code="invalid_value",
                          flags=[("draft_model", r.draft_model.source or "<spec>")],
                          allowed=["only with is_draft_worker=True"],
                          remedy="set is_draft_worker=True to initialize the draft worker, or drop draft_model")
    backend = r.args.speculative_draft_attention_backend
    if backend is not None and r.args.speculative_algorithm is None:
        raise ConfigError("speculative_draft_attention_backend is set but is_draft_worker is False: a target worker "
                          "ignores it (sglang reads it only in its draft worker)", code="conflicting_options",
                          flags=[("speculative_draft_attention_backend", backend), ("is_draft_worker", False)],
                          allowed=["speculative_draft_attention_backend only with is_draft_worker=True, or on a "
                                   "speculative server's target worker (speculative_algorithm set)"],
                          remedy="set is_draft_worker=True to initialize the draft worker, or drop "
                                 "speculative_draft_attention_backend")


# One alias set for --dtype and --kv-cache-dtype: canonical name -> spellings (pipeline.core.dtypes.norm_dtype).
DTYPE_SPELLINGS = {"bfloat16": ("bfloat16", "bf16"), "float16": ("float16", "fp16", "half"),
                   "float32": ("float32", "fp32", "float")}
_FLOATS = tuple(a for names in DTYPE_SPELLINGS.values() for a in names)
KV_CACHE_DTYPES = ("auto", *_FLOATS, "fp8_e4m3", "fp8_e5m2")
MODEL_DTYPES = ("auto", *_FLOATS)
MAX_PAGE_SIZE = 4096
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
# sglang 0.5.23's --moe-a2a-backend choices ("none" = no all-to-all), one string: tests/test_structure.py keeps
# attention backend names inside pipeline/backends.
MOE_A2A_BACKENDS = tuple("none deepep mooncake nixl mori ascend_fuseep flashinfer megamoe deepep_v2 ascend_tp pplx "
                         "flashinfer_megamoe".split())
MAX_SPEC = 1024  # upper bound of the speculative counts (steps, top-k, draft tokens): far above any real tree
# Byte sizes above this are typos (far above any device, inside int64).
MAX_BYTES = 1 << 48
# req_to_token and seq lens are int32 (sglang's ReqToTokenPool): no pool dimension exceeds int32.
MAX_POOL_DIM = (1 << 31) - 1
DEVICE_TYPES = ("auto", "cpu", "cuda", "musa", "npu", "xpu", "mps")
_DEVICE = re.compile(r"(auto|cpu)|(cuda|musa|npu|xpu|mps)(?::([0-9]{1,6}))?", re.ASCII)
# msgspec encodes ints in [-2**63, 2**64): an int field outside that could not be logged.
_INT64 = (-(1 << 63), (1 << 63) - 1)


# Types: msgspec does not check a Struct's constructor arguments, so every input contract checks its fields here.

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def is_text(v: Any) -> bool:
    """A str that encodes as UTF-8 (no lone surrogates), so it can be logged and printed."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def matches(v: Any, tp: Any) -> bool:
    """Whether ``v`` is a value of annotation ``tp`` as msgspec would decode it (``int``: no bool, int64; ``float``
    takes ints; ``str`` valid UTF-8; containers element-wise; Structs by isinstance)."""
    if tp is Any:
        return True
    if tp is type(None):
        return v is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches(v, a) for a in args)
    if origin is typing.Literal:
        return any(type(v) is type(a) and v == a for a in args)
    if origin is list:
        return isinstance(v, (list, tuple)) and all(matches(x, args[0]) for x in v)
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches(x, args[0]) for x in v)
        return len(v) == len(args) and all(matches(x, a) for x, a in zip(v, args))
    if origin is dict:
        return isinstance(v, dict) and all(matches(k, args[0]) and matches(x, args[1]) for k, x in v.items())
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1]
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return is_text(v)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(v, tp)
    if isinstance(tp, type):
        return isinstance(v, tp)
    return True


# What to do about a field of the wrong type, where "pass a <type>" is not enough.
_TYPE_REMEDY = {
    "model": "pass model=pipeline.load_model_spec(path_or_dict), not the dict itself",
    "draft_model": "pass draft_model=pipeline.load_model_spec(path_or_dict), or None",
    "args": "pass args=pipeline.AttentionArgs(...)",
    "pool": "pass pool=pipeline.core.contracts.PoolFacts(...)",
    "mla": "pass mla=pipeline.core.contracts.MLADims(...), or let load_model_spec read the MLA dims",
}


def check_types(obj: msgspec.Struct, prefix: str = "") -> None:
    """Raise ConfigError (``invalid_value``) for the first field (``prefix`` + name) not of its annotated type."""
    cls = type(obj)
    for name, tp in _hints(cls).items():
        if name not in cls.__struct_fields__:
            continue
        v = getattr(obj, name)
        if not matches(v, tp):
            want = _type_name(tp)
            field = prefix + name
            what = _describe(v)
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if isinstance(v, (list, tuple)) and args and typing.get_origin(args[0]) is list:
                elem = typing.get_args(args[0])[0]
                bad = next((x for x in v if not matches(x, elem)), None)
                what = f"a list holding {_describe(bad)}" if bad is not None else what
            raise ConfigError(f"{cls.__name__}.{name} must be {want}, got {what}", code="invalid_value",
                              flags=[(field, v)], allowed=[want],
                              remedy=_TYPE_REMEDY.get(name, f"pass a value of type {want} for {name}"))


def _describe(v: Any) -> str:
    if isinstance(v, str) and not is_text(v):
        return "text with a lone surrogate (not valid UTF-8)"
    if isinstance(v, int) and not isinstance(v, bool) and not _INT64[0] <= v <= _INT64[1]:
        return "an integer outside int64"
    return type(v).__name__


def check_size(field: str, value: Optional[int], *, allow_zero: bool, source: Optional[str] = None) -> None:
    """The one byte-size check: ``value`` an integer in ``[0 or 1, MAX_BYTES]``; ``source`` (e.g.
    ``SGLANG_FLASHINFER_WORKSPACE_SIZE``) is named instead of the field. Raises ConfigError (``invalid_value``)."""
    if value is None:
        return
    lo = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_BYTES:
        rng = f"an integer in [{lo}, {MAX_BYTES}] (bytes)"
        name = source or field
        raise ConfigError(f"{name}={_short(value)} is not allowed", code="invalid_value",
                          flags=[(name, value)] + ([(field, None)] if source else []), allowed=[rng],
                          remedy=(f"unset {source} or set it to {rng}" if source else f"set {field} to {rng}"))


def _short(v: Any) -> str:
    """repr(v) for messages, at most 80 characters; never fails (ints above 4300 digits cannot be repr'd)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"<an integer of about {int(v.bit_length() * 0.30103) + 1} digits>"
    try:
        text = repr(v)
    except (ValueError, RecursionError):
        text = f"<a {type(v).__name__} that cannot be shown>"
    return text if len(text) <= 80 else text[:77] + "..."


def check_device(device: str) -> None:
    """``auto``, ``cpu``, or an accelerator type with an optional ASCII index (``cuda:1``); else ConfigError
    (``invalid_value``, flag ``device``)."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        _bad("device", device, ["auto", "cpu", "cuda", "cuda:N", "musa[:N]", "npu[:N]", "xpu[:N]"],
             "set device='auto' to pick this machine's accelerator, or device='cpu' (N: 0-9 digits)")


def _bad(field: str, value: Any, allowed: list[str] | tuple[str, ...], remedy: str, msg: str | None = None):
    raise ConfigError(
        msg or f"{field}={_short(value)} is not allowed",
        code="invalid_value",
        flags=[(field, value)],
        allowed=allowed,
        remedy=remedy,
    )


def _positive(field: str, value: int | None, *, allow_zero: bool = False, upper: int | None = None) -> None:
    if value is None:
        return
    lo = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (upper is not None and value > upper):
        rng = f"an integer in [{lo}, {upper}]" if upper else f"an integer >= {lo}"
        _bad(field, value, [rng], f"set {field} to {rng}")


def check_attention_args(a: Any) -> None:
    """Type and domain checks of single fields of :class:`AttentionArgs` (raises ConfigError)."""
    # sizes first: their check names the range for any value, the same one the env vars get
    check_size("zbal_local_mem_size", a.zbal_local_mem_size, allow_zero=True)
    check_size("flashinfer_workspace_size", a.flashinfer_workspace_size, allow_zero=False)
    _positive("page_size", a.page_size, upper=MAX_PAGE_SIZE)
    _positive("sm_group_num", a.sm_group_num)  # above the SM count: refused at resolve, naming it
    _positive("cuda_graph_max_bs", a.cuda_graph_max_bs, upper=MAX_POOL_DIM)
    for field in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        _positive(field, getattr(a, field), upper=MAX_SPEC)
    _positive("attn_dp_size", a.attn_dp_size, upper=MAX_POOL_DIM)
    _positive("tp_size", a.tp_size, upper=MAX_POOL_DIM)
    _positive("pp_size", a.pp_size, upper=MAX_POOL_DIM)
    check_types(a)
    if a.cuda_graph_bs is not None:
        if not isinstance(a.cuda_graph_bs, (list, tuple)):
            _bad("cuda_graph_bs", a.cuda_graph_bs, ["a list of positive integers"], "pass batch sizes as a list")
        if len(set(a.cuda_graph_bs)) != len(a.cuda_graph_bs):
            _bad("cuda_graph_bs", a.cuda_graph_bs, ["distinct batch sizes"], "list each batch size once")
        if not a.cuda_graph_bs:
            _bad("cuda_graph_bs", a.cuda_graph_bs, ["a non-empty list of positive integers"],
                 "omit cuda_graph_bs to use the defaults, or list at least one batch size")
        for bs in a.cuda_graph_bs:
            _positive("cuda_graph_bs", bs, upper=MAX_POOL_DIM)
    if a.kv_cache_dtype not in KV_CACHE_DTYPES:
        _bad("kv_cache_dtype", a.kv_cache_dtype, KV_CACHE_DTYPES, "pick one of the allowed KV cache dtypes")
    if a.dtype not in MODEL_DTYPES:
        _bad("dtype", a.dtype, MODEL_DTYPES, "pick one of the allowed model dtypes")
    if a.speculative_algorithm is not None and a.speculative_algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        _bad("speculative_algorithm", a.speculative_algorithm, SPECULATIVE_ALGORITHMS,
             "use one of sglang's speculative algorithms, or leave it unset")
    for field in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        if getattr(a, field) is not None and a.speculative_algorithm is None:
            raise ConfigError(f"{field} is set without speculative_algorithm", code="conflicting_options",
                              flags=[(field, getattr(a, field)), ("speculative_algorithm", None)],
                              remedy=f"set speculative_algorithm too, or drop {field}")
    if a.moe_a2a_backend not in MOE_A2A_BACKENDS:
        _bad("moe_a2a_backend", a.moe_a2a_backend, MOE_A2A_BACKENDS, "pick one of sglang's MoE all-to-all backends, "
             "or 'none'")
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                  "speculative_draft_attention_backend"):
        v = getattr(a, field)
        if v is not None and not isinstance(v, str):
            _bad(field, v, ["a backend name (string)"], f"give {field} a backend name such as torch_native")
        if v is not None and (not v or v != v.strip()):
            _bad(field, v, ["a backend name"], f"give {field} a backend name such as torch_native, or omit it")


def check_pool_facts(p: Any) -> None:
    """Type and domain checks of :class:`PoolFacts` (ConfigError): each size in ``[1, 2**31 - 1]`` (int32
    ``req_to_token``)."""
    _positive("pool.max_reqs", p.max_reqs, upper=MAX_POOL_DIM)
    _positive("pool.max_context_len", p.max_context_len, upper=MAX_POOL_DIM)
    _positive("pool.num_token_slots", p.num_token_slots, upper=MAX_POOL_DIM)
    _positive("pool.page_size", p.page_size, upper=MAX_PAGE_SIZE)
    check_types(p, "pool.")
    if p.num_token_slots % p.page_size:
        _bad("pool.num_token_slots", p.num_token_slots, [f"a multiple of page_size={p.page_size}"],
             "round num_token_slots to whole pages")


def check_setup_request(r: Any) -> None:
    """Type and cross-field checks of :class:`SetupRequest` (raises ConfigError)."""
    check_types(r)
    if r.world_size < 1:
        _bad("world_size", r.world_size, ["an integer >= 1"], "set world_size to the number of ranks")
    if not 0 <= r.rank < r.world_size:
        _bad("rank", r.rank, [f"0..{r.world_size - 1}"],
             f"rank must be in [0, world_size): set rank to one of 0..{r.world_size - 1}")
    if r.world_size % r.args.attn_dp_size:
        raise ConfigError(
            f"attn_dp_size={r.args.attn_dp_size} does not divide world_size={r.world_size} (sglang: tp_size must be "
            "divisible by attn_dp_size)", code="conflicting_options",
            flags=[("attn_dp_size", r.args.attn_dp_size), ("world_size", r.world_size)],
            allowed=[f"a divisor of {r.world_size}"],
            remedy=f"set attn_dp_size to a divisor of world_size={r.world_size}, or world_size to a multiple of it")
    from pipeline.core.shard import check_world

    check_world(r.args.tp_size, r.args.pp_size, r.world_size)
    r.served_model  # the rank's shard: tp_size_invalid / pp_size_invalid before anything is allocated
    if r.pool.page_size != r.args.page_size:
        raise ConfigError(
            f"pool.page_size={r.pool.page_size} differs from page_size={r.args.page_size}",
            code="conflicting_options",
            flags=[("page_size", r.args.page_size), ("pool.page_size", r.pool.page_size)],
            remedy="size the KV pool with the same page_size the backends are asked to use",
        )
    check_draft_fields(r)
    check_device(r.device)
    check_spelling(r.device, r.device_spelled_as)

