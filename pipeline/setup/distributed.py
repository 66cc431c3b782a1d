"""Many ranks under torch.distributed: one run id, each rank on its own device, one agreed resolution.

What engines already run (``torchrun``, or their own launcher setting ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``):

- :func:`init_from_env` joins the process group (gloo when nothing is initialised yet), makes a
  gloo **CPU group** with a timeout, agrees on one run id (rank 0's, broadcast over that group;
  rank 0 takes ``ATTN_SETUP_RUN_ID`` / ``TORCHELASTIC_RUN_ID`` when set) and picks the rank's own
  device (``cuda`` / ``auto`` → ``cuda:LOCAL_RANK``), returning a :class:`RankGroup`.
- :func:`check_rank_device` (device-init) refuses a device string that would put this rank on
  another rank's device, e.g. a bare ``cuda`` that means ``cuda:0`` on every rank.
- :func:`agree_on_resolution` (resolve) exchanges msgspec-encoded reports (resolved pair, attention
  args, device, host) over the CPU group. Every rank compares the same gathered table, so either
  all ranks agree or all raise :class:`~pipeline.core.errors.RankDivergence` carrying the table
  rank → host → device → pair. A rank that does not arrive within ``timeout_s`` makes the others
  raise :class:`~pipeline.core.errors.RankExchangeError` instead of hanging.

torch is imported lazily (only :func:`init_from_env` and the exchange need it).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

from pipeline.core.contracts import AttentionArgs, DeviceFacts, ErrorInfo, Resolution  # noqa: F401 (as before)
from pipeline.core.errors import ConfigError, RankDivergence, RankExchangeError, UsageError  # noqa: F401
from pipeline.core.events import RankRow  # noqa: F401 (reachable here before the split)
from pipeline.setup.rank_exchange import (  # noqa: F401 (the exchange, re-exported: this module held it)
    DEFAULT_TIMEOUT_S, RankReport, _diverging, _divergence, _row, agree_on_resolution, gather, table_text,
)

__all__ = ["RankGroup", "init_from_env", "rank_device", "check_rank_device", "agree_on_resolution",
           "RankReport", "DEFAULT_TIMEOUT_S", "check_launch_env", "check_timeout"]

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
    max_memory_imbalance: float = 0.1  # device-init's allowed free-memory spread (pipeline.setup.rank_digest)
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
    else sglang's 0.1; :func:`pipeline.setup.rank_digest.max_imbalance_from`).

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
    from pipeline.setup.rank_digest import max_imbalance_from

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

    from pipeline.core.runinfo import new_run_id

    box = [new_run_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
    return str(box[0])
