"""A run's ``startup_summary`` in the OpenMetrics text format (``run --metrics-file PATH``).

Details: docs/internals.md, ``pipeline.observe.metrics``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from pipeline.core import events as ev


def _label(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x))


def _sample(name: str, labels: dict[str, Any], value: float) -> str:
    inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {_num(value)}"


def render(summary: ev.StartupSummary, records: Iterable[ev.Event] = ()) -> str:
    """The OpenMetrics text of ``summary`` (and the graph captures in ``records``), ``# EOF``-terminated."""
    base = {"run_id": summary.run_id, "rank": summary.rank}
    lines: list[str] = []

    def family(name: str, help_: str, unit: str = "") -> None:
        lines.append(f"# TYPE {name} gauge")
        if unit:
            lines.append(f"# UNIT {name} {unit}")
        lines.append(f"# HELP {name} {help_}")

    family("attn_setup_startup_phase_seconds", "Wall time of one named startup phase.", "seconds")
    for p in summary.phases:
        lines.append(_sample("attn_setup_startup_phase_seconds", {**base, "phase": p.name, "parent": p.parent},
                             p.seconds))
    family("attn_setup_startup_wall_seconds", "Process start to the startup summary.", "seconds")
    lines.append(_sample("attn_setup_startup_wall_seconds", base, summary.wall_s))
    family("attn_setup_startup_unaccounted_seconds", "Wall time no named phase covers.", "seconds")
    lines.append(_sample("attn_setup_startup_unaccounted_seconds", base, summary.unaccounted_s))
    family("attn_setup_startup_idle_before_start_seconds",
           "Process creation to its start, time it did not run (not in the wall).", "seconds")
    lines.append(_sample("attn_setup_startup_idle_before_start_seconds", base, summary.idle_before_start_s))
    family("attn_setup_cuda_graph_bytes", "Device memory one captured decode CUDA graph took.", "bytes")
    for r in records:
        if isinstance(r, ev.CudaGraphCaptured):
            lines.append(_sample("attn_setup_cuda_graph_bytes", {**base, "bs": r.bs}, r.graph_bytes))
    family("attn_setup_jit_variants", "FlashInfer JIT variants by status (compiling = compiled in this run).")
    jit = [p for p in summary.phases if p.name.startswith("jit:")]
    for status in ("compiling", "cached"):
        lines.append(_sample("attn_setup_jit_variants", {**base, "status": status},
                             sum(p.detail == status for p in jit)))
    return "\n".join(lines) + "\n# EOF\n"


def write_metrics(path: str, summary: ev.StartupSummary, records: Iterable[ev.Event] = ()) -> None:
    """Write :func:`render` to ``path`` atomically: a temporary file beside it (``PATH.tmp<pid>``), renamed over it
    once whole; the temporary file is removed whenever the write fails, so a failure leaves ``path`` as it was and
    nothing beside it. Raises OSError — also for an existing ``path`` that is not a regular file (the rename would
    replace a device such as ``/dev/zero``, as root, or a directory's entry) or that is a symbolic link (the rename
    would replace the link, not write its target), which is never touched."""
    from pipeline.core.files import check_replaceable, replace_atomically

    check_replaceable(path)  # before rendering: a refused path is refused whatever the summary
    replace_atomically(path, render(summary, records).encode("utf-8"))
