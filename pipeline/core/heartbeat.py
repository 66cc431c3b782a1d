"""A periodic beat while a long step runs (JIT compiles, graph capture): one lazily started daemon thread serves every
beat."""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

_cond = threading.Condition()
_active: dict[int, list] = {}  # id → [next_due, every_s, t0, beat]
_ids = itertools.count()
_thread: threading.Thread | None = None


def _serve() -> None:
    while True:
        with _cond:
            now = time.monotonic()
            nxt = min((e[0] for e in _active.values()), default=None)
            if nxt is None or nxt > now:
                _cond.wait(None if nxt is None else nxt - now)
                continue
            due = [e for e in _active.values() if e[0] <= now]
            for e in due:
                e[0] = now + e[1]
        for _, _, t0, beat in due:
            try:
                beat(now - t0)
            except Exception:  # noqa: BLE001 - a failing beat must not kill the shared thread
                pass


def _ensure_thread() -> None:
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_serve, name="attn-setup-heartbeat", daemon=True)
        _thread.start()


@contextmanager
def beating(every_s: float, beat: Callable[[float], None], name: str = "") -> Iterator[None]:
    """Call ``beat(elapsed_s)`` every ``every_s`` seconds while the body runs (``name``: debugging); stops when it ends.
    """
    t0 = time.monotonic()
    key = next(_ids)
    with _cond:
        _ensure_thread()
        _active[key] = [t0 + every_s, every_s, t0, beat]
        _cond.notify()
    try:
        yield
    finally:
        with _cond:
            _active.pop(key, None)


# What this process is busy with, for the heartbeats many ranks publish (pipeline.setup.rank_watch).
_doing_lock = threading.Lock()
_doing: list[str] = []  # a stack: the innermost thing this process is busy with


@contextmanager
def doing(what: str) -> Iterator[None]:
    """Mark this process as busy with ``what`` (e.g. ``"compiling flashinfer variant X"``) while the
    body runs; heartbeats carry the innermost mark. Cheap (a lock and a list append); setup-time only."""
    with _doing_lock:
        _doing.append(what)
    try:
        yield
    finally:
        with _doing_lock:
            if what in _doing:
                _doing.reverse()
                _doing.remove(what)
                _doing.reverse()


def current_doing() -> str:
    """The innermost :func:`doing` mark of this process, ``""`` when none."""
    with _doing_lock:
        return _doing[-1] if _doing else ""
