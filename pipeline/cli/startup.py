"""``run``'s startup accounting on the command line: flags, the summary table, the metrics file.

Flags: ``--metrics-file PATH`` (the ``startup_summary`` in the OpenMetrics text format, written at the
end of every run, :mod:`pipeline.observe.metrics`), ``--slow-phase-s SECONDS`` (``slow_phase`` warnings; env
``ATTN_SETUP_SLOW_PHASE_S``), ``--no-progress`` (no progress display on a terminal).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from pipeline.core import events as ev
from pipeline.core.numbers import ascii_float


def add_startup_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-file", metavar="PATH", default=None,
                   help="write the startup summary in the Prometheus/OpenMetrics text format to PATH at the end "
                        "of the run, success or failure (default: none)")
    p.add_argument("--slow-phase-s", metavar="SECONDS", type=ascii_float, default=None,
                   help="log a slow_phase warning for every startup phase longer than SECONDS "
                        "(default: env ATTN_SETUP_SLOW_PHASE_S, else off)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display on a terminal (there is none on a non-TTY or with --json)")
    from pipeline.cli.warmup import add_flag

    add_flag(p)


def check_startup_flags(ns: argparse.Namespace) -> None:
    """Refuse a bad ``--slow-phase-s`` / ``ATTN_SETUP_SLOW_PHASE_S`` or a ``--metrics-file`` that cannot be
    written (a directory, a device, a FIFO, folders that cannot be created; missing ones are created, as for every
    output path: :func:`pipeline.core.files.check_output`): UsageError naming the flag (exit 2), before the model
    loads."""
    from pipeline.observe.startup import slow_threshold

    slow_threshold(getattr(ns, "slow_phase_s", None))
    path = getattr(ns, "metrics_file", None)
    if path is None:
        return
    from pipeline.core.files import check_output

    check_output(path, flag="--metrics-file", what="the metrics file")


def warn_env_lookalikes(log: Any) -> list[str]:
    """An ``env_var_lookalike`` warning logged per set variable that looks like one attn-setup reads
    (:func:`pipeline.core.settings.env_lookalikes`); returns one ``warning:`` line each, which ``run`` prints on
    stderr with its report."""
    from pipeline.core.settings import env_lookalikes

    lines = []
    for name, known in env_lookalikes():
        log.emit(ev.EnvVarLookalike, state="args", name=name, known=known)
        lines.append(lookalike_line(name, known))
    return lines


def lookalike_line(name: str, known: str) -> str:
    """The ``warning:`` line of one look-alike environment variable."""
    return f"warning: environment variable {name} is not one attn-setup reads; did you mean {known}?"


def env_lookalike_lines() -> list[str]:
    """One ``warning:`` line per set variable that looks like one attn-setup reads
    (:func:`pipeline.core.settings.env_lookalikes`), for ``plan`` to print on stderr where its report puts them (``run``
    logs them and prints them with its report: :func:`warn_env_lookalikes`)."""
    from pipeline.core.settings import env_lookalikes

    return [lookalike_line(name, known) for name, known in env_lookalikes()]


def jit_reports(runner: Any) -> list[dict[str, Any]]:
    """The FlashInfer backends' ``jit_report`` entries (``{variant, status, seconds}``), each variant once."""
    backends = getattr(runner, "backends", None) if runner is not None else None
    seen: dict[str, dict[str, Any]] = {}
    for b in getattr(backends, "instances", {}).values() if backends is not None else ():
        for j in getattr(b, "jit_report", None) or ():
            seen.setdefault(j["variant"], j)
    return list(seen.values())


def startup_parts(ns: argparse.Namespace) -> list[tuple[str, float, str]]:
    """``(name, seconds, detail)`` measured inside ``startup``: ``import torch`` (:func:`pipeline.observe.startup.
    timed_torch_import`) and, under torchrun, ``rendezvous`` (joining the launch, ``ns._rendezvous``), ok or not."""
    t, r = getattr(ns, "_torch_import", None), getattr(ns, "_rendezvous", None)
    parts = [("import torch", t["seconds"], t["detail"])] if t and t["seconds"] else []
    return parts + ([("rendezvous", r[0], r[1])] if r else [])


def finish_startup(ns: argparse.Namespace, log: Any, jit: list[dict[str, Any]],
                   start_ns: Optional[int]) -> tuple[Optional[Any], Optional[Any]]:
    """Emit a ``jit_variant_loaded`` per entry of ``jit`` (:func:`jit_reports`, read before the runner closed its
    backends), ``slow_phase`` warnings and ``startup_summary``, then write ``--metrics-file``; returns
    ``(summary, metrics error)``.

    Runs on ``run``'s exit path, so it does not raise: a summary that cannot be computed is reported on stderr, a
    metrics file that cannot be written is returned as an :class:`pipeline.core.errors.OutputWriteFailed` naming
    ``--metrics-file`` (the caller decides the exit: 2 for a run that was otherwise ok).
    """
    from pipeline.observe.startup import emit_summary, slow_threshold

    try:
        slow = slow_threshold(getattr(ns, "slow_phase_s", None))
    except Exception:  # noqa: BLE001 - refused in preflight already; the summary still comes
        slow = None
    try:
        for j in jit:
            log.emit(ev.JitVariantLoaded, state=log.current_state, variant=j["variant"], status=j["status"],
                     seconds=j["seconds"], started_ns=j.get("started_ns", 0), fields=j.get("fields", {}))
        parts = startup_parts(ns)
        watch = getattr(ns, "_slow_watch", None)  # judged the phases that ended during the run
        summary = emit_summary(log, start_ns=start_ns, jit=jit, slow_s=slow, startup_parts=parts,
                               judged=watch.seen if watch is not None else (),
                               created_ns=getattr(ns, "_process_created_ns", None))
    except Exception as e:  # noqa: BLE001 - a failed log write is already the run's error
        print(f"attn-setup: no startup summary: {type(e).__name__}: {e}", file=sys.stderr)
        return None, None
    path = getattr(ns, "metrics_file", None)
    return summary, (metrics_lost(path, summary, log.records) if path else None)


def metrics_lost(path: str, summary: Any, records: Any) -> Optional[Any]:
    """Write the ``--metrics-file``; None when written, else the :class:`OutputWriteFailed` (exit 2) naming the flag,
    the path and the system's reason (nothing is left behind: :func:`pipeline.observe.metrics.write_metrics`)."""
    from pipeline.core.errors import AttnSetupError, OutputWriteFailed
    from pipeline.observe.metrics import write_metrics

    try:
        write_metrics(path, summary, records)
        return None
    except AttnSetupError as e:
        return e
    except OSError as e:
        return OutputWriteFailed(f"cannot write --metrics-file {path!r}: {e.strerror or e}; the metrics file was not "
                                 "written (a file already there is unchanged)", state="output",
                                 flags=[("--metrics-file", path)],
                                 remedy="free space on its filesystem or pick another path for --metrics-file")


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(phase, seconds, detail)`` rows: top-level phases with their children indented under them,
    then ``unaccounted`` and ``wall (process start to summary)`` with the coverage, and — when the process was
    created a clock tick or more before it started running (a shell's earlier commands before ``exec``) —
    ``before start, not running`` (not in the wall)."""
    phases = summary.get("phases") or []
    rows: list[tuple[str, str, str]] = []
    for p in (p for p in phases if not p["parent"]):
        rows.append((p["name"], f"{p['seconds']:.3f}", p.get("detail", "")))
        rows += [(f"  └ {c['name']}", f"{c['seconds']:.3f}", c.get("detail", ""))
                 for c in phases if c["parent"] == p["name"]]
    rows.append(("unaccounted", f"{summary['unaccounted_s']:.3f}", ""))
    rows.append(("wall (process start to summary)", f"{summary['wall_s']:.3f}",
                 f"{summary['coverage'] * 100:.1f} % named"))
    idle = summary.get("idle_before_start_s") or 0.0
    if idle >= IDLE_SHOWN_S:
        rows.append(("before start, not running", f"{idle:.3f}", "not in wall: e.g. before exec"))
    return rows


IDLE_SHOWN_S = 0.01  # one clock tick at 100 Hz: the creation time's resolution; less is not shown


def render_summary(summary: Optional[dict[str, Any]], records: Any = ()) -> None:
    """The ``startup summary`` table (plain text for every string: phase names can come from a log), then the
    ``slow_phase`` warnings among ``records`` as one line (:func:`slow_line`)."""
    if not summary:
        return
    from pipeline.cli.output import console, print_line, print_table

    c = console()
    print_table(c, "startup summary (seconds; children indented under their phase)", ["phase", "s", "detail"],
                summary_rows(summary), justify=["left", "right", "left"])
    line = slow_line(records)
    if line:
        print_line(c, f"warning: {line}", style="bold yellow")


def _slow(records: Any) -> list[Any]:
    return [r for r in records if isinstance(r, ev.SlowPhase)]


def _phase_path(r: Any) -> str:
    return f"{r.parent}/{r.phase}" if r.parent else r.phase


def slow_line(records: Any) -> Optional[str]:
    """``slow phases (over 1 s): load-model 1.280 s, startup/import torch 1.539 s`` from a run's ``slow_phase``
    records, in the order they were logged (None without one): ``run``'s report and ``inspect`` print it under the
    startup summary."""
    slow = _slow(records)
    if not slow:
        return None
    return (f"slow phases (over {slow[0].threshold_s:g} s): "
            + ", ".join(f"{_phase_path(r)} {r.seconds:.3f} s" for r in slow))


def slow_warnings(records: Any) -> list[dict[str, Any]]:
    """``run --json``'s ``warnings`` entries of the ``slow_phase`` records: ``{code: slow_phase, what: the phase
    (parent/name for a child), message}`` (:class:`~pipeline.core.contracts.SetupWarning`)."""
    import msgspec

    from pipeline.core.contracts import SetupWarning

    return [msgspec.to_builtins(SetupWarning(
        code="slow_phase", what=_phase_path(r),
        message=f"{_phase_path(r)} took {r.seconds:.3f} s, over the slow-phase threshold of {r.threshold_s:g} s"))
        for r in _slow(records)]


def slow_phases(records: Any) -> list[dict[str, Any]]:
    """``inspect --json``'s ``slow_phases``: ``[{phase, parent, seconds, threshold_s}]`` of the ``slow_phase``
    records, in log order."""
    return [{"phase": r.phase, "parent": r.parent, "seconds": r.seconds, "threshold_s": r.threshold_s}
            for r in _slow(records)]


def summary_of(records: Any) -> Optional[dict[str, Any]]:
    """The last ``startup_summary`` of a run's records as plain data (None without one)."""
    import msgspec

    last = None
    for r in records:
        if isinstance(r, ev.StartupSummary):
            last = r
    return None if last is None else msgspec.to_builtins(last)
