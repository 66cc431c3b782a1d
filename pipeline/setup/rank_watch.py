"""Waits between ranks that never hang and name the rank that stalls (docs/internals.md)."""

from __future__ import annotations

import json
import os

from pipeline.core.numbers import ascii_float
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

from pipeline.core.errors import RankStalled, UsageError
from pipeline.core.heartbeat import current_doing, doing  # noqa: F401 (re-exported: what a rank is busy with)

__all__ = ["Watch", "watch_for", "doing", "current_doing", "heartbeat_interval", "ENV_TIMEOUT", "timeout_from_env"]

ENV_TIMEOUT = "ATTN_SETUP_DIST_TIMEOUT"
def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats for a wait of ``timeout_s``: a tenth of it, in [0.05, 1.0] s, so a
    stall is reported within ``timeout_s`` plus one interval."""
    return min(1.0, max(0.05, timeout_s / 10.0))


def timeout_from_env(default: float, environ: Any = os.environ) -> float:
    """``ATTN_SETUP_DIST_TIMEOUT`` (seconds, in (0, 86400]) when set, else ``default``. Raises :class:`UsageError`
    naming the variable when it is not such a number."""
    from pipeline.setup.distributed import check_timeout

    raw = environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return default
    remedy = f"export {ENV_TIMEOUT}=60, or unset it (60 s), or pass --dist-timeout 60"  # worded as a variable
    try:
        value = ascii_float(raw)
    except ValueError:
        raise UsageError(f"{ENV_TIMEOUT}={raw[:40]!r} is not a number of seconds", flags=[(ENV_TIMEOUT, raw[:40])],
                         allowed=["0 < seconds <= 86400"], remedy=remedy) from None
    try:
        return check_timeout(value, ENV_TIMEOUT)
    except UsageError as e:  # inf, nan, 0, -1, 1e9: the text as set (inf is no JSON value), the variable's remedy
        raise UsageError(f"{ENV_TIMEOUT}={raw[:40]!r} must be a number of seconds in (0, 86400]",
                         flags=[(ENV_TIMEOUT, raw[:40])], allowed=list(e.info.allowed), remedy=remedy) from None


class Watch:
    """One process's heartbeats and arrival-checked waits within one launch. ``store``: a ``torch.distributed.Store``
    (keys ``attn-setup/<run_id>/…``); ``timeout_s``: before missing ranks are reported. Collectives are numbered in call
    order: every rank makes the same sequence of waits."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, run_id: str = "") -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore(f"attn-setup/{run_id}/", store)
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.every_s = heartbeat_interval(self.timeout_s)
        self.state = "init-distributed"
        self.seq = 0
        self.log: Any = None

    def beat(self, state: Optional[str] = None, what: str = "") -> None:
        """Publish ``{state, t (unix s), doing}`` for this rank; a store error is ignored (the wait reports it)."""
        if state is not None:
            self.state = state
        body = json.dumps({"state": self.state, "t": time.time(), "doing": what or current_doing()})
        try:
            self.store.set(f"hb/{self.rank}", body)
        except Exception:  # noqa: BLE001 - heartbeats are best effort; the waiting side times out
            pass

    @contextmanager
    def running(self, log: Any = None) -> Iterator["Watch"]:
        """Beat every :attr:`every_s` seconds while the body (one pipeline run) runs; ``log`` receives
        ``rank_stalled`` records."""
        from pipeline.core.heartbeat import beating

        self.log = log
        self.beat()
        with beating(self.every_s, lambda _s: self.beat(), name="rank-heartbeat"):
            yield self

    def heard(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s last heartbeat (``{}`` when it never published one)."""
        try:
            if self.store.check([f"hb/{rank}"]):
                return dict(json.loads(self.store.get(f"hb/{rank}")))
        except Exception:  # noqa: BLE001 - a broken store reads as "never heard"
            pass
        return {}

    def wait_all(self, what: str, state: str) -> float:
        """Arrive at the next collective (``what``, in ``state``), wait for every rank and return the seconds waited.
        Raises :class:`RankStalled` after logging ``rank_stalled`` per missing rank."""
        self.seq += 1
        prefix = f"arrive/{self.seq}/"
        self.store.set(prefix + str(self.rank), what)
        t0 = time.monotonic()
        while True:
            missing = [r for r in range(self.world_size) if not self.store.check([prefix + str(r)])]
            waited = time.monotonic() - t0
            if not missing:
                return waited
            if waited >= self.timeout_s:
                raise self._stalled(missing, what, state, waited)
            self.beat(state, f"waiting for rank{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(str, missing))} at {what}")
            try:  # blocks until the first missing rank arrives or a short slice passes
                self.store.wait([prefix + str(missing[0])],
                                timedelta(seconds=min(self.every_s, max(0.01, self.timeout_s - waited))))
            except Exception:  # noqa: BLE001 - the store's timeout: loop, beat and look again
                pass

    def _stalled(self, missing: list[int], what: str, state: str, waited: float) -> RankStalled:
        from pipeline.core import events as ev

        now = time.time()
        rows = []
        for r in missing:
            hb = self.heard(r)
            since = round(now - float(hb["t"]), 3) if "t" in hb else None
            rows.append((r, str(hb.get("state", "never heard")), since, str(hb.get("doing", ""))))
            if self.log is not None:
                self.log.emit(ev.RankStalled, state=state, outcome="failed", stalled_rank=r, last_state=rows[-1][1],
                              seconds_since_heartbeat=since, doing=rows[-1][3], waiting_at=what,
                              waited_s=round(waited, 3))
        desc = "; ".join(f"rank {r} last in state {st!r}" + (f", last heard {s:g} s ago" if s is not None else "")
                         + (f", doing: {d}" if d else "") for r, st, s, d in rows)
        first = rows[0]
        return RankStalled(
            f"rank {self.rank} waited {waited:.1f} s at {what} ({state}) for rank{'s' if len(rows) > 1 else ''} "
            f"{', '.join(str(r[0]) for r in rows)}: {desc}", state=state,
            flags=[("stalled_rank", first[0]), ("last_state", first[1]), ("seconds_since_heartbeat", first[2]),
                   ("doing", first[3]), ("stalled", [dict(zip(("rank", "last_state", "seconds_since_heartbeat",
                                                               "doing"), x)) for x in rows]),
                   ("waiting_at", what), ("timeout_s", self.timeout_s)],
            allowed=[f"every rank at {what} within {self.timeout_s:g} s"],
            remedy=f"read rank {first[0]}'s own log for why it stopped in {first[1]!r}; if it was still making "
                   f"progress (a long JIT compile), raise --dist-timeout / {ENV_TIMEOUT}")


_watches: dict[tuple[str, int, int], Watch] = {}


def watch_for(group: Any) -> Optional[Watch]:
    """The :class:`Watch` of a :class:`~pipeline.setup.distributed.RankGroup` (one per group, so waits stay
    numbered alike on every rank across runs); None without a store (one rank, or a group made by hand)."""
    store = getattr(group, "store", None)
    if group is None or store is None or group.world_size <= 1:
        return None
    key = (group.run_id, group.rank, group.world_size)  # a copy of the group (dataclasses.replace) shares it
    w = _watches.get(key)
    if w is None:
        w = _watches[key] = Watch(store, group.rank, group.world_size, group.timeout_s, group.run_id)
    return w
