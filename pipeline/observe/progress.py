"""Progress of a running ``attn-setup run`` on a terminal (rich), read from the run's own records.

What it shows, one transient line on stderr that updates every 0.2 s: the runner state and its
elapsed time (model load, pool allocation, attention), during graph capture ``bs k of n`` with the
device memory the captured graphs took so far, the FlashInfer JIT variant being compiled (from the
log's heartbeats), ``verification: instance k of n`` and the model steps. Shown only when stderr is a
terminal and neither ``--json`` nor ``--no-progress`` is given; the log is unchanged (the display only
reads ``log.records`` from a daemon thread — nothing is added to the run's own path).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from pipeline.core import events as ev


def wanted(ns: Any, stream: Any) -> bool:
    """Whether to show progress: a TTY ``stream``, no ``--json``, no ``--no-progress``."""
    if getattr(ns, "json", False) or getattr(ns, "no_progress", False):
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def describe(records: list[Any], now_ns: int, graph_sizes: int = 0) -> str:
    """The progress line for ``records`` so far (pure: the tests drive it with records and a clock)."""
    if not records:
        return "starting"
    last = records[-1]
    since = lambda r: (now_ns - r.ts_ns) / 1e9  # noqa: E731
    plan = next((r for r in records if isinstance(r, ev.BuildPlanned)), None)
    if any(isinstance(r, ev.RunnerReady) for r in records):
        done = sum(isinstance(r, ev.InstanceVerified) for r in records)
        n = len(plan.instances) + (plan.mode.value != "normal") if plan is not None else 0
        if done < n:
            return f"verification: instance {done + 1} of {n} ({since(last):.0f} s)"
        steps = sum(isinstance(r, ev.ModelStepVerified) for r in records)
        return f"model steps: {steps} checked ({since(last):.0f} s)"
    moved = [r for r in records if isinstance(r, ev.RunnerTransition)]
    state = moved[-1].to if moved else "preflight"
    start = moved[-1] if moved else records[0]
    if state == "capture-cuda-graphs":
        caps = [r for r in records if isinstance(r, ev.CudaGraphCaptured)]
        total = f" of {graph_sizes}" if graph_sizes else ""
        return (f"capture-cuda-graphs: bs {len(caps) + 1}{total}, {_mib(sum(c.graph_bytes for c in caps))} so far "
                f"({since(start):.0f} s)")
    beat = last if isinstance(last, ev.Heartbeat) else None
    extra = f": {beat.what}" if beat is not None else ""
    return f"{state}{extra} ({since(start):.0f} s)"


class StartupProgress:
    """A rich status line fed by ``log.records`` from a daemon thread; ``with StartupProgress(...):``."""

    def __init__(self, log: Any, console: Any, graph_sizes: Any = 0, every_s: float = 0.2, lead: str = "") -> None:
        # graph_sizes: the count, or a function of the device facts (the default sizes follow the device's memory),
        # called once device-init has logged them
        self.log, self.console, self.graph_sizes, self.every_s = log, console, graph_sizes, every_s
        self.lead = lead  # e.g. why startup was slow (a cold start), kept in front of every line
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._status: Any = None

    def _sizes(self, records: list[Any]) -> int:
        if not callable(self.graph_sizes):
            return self.graph_sizes
        init = next((r for r in records if isinstance(r, ev.DeviceInitialized)), None)
        if init is None:
            return 0
        self.graph_sizes = self.graph_sizes(init.facts)  # once: the facts do not change
        return self.graph_sizes

    def line(self) -> str:
        records = list(self.log.records)
        text = describe(records, time.time_ns(), self._sizes(records))
        return f"{self.lead} · {text}" if self.lead else text

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._status.update(self.line())

    def __enter__(self) -> "StartupProgress":
        self._status = self.console.status(self.line())
        self._status.__enter__()
        self._thread = threading.Thread(target=self._loop, name="attn-setup-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._status.__exit__(*exc)


def fixed_width() -> Optional[int]:
    """None when ``COLUMNS`` is unset or a positive integer (rich reads it); for an unusable ``COLUMNS`` (``0``, negative,
    not a number) the width it would have had unset: the terminal's, else 80 (rich would take ``0`` and print nothing)."""
    import os
    import shutil

    cols = os.environ.get("COLUMNS")
    if cols is None or (cols.strip().isdigit() and int(cols) > 0):
        return None
    return shutil.get_terminal_size((80, 24)).columns  # it skips a COLUMNS that is not above 0


def progress_for(ns: Any, log: Any, request: Any) -> Any:
    """A :class:`StartupProgress` on stderr when :func:`wanted`, else a context manager that does nothing."""
    import contextlib
    import sys

    if not wanted(ns, sys.stderr):
        return contextlib.nullcontext()
    from rich.console import Console

    def sizes(facts: Any) -> int:
        """The sizes a run captures on the initialized device (its memory sets the default top)."""
        try:
            from states.build_mode import count_batch_sizes

            return count_batch_sizes(request.args, request.pool.max_reqs, device=facts,
                                     world_size=request.tp_size)
        except Exception:  # noqa: BLE001 - refused later by preflight with its own error
            return 0

    return StartupProgress(log, Console(stderr=True, width=fixed_width()), sizes, lead=cold_start_lead(getattr(ns, "_torch_import", None)))


def cold_start_lead(torch_import: Optional[dict[str, Any]]) -> str:
    """The progress line's lead after a cold start: ``startup: import torch 9.8 s (no cached bytecode for torch
    …)``; empty when torch's bytecode was cached (nothing unusual to explain)."""
    if not torch_import or not torch_import.get("cold"):
        return ""
    return f"startup: import torch {torch_import['seconds']:.1f} s ({torch_import['detail']})"
