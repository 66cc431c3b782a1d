"""The resolution exchange between ranks (resolve, under torch.distributed): each rank's report (host, device,
resolved pair or its resolve error, attention args, digest of everything else that must match) gathered over the
gloo CPU group; every rank compares the same table, so all agree or all raise
:class:`~pipeline.core.errors.RankDivergence`; a rank that does not arrive in time makes the others raise
:class:`~pipeline.core.errors.RankExchangeError` (or :class:`~pipeline.core.errors.RankStalled` with a watch).
Import from :mod:`pipeline.setup.distributed`; torch is imported only when ranks are exchanged.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, Optional

import msgspec

from pipeline.core.value_text import value_text
from pipeline.core.contracts import AttentionArgs, DeviceFacts, ErrorInfo, Resolution
from pipeline.core.errors import RankDivergence, RankExchangeError
from pipeline.core.events import RankRow

DEFAULT_TIMEOUT_S = 60.0


class RankReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one rank sends: where it runs, the pair it resolved (or its resolve error) and its args."""

    rank: int
    host: str
    device: DeviceFacts
    resolution: Optional[Resolution] = None
    error: Optional[ErrorInfo] = None
    args: Optional[AttentionArgs] = None
    digest: dict[str, str] = {}  # pipeline.setup.rank_digest.digest_fields: everything else that must match


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
        :func:`pipeline.setup.rank_digest.digest_fields`); each differing field is named with every rank's value.
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
      that differs too (adversarial pass #5: they were listed as fields to change of their own)."""
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
