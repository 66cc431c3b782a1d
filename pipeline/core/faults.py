"""Test-only fault injection: make a run fail at a named point, to check cleanup and error records (docs/internals.md).
"""

from __future__ import annotations

import fnmatch
import weakref
from typing import Any, Callable, Iterable, Optional

from pipeline.core.errors import EXIT_FAILED, AttnSetupError

__all__ = ["Faults", "InjectedFault", "points_of_run"]


class InjectedFault(AttnSetupError):
    """The error a :class:`Faults` point raises by default (``injected_fault``, exit 1; ``info.flags`` names the point).
    """

    code = "injected_fault"
    exit_code = EXIT_FAILED


class Faults:
    """Which points raise, and what every point saw. ``at``: fnmatch patterns that raise; ``make_error``: ``point ->
    BaseException`` instead of :class:`InjectedFault`; ``sleep_s`` > 0: sleep and continue instead (a stalled rank).
    Attributes ``visited``, ``fired``, ``objects`` (weak references to what :meth:`hit` saw, to check cleanup)."""

    def __init__(self, at: Iterable[str] = (), *,
                 make_error: Optional[Callable[[str], BaseException]] = None, sleep_s: float = 0.0) -> None:
        self.at = tuple(at)
        self.make_error = make_error
        self.sleep_s = sleep_s
        self.visited: list[str] = []
        self.fired: list[str] = []
        self.objects: list[tuple[str, weakref.ref]] = []

    def matches(self, point: str) -> bool:
        return any(fnmatch.fnmatchcase(point, pat) for pat in self.at)

    def hit(self, point: str, *objs: Any) -> None:
        """Record ``point`` (and weak references to ``objs``); raise if it matches ``at``."""
        self.visited.append(point)
        for o in objs:
            for x in _leaves(o):
                self.objects.append((point, weakref.ref(x)))
        if self.matches(point):
            self.fired.append(point)
            if self.sleep_s > 0:
                import time

                from pipeline.core.heartbeat import doing

                with doing(f"injected sleep at {point}"):
                    time.sleep(self.sleep_s)
                return
            if self.make_error is not None:
                raise self.make_error(point)
            raise InjectedFault(f"fault injected at {point}", flags=[("fault_point", point)],
                                remedy="this is a test-only fault (pipeline.core.faults); run without faults=")

    def alive(self) -> list[str]:
        """Points whose recorded objects are still alive (call ``gc.collect()`` first)."""
        return [p for p, r in self.objects if r() is not None]


def _leaves(obj: Any) -> list[Any]:
    """The weak-referenceable objects worth tracking inside ``obj`` (tensors of pools and workspaces)."""
    out = []
    for attr in ("req_to_token", "k_buffer", "v_buffer", "buffer"):
        v = getattr(obj, attr, None)
        if v is None:
            continue
        out += list(v) if isinstance(v, (list, tuple)) else [v]
    if not out:
        out = [obj]
    return [x for x in out if _weakrefable(x)]


def _weakrefable(x: Any) -> bool:
    try:
        weakref.ref(x)
    except TypeError:
        return False
    return True


def check(faults: Optional[Faults], point: str, *objs: Any) -> None:
    """The call point used by the pipeline: a no-op when ``faults`` is None (every shipped path)."""
    if faults is not None:
        faults.hit(point, *objs)


def points_of_run(run: Callable[[Faults], Any]) -> list[str]:
    """The fault points a successful ``run(faults)`` visits, in order (``run`` must clean up itself)."""
    f = Faults()
    run(f)
    return list(f.visited)
