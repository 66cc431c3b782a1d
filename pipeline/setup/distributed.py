"""Many ranks under torch.distributed: one run id, each rank on its own device, one agreed resolution.

Details: docs/internals.md, ``pipeline.setup.distributed``.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

import msgspec

from pipeline.core import events as ev
from pipeline.core.contracts import ATTENTION_LAYER_TYPES, AttentionArgs, DeviceFacts, ErrorInfo, Resolution
from pipeline.core.errors import ConfigError, MemoryImbalance, RankDivergence, RankExchangeError, UsageError
from pipeline.core.events import RankRow
from pipeline.core.numbers import ascii_float
from pipeline.core.value_text import value_text


MAY_DIFFER = ("rank", "local_rank", "device index", "host", "pid", "model config path (source)", "trace path",
              "timestamps")
DEFAULT_MAX_IMBALANCE = 0.10  # sglang: min_free < 0.9 * local_free is refused
ENV_MAX_IMBALANCE = "ATTN_SETUP_MAX_MEMORY_IMBALANCE"
FLAG_MAX_IMBALANCE = "--max-memory-imbalance"


def _sha(obj: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(obj, order="deterministic")).hexdigest()[:16]


def _model_text(model: Any, layers_apart: bool = False) -> str:
    if model is None:
        return "none"
    rec = msgspec.to_builtins(model)
    rec.pop("source", None)  # the file path may differ between hosts; the content may not
    if layers_apart:  # compared as ``num_layers`` (:func:`_layers_text`): a different --num-layers is not a model
        rec.pop("num_hidden_layers", None)
        rec.pop("layer_types", None)
    return f"{model.model_type} {'/'.join(model.architectures or [])} sha256:{_sha(rec)}"


def _layers_text(model: Any) -> str:
    """The layers the served model spans (``--num-layers`` cuts them) and a hash of their kinds; a pipeline stage
    (its own layers: :mod:`pipeline.core.shard`) says ``whole stage`` or how many attention layers it builds."""
    lay = model.shard
    if lay is not None and lay.pp_size > 1:
        s, e = lay.layer_range
        built = sum(1 for t in model.layer_types if t in ATTENTION_LAYER_TYPES)
        return "whole stage" if model.num_hidden_layers == e - s else f"first {built} attention layers of each stage"
    return f"{model.num_hidden_layers} layers, kinds sha256:{_sha(list(model.layer_types or []))}"


def _served_text(model: Any) -> str:
    """The served model as every rank must share it: a shard is named by its whole model (the heads and layers
    each rank holds differ; the layout is compared as ``shard``)."""
    if model.shard is None:
        return _model_text(model, layers_apart=True)
    return f"{model.model_type} {'/'.join(model.architectures or [])} sha256:{model.shard.model_sha}"


def _capabilities_text() -> str:
    from pipeline.backends import registry

    return "sha256:" + _sha({n: msgspec.to_builtins(registry.get(n).capability) for n in registry.names()})


def digest_fields(request: Any, installed: Mapping[str, bool], device: Any = None) -> dict[str, str]:
    """``{field: text}`` of what must be equal on every rank (docs/internals.md), for ``request``
    (a :class:`~pipeline.core.contracts.SetupRequest`), the package presence ``installed`` and the rank's
    ``device`` facts (the default capture sizes follow its memory: :func:`states.build_mode.graph_top`).

    Values are short texts so the divergence table shows them; a value that cannot be computed
    (an invalid dtype, a graph list the pool cannot hold) reads ``error: <code>`` — that rank's
    own check reports it, and the other ranks see the difference."""
    from states.build_mode import batch_sizes_text
    from pipeline.core.errors import AttnSetupError
    from pipeline.core.eventlog import versions
    from states.capability_check import kv_dtype, model_dtype

    args, pool = request.args, request.pool

    def safe(fn: Any) -> str:
        try:
            return str(fn())
        except AttnSetupError as e:
            return f"error: {e.info.code}"

    served = request.served_model
    out = {"model": _served_text(served), "num_layers": _layers_text(served),
           "shard": "whole model" if served.shard is None else served.shard.grid_text(),
           "draft_model": _model_text(request.draft_model),
           "is_draft_worker": str(request.is_draft_worker).lower()}
    for f in pool.__struct_fields__:
        if f != "page_size":  # validation makes it equal to args.page_size, compared as that
            out[f"pool.{f}"] = str(getattr(pool, f))
    out["dtype.model"] = safe(lambda: model_dtype(args, request.served_model))
    out["dtype.kv_cache"] = safe(lambda: kv_dtype(args, request.served_model))
    out["cuda_graph_bs"] = ("disabled" if args.disable_cuda_graph else
                            safe(lambda: batch_sizes_text(args, pool.max_reqs, device=device,
                                                         world_size=request.tp_size)))
    for k, v in sorted(versions(installed).items()):
        out[f"versions.{k}"] = str(v)
    out["capabilities"] = _capabilities_text()
    return out


def max_imbalance_from(value: Optional[float], environ: Mapping[str, str] = os.environ) -> float:
    """The allowed spread: ``value`` (the flag) when given, else ``ATTN_SETUP_MAX_MEMORY_IMBALANCE``,
    else 0.10. A fraction in [0, 1] of the largest rank's free bytes (1 turns the check off).

    Raises :class:`UsageError` naming the flag or variable when it is not such a number."""
    name, raw = FLAG_MAX_IMBALANCE, value
    if value is None:
        name, text = ENV_MAX_IMBALANCE, environ.get(ENV_MAX_IMBALANCE, "").strip()
        if not text:
            return DEFAULT_MAX_IMBALANCE
        try:
            raw = ascii_float(text)   # ASCII only, as the flag: '٣' is not 3
        except ValueError:
            raw = text
    ok = isinstance(raw, (int, float)) and not isinstance(raw, bool) and 0.0 <= raw <= 1.0
    if not ok:
        shown = text if value is None else raw   # the variable as it was set, not its float's repr
        raise UsageError(f"{name} {shown!r} is not a fraction in [0, 1]", flags=[(name, str(shown))],
                         allowed=["0 <= fraction <= 1 (0.1 = sglang's rule; 1 = no check)"],
                         remedy=f"pass {FLAG_MAX_IMBALANCE} 0.1 (or unset {ENV_MAX_IMBALANCE})")
    return float(raw)  # type: ignore[arg-type]


def check_memory_balance(free_bytes: list[int], max_imbalance: float, *, rank: int,
                         device: str = "") -> None:
    """Refuse a launch whose ranks' free device memory differs too much.

    ``free_bytes[r]``: rank r's free bytes at device-init (``Platform.memory_available``). Passes when
    ``min >= (1 - max_imbalance) * max`` (sglang: ``min_free >= 0.9 * local_free``). Otherwise raises
    :class:`MemoryImbalance` (every rank, same numbers) naming the lowest rank, its bytes, the
    largest and the threshold."""
    hi, lo = max(free_bytes), min(free_bytes)
    if lo >= (1.0 - max_imbalance) * hi:
        return
    low = free_bytes.index(lo)
    gib = 1 << 30
    per = ", ".join(f"rank {r}={b / gib:.2f} GiB" for r, b in enumerate(free_bytes))
    raise MemoryImbalance(
        f"free device memory differs between ranks by {(hi - lo) / hi:.0%} (allowed {max_imbalance:.0%}): rank {low} "
        f"has {lo / gib:.2f} GiB free, the most is {hi / gib:.2f} GiB — seen from rank {rank}; {per}",
        state="device-init",
        flags=[("low_rank", low), ("free_bytes", {str(r): b for r, b in enumerate(free_bytes)}),
               ("max_imbalance", max_imbalance), ("min_allowed_bytes", int((1.0 - max_imbalance) * hi))]
        + ([("device", device)] if device else []),
        allowed=[f"every rank's free memory >= {1.0 - max_imbalance:.0%} of the largest"],
        remedy=f"free rank {low}'s device (another process holds memory there: check nvidia-smi), or allow a larger "
               f"spread with {FLAG_MAX_IMBALANCE} / {ENV_MAX_IMBALANCE} (1 turns the check off)")


DEFAULT_TIMEOUT_S = 60.0


class RankReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one rank sends: where it runs, the pair it resolved (or its resolve error) and its args."""

    rank: int
    host: str
    device: DeviceFacts
    resolution: Optional[Resolution] = None
    error: Optional[ErrorInfo] = None
    args: Optional[AttentionArgs] = None
    digest: dict[str, str] = {}  # pipeline.setup.distributed.digest_fields: everything else that must match


def _row(r: RankReport) -> RankRow:
    if r.resolution is None:
        return RankRow(rank=r.rank, host=r.host, device=r.device.device_str, prefill="-", decode="-",
                       error=r.error.code if r.error else "missing")
    p = r.resolution.pair
    return RankRow(rank=r.rank, host=r.host, device=r.device.device_str, prefill=p.prefill, decode=p.decode,
                   is_draft_override=p.is_draft_override)


def gather(payload: Any, group: Any, rank: int, world_size: int, timeout_s: float, *, watch: Any = None,
           what: str = "the resolution exchange", state: str = "resolve") -> list[Any]:
    """all_gather of each rank's ``payload`` (a picklable object) over the gloo group.

    With a :class:`~pipeline.setup.rank_watch.Watch` every rank first arrives through the store and a rank
    missing after ``timeout_s`` is named (:class:`~pipeline.core.errors.RankStalled`, exit 1, after
    ``rank_stalled`` records); without one torch's ``monitored_barrier`` bounds the wait
    (:class:`RankExchangeError`)."""
    import torch.distributed as dist

    try:
        if watch is not None:
            watch.wait_all(what, state)
        else:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, payload, group=group)
    except RuntimeError as e:
        raise RankExchangeError(
            f"rank {rank}: not every rank joined {what} within {timeout_s:g} s: {e}",
            state=state, flags=[("rank", rank), ("world_size", world_size), ("timeout_s", timeout_s)],
            remedy="look at the other ranks' logs for the failure that kept them away; raise timeout_s for "
                   "slow starts") from e
    return out


def _diverging(reports: list[RankReport]) -> list[str]:
    """Names of what differs between ranks: ``resolve_error``, ``pair``, ``args.<field>``, ``device``."""
    out = []
    if any(r.resolution is None for r in reports):
        out.append("resolve_error")
    pairs = {msgspec.json.encode(r.resolution.pair) for r in reports if r.resolution is not None}
    if len(pairs) > 1:
        out.append("pair")
    given = [r.args for r in reports if r.args is not None]
    for f in AttentionArgs.__struct_fields__:
        if len({msgspec.json.encode(getattr(a, f)) for a in given}) > 1:
            out.append(f"args.{f}")
    digests = [r.digest for r in reports if r.digest]
    for f in sorted({k for d in digests for k in d}):
        if len({d.get(f, "missing") for d in digests}) > 1:
            out.append(f)
    seen: dict[tuple[str, str], int] = {}
    for r in reports:
        if r.device.type == "cpu":
            continue
        key = (r.host, r.device.device_str)
        if key in seen:
            out.append("device")
            break
        seen[key] = r.rank
    return out


def table_text(rows: list[RankRow]) -> str:
    """The rank table as aligned text (rank, host, device, prefill, decode, error)."""
    head = ("rank", "host", "device", "prefill", "decode", "error")
    body = [(str(r.rank), r.host, r.device, r.prefill, r.decode, r.error or "") for r in rows]
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(line)).rstrip() for line in [head, *body])


def agree_on_resolution(resolution: Optional[Resolution], device_facts: DeviceFacts, *, group: Any, rank: int,
                        world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                        args: Optional[AttentionArgs] = None, error: Optional[ErrorInfo] = None,
                        host: Optional[str] = None, digest: Optional[dict[str, str]] = None,
                        watch: Any = None) -> list[RankRow]:
    """Exchange this rank's resolution with every rank; return the table when all agree.

    Parameters
    ----------
    resolution : this rank's resolve result, or None when its resolve failed (then give ``error``).
    device_facts : this rank's device (``device_facts.device_str`` goes into the table).
    group : a gloo process group (the CPU group of :class:`RankGroup`); None = the default group.
    rank, world_size : this rank and the group size; ``world_size == 1`` returns at once.
    timeout_s : seconds to wait for every rank to arrive (then :class:`RankExchangeError`).
    args : the attention args; every field must match across ranks (``page_size``, backends …).
    error : this rank's own resolve error; a rank that passes one gets the table back and should
        re-raise its own error, while every other rank raises :class:`RankDivergence` naming it.
    digest : ``{field: text}`` of everything else that must match (model, draft model, pool facts,
        dtypes, CUDA-graph batch list, versions, capability records:
        :func:`pipeline.setup.distributed.digest_fields`); each differing field is named with every rank's value.
    watch : a :class:`pipeline.setup.rank_watch.Watch`: the wait names a stalled rank (``rank_stalled``).

    Returns the rows (one :class:`RankRow` per rank, in rank order).
    Raises :class:`RankDivergence` on every rank (same table) when pairs, args or devices differ.
    """
    host = host if host is not None else socket.gethostname()
    mine = RankReport(rank=rank, host=host, device=device_facts, resolution=resolution, error=error, args=args,
                      digest=dict(digest or {}))
    if world_size <= 1:
        return [_row(mine)]
    blobs = gather(msgspec.msgpack.encode(mine), group, rank, world_size, timeout_s, watch=watch)
    dec = msgspec.msgpack.Decoder(RankReport)
    reports = [dec.decode(b) for b in blobs]
    rows = [_row(r) for r in reports]
    bad = _diverging(reports)
    if not bad or error is not None:  # agreed, or this rank re-raises its own resolve error
        return rows
    raise _divergence(rank, rows, reports, bad)


# The CUDA-graph flags: when none differs, a differing capture list follows from the pool (derived_fields).
_GRAPH_ARGS = ("args.cuda_graph_bs", "args.cuda_graph_max_bs", "args.disable_cuda_graph")
DERIVED_WORDS = {"cuda_graph_bs": "the decode batch sizes to capture", "dtype.model": "the model dtype",
                 "dtype.kv_cache": "the KV cache dtype"}  # a derived field in the message's words
_DTYPE_ARGS = {"dtype.model": "args.dtype", "dtype.kv_cache": "args.kv_cache_dtype"}


def derived_fields(bad: list[str]) -> dict[str, str]:
    """``{field: the field it follows from}`` among the differing fields ``bad``, so that the rank error names the
    field the user set and these as derived:

    - ``cuda_graph_bs`` (the capture list) when ``args.cuda_graph_bs`` itself does not differ: from
      ``args.cuda_graph_max_bs`` or ``args.disable_cuda_graph`` when one of them differs, else from
      ``pool.max_reqs`` when that differs (the list's default top follows the rows);
    - ``dtype.model`` / ``dtype.kv_cache`` (the resolved dtypes) from ``args.dtype`` / ``args.kv_cache_dtype`` when
      that differs too (they were listed as fields to change of their own)."""
    out: dict[str, str] = {}
    if "cuda_graph_bs" in bad and "args.cuda_graph_bs" not in bad:
        src = next((g for g in _GRAPH_ARGS[1:] if g in bad), "pool.max_reqs" if "pool.max_reqs" in bad else None)
        if src is not None:
            out["cuda_graph_bs"] = src
    out.update({f: src for f, src in _DTYPE_ARGS.items() if f in bad and src in bad})
    return out


def _divergence(rank: int, rows: list[RankRow], reports: list[RankReport], bad: list[str]) -> RankDivergence:
    failed = [r for r in reports if r.error is not None]
    why = "; ".join(f"rank {r.rank} refused: [{r.error.code}] {r.error.message}" for r in failed)
    per_arg = {b: {str(r.rank): getattr(r.args, b[len("args."):]) for r in reports if r.args is not None}
               for b in bad if b.startswith("args.")}
    per_arg.update({b: {str(r.rank): r.digest.get(b, "missing") for r in reports if r.digest}
                    for b in bad if b not in per_arg and b not in ("resolve_error", "pair", "device")})
    derived = derived_fields(bad)
    lines = [(f"{DERIVED_WORDS[f]} (derived from {derived[f]})" if f in derived else f) + ": "
             + value_text(vals) for f, vals in per_arg.items()]   # "rank 0: 8; rank 1: 16", no Python reprs
    msg = (f"the {len(rows)} ranks disagree on {', '.join(b for b in bad if b not in derived)}"
           + "".join(f" (and so on {DERIVED_WORDS[f]}, derived from {src})" for f, src in derived.items())
           + (f" ({why})" if why else "")
           + f" — seen from rank {rank}:\n" + table_text(rows) + "".join("\n" + x for x in lines))
    flags: list[tuple[str, Any]] = [("diverging", bad)] + ([("derived", derived)] if derived else [])
    flags += [(f"rank[{r.rank}]", {"host": r.host, "device": r.device, "prefill": r.prefill, "decode": r.decode,
                                   **({"error": r.error} if r.error else {})}) for r in rows]
    flags += list(per_arg.items())
    remedy = ("fix the failing rank's error first (its own log has the remedy)" if failed else
              "launch every rank with the same flags, model, pool sizes and package versions, on devices that "
              "resolve the same backends (one device per rank); pin prefill_attention_backend and "
              "decode_attention_backend if the hardware differs")
    return RankDivergence(msg, state="resolve", flags=flags, allowed=["every rank the same"], remedy=remedy)


ACCELERATORS = ("cuda", "musa", "npu", "xpu")


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the launch.

    ``cpu_group``: a gloo process group (created with ``timeout=timeout_s``) for the exchange and
    NPU zbal init; ``device``: the device this rank must initialise (``cuda:LOCAL_RANK``);
    ``run_id``: the same on every rank; ``owns_process_group``: :func:`init_from_env` initialised
    the default group (so :meth:`close` destroys it); ``store``: the default group's key-value store,
    where ranks publish heartbeats and arrivals so a stalled rank is named (None: torch's
    ``monitored_barrier`` alone).
    """

    rank: int
    world_size: int
    local_rank: int
    cpu_group: Any
    run_id: str
    device: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    host: str = ""
    owns_process_group: bool = False
    max_memory_imbalance: float = 0.1  # device-init's allowed free-memory spread (pipeline.setup.distributed)
    store: Any = None  # the rendezvous key-value store: heartbeats and arrivals (pipeline.setup.rank_watch)

    def close(self) -> None:
        """Destroy the default process group if :func:`init_from_env` created it."""
        if self.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


_LAUNCH_REMEDY = "launch with torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
MAX_WORLD_SIZE = 1 << 20
MAX_TIMEOUT_S = 86400.0


def _env_int(environ: Mapping[str, str], name: str, default: int, *, lo: int = 0, hi: int = MAX_WORLD_SIZE) -> int:
    """``int(environ[name])`` in ``[lo, hi]`` (``default`` when unset or empty); UsageError naming it otherwise."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    text = raw.strip()
    value = int(text) if re.fullmatch(r"[+-]?[0-9]{1,9}", text, re.ASCII) else None
    if value is None or not lo <= value <= hi:
        raise UsageError(f"environment variable {name}={raw[:40]!r} is not an integer in [{lo}, {hi}]",
                         flags=[(name, raw[:40])], allowed=[f"an integer in [{lo}, {hi}]"], remedy=_LAUNCH_REMEDY)
    return value


def check_launch_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's variables, each checked whenever it is set.

    ``WORLD_SIZE`` >= 1 (default 1), ``RANK`` in ``0..WORLD_SIZE-1`` (default 0), ``LOCAL_RANK`` >= 0
    (default RANK); with ``WORLD_SIZE > 1`` the ``env://`` rendezvous also needs ``MASTER_ADDR``
    (a host name or address) and ``MASTER_PORT`` (1..65535), as torch's env rendezvous reads them.
    Raises :class:`UsageError` (exit 2) naming the variable, its value and what is allowed, before
    torch.distributed is touched.
    """
    world = _env_int(environ, "WORLD_SIZE", 1, lo=1)
    rank = _env_int(environ, "RANK", 0)
    local = _env_int(environ, "LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} is outside 0..{world - 1}", flags=[("RANK", rank), ("WORLD_SIZE", world)],
                         allowed=[f"0..{world - 1}"], remedy=_LAUNCH_REMEDY)
    if world > 1:
        addr = environ.get("MASTER_ADDR", "").strip()
        if not addr:
            raise UsageError(f"WORLD_SIZE={world} but MASTER_ADDR is not set: the ranks cannot find rank 0",
                             code="rendezvous_unset", flags=[("MASTER_ADDR", environ.get("MASTER_ADDR")),
                                                             ("WORLD_SIZE", world)],
                             allowed=["rank 0's host name or IP address"],
                             remedy="export MASTER_ADDR=<rank 0's host> MASTER_PORT=<a free port> on every rank, "
                                    "or " + _LAUNCH_REMEDY)
        if environ.get("MASTER_PORT", "").strip() == "":
            raise UsageError(f"WORLD_SIZE={world} but MASTER_PORT is not set: the ranks cannot find rank 0",
                             code="rendezvous_unset", flags=[("MASTER_PORT", environ.get("MASTER_PORT")),
                                                             ("WORLD_SIZE", world)], allowed=["1..65535"],
                             remedy="export MASTER_PORT=<a free port> on every rank, or " + _LAUNCH_REMEDY)
        _env_int(environ, "MASTER_PORT", 0, lo=1, hi=65535)
    return rank, world, local


def check_timeout(timeout_s: Any, name: str = "--dist-timeout") -> float:
    """``timeout_s`` as float seconds in (0, 86400]; UsageError naming ``name`` otherwise."""
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
    if not ok or not 0 < timeout_s <= MAX_TIMEOUT_S:  # nan fails the comparison too
        raise UsageError(f"{name} {timeout_s!r} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]",
                         flags=[(name, timeout_s if ok else repr(timeout_s))],
                         allowed=[f"0 < seconds <= {MAX_TIMEOUT_S:g}"], remedy=f"pass {name} 60")
    return float(timeout_s)


def _dist_message(e: BaseException) -> str:
    """torch.distributed's error without the C++ frames it appends."""
    text = str(e).split("Exception raised from")[0].strip()
    return text if len(text) <= 300 else text[:297] + "..."


def rank_device(device: str, local_rank: int, *, cuda_available: Optional[bool] = None) -> str:
    """The device this rank initialises: an accelerator without index gets ``LOCAL_RANK``.

    ``auto`` → ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``; ``cuda`` → ``cuda:LOCAL_RANK``
    (likewise musa/npu/xpu); an explicit ``cuda:N`` or ``cpu`` is kept (an engine's own mapping,
    e.g. sglang's ``base_gpu_id + tp_rank``).
    """
    head, _, idx = device.partition(":")
    if head == "auto":
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        head = "cuda" if cuda_available else "cpu"
    if head in ACCELERATORS and not idx:
        return f"{head}:{local_rank}"
    return device if head != "cpu" else "cpu"


def check_rank_device(device: str, device_type: str, group: RankGroup, *, rank: Optional[int] = None,
                      world_size: Optional[int] = None) -> None:
    """device-init's guard: the request's rank/world size are the group's, and on an accelerator
    with ``world_size > 1`` the request's device names an index and is the rank group's device,
    so no rank lands on device 0 by accident.

    Raises :class:`ConfigError` (``rank_mismatch`` / ``rank_device_mismatch``) naming both values.
    """
    for name, mine, theirs in (("rank", rank, group.rank), ("world_size", world_size, group.world_size)):
        if mine is not None and mine != theirs:
            raise ConfigError(f"the request says {name}={mine} but the process group says {theirs}",
                              code="rank_mismatch", state="device-init", flags=[(name, mine)], allowed=[str(theirs)],
                              remedy=f"build the SetupRequest with {name}={theirs} (from the RankGroup)")
    if group.world_size <= 1 or device_type == "cpu":
        return
    head, _, idx = device.partition(":")
    want = group.device
    if idx and (want.partition(":")[2] == "" or device == want):
        return
    raise ConfigError(
        f"rank {group.rank} (LOCAL_RANK={group.local_rank}) asked for device {device!r}, "
        f"but its own device is {want!r}" + ("" if idx else f"; {device!r} without an index means {head}:0 on every rank"),
        code="rank_device_mismatch", state="device-init",
        flags=[("device", device), ("rank", group.rank), ("local_rank", group.local_rank)], allowed=[want],
        remedy=f"pass device={want!r} (init_from_env() picks {head}:LOCAL_RANK), or give each rank its own index")


def init_from_env(device: str = "auto", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                  environ: Mapping[str, str] = os.environ,
                  max_memory_imbalance: Optional[float] = None) -> Optional[RankGroup]:
    """Join the launch described by torchrun's environment; None when ``WORLD_SIZE`` is 1 or unset.

    Initialises the default (world) process group — NCCL when the rank's device is CUDA, gloo
    otherwise (``env://``, ``timeout=timeout_s``) — unless the engine already did, then creates a gloo CPU group with the same timeout and broadcasts rank 0's
    run id over it. Every rank must call this (group creation is collective).
    ``timeout_s`` also bounds every later wait of ours (memory exchange, agreement, pre-capture
    barrier: a rank missing after it is named ``rank_stalled``). ``max_memory_imbalance``: the
    allowed spread of free device memory at device-init (None: ``ATTN_SETUP_MAX_MEMORY_IMBALANCE``,
    else sglang's 0.1; :func:`pipeline.setup.distributed.max_imbalance_from`).

    Raises :class:`UsageError` (exit 2) for a malformed or missing ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (:func:`check_launch_env`) or timeout, and
    :class:`RankExchangeError` (``rank_exchange_failed``, exit 1) when the rendezvous or the run-id
    broadcast fails or does not complete within ``timeout_s`` seconds (rank 0 unreachable, a rank
    not launched) — torch's own error, without its C++ frames, is in the message.
    """
    rank, world, local = check_launch_env(environ)
    if world <= 1:
        return None
    timeout_s = check_timeout(timeout_s, "timeout_s")

    spread = max_imbalance_from(max_memory_imbalance, environ)
    import torch.distributed as dist

    td = timedelta(seconds=timeout_s)
    dev = rank_device(device, local)
    owns = not dist.is_initialized()
    where = f"{environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}"
    try:
        if owns:  # the world group: NCCL between GPUs (as engines run), gloo on CPU; exchanges use the gloo CPU group
            dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo", rank=rank, world_size=world,
                                    timeout=td)
        cpu_group = dist.new_group(backend="gloo", timeout=td)
        run_id = _shared_run_id(cpu_group, rank)
    except (RuntimeError, ValueError) as e:  # DistError/DistStoreError/DistNetworkError are RuntimeErrors
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise RankExchangeError(
            f"rank {rank}: the rendezvous at MASTER_ADDR:MASTER_PORT={where} did not complete within "
            f"{timeout_s:g} s: {_dist_message(e)}", state="init-distributed",
            flags=[("MASTER_ADDR", environ.get("MASTER_ADDR")), ("MASTER_PORT", environ.get("MASTER_PORT")),
                   ("rank", rank), ("world_size", world), ("timeout_s", timeout_s)],
            remedy="start every rank (torchrun starts all of them) with MASTER_ADDR/MASTER_PORT pointing at rank 0's "
                   "host and a free port; raise --dist-timeout for slow starts") from None
    return RankGroup(rank=rank, world_size=world, local_rank=local, cpu_group=cpu_group, run_id=run_id,
                     device=dev, timeout_s=timeout_s, host=socket.gethostname(),
                     owns_process_group=owns, store=_default_store(), max_memory_imbalance=spread)


def _default_store() -> Any:
    """The default process group's store (torch keeps it private: None when this torch has no accessor)."""
    from torch.distributed import distributed_c10d as c10d

    getter = getattr(c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _shared_run_id(cpu_group: Any, rank: int) -> str:
    """Rank 0's run id (launcher's id when set, else a fresh one), broadcast to every rank."""
    import torch.distributed as dist

    from pipeline.core.eventlog import new_run_id

    box = [new_run_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
    return str(box[0])


def balance_memory(run: Any, index: int) -> None:
    """Exchange and check free device memory for the pipeline run ``run`` (a :class:`~pipeline.setup.context.SetupContext`) on device ``index``.

    Raises :class:`~pipeline.core.errors.MemoryImbalance` (every rank) or
    :class:`~pipeline.core.errors.RankStalled` (a rank did not arrive within the group's ``timeout_s``)."""

    g, req = run.rank_group, run.request
    reader = getattr(run.platform, "memory_available", None)
    free = None if run.platform.device_type == "cpu" or reader is None else reader(index)
    t = time.perf_counter()
    got = gather(None if free is None else int(free), g.cpu_group, req.rank, req.world_size, g.timeout_s,
                 watch=run.watch, what="the memory exchange", state="device-init")
    if any(x is None for x in got):
        run.log.emit(ev.StepSkipped, state=run.state, outcome="skipped", what="memory_balance",
                     reason="no free device memory to compare on " + ", ".join(
                         f"rank {r}" for r, x in enumerate(got) if x is None) + " (CPU ranks share the host)")
        return
    limit = getattr(g, "max_memory_imbalance", None)
    limit = 0.1 if limit is None else limit
    check_memory_balance(list(got), limit, rank=req.rank, device=req.device)
    run.log.emit(ev.MemoryBalanced, state=run.state, free_bytes=list(got), max_imbalance=limit,
                 duration_ms=(time.perf_counter() - t) * 1e3)

