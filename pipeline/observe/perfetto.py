"""Chrome trace-event JSON of one or more runs (opens in ui.perfetto.dev and chrome://tracing).

Layout: one process per run_id, one thread (track) per rank. Each state is a complete slice
(``ph: "X"``; an ``attn-setup run`` trace's runner states, category ``runner_state``, enclose the
setup machine's, category ``state``, which nest inside ``attention``); sub-steps are slices nested inside it on the same track: every ``backend_built``
(its ``duration_ms`` ends at the record), every verified instance (``verify <role>``), the stack's
model steps (one ``model steps`` slice, each step an instant), every FlashInfer JIT variant loaded
(``jit_variant_loaded``: from its ``started_ns``), every long step reported by heartbeats (JIT compile,
CUDA graph capture: from ``started_ns`` to the last heartbeat), and any future record with a
``duration_ms``. Decisions, skips and failures are instant events (``ph: "i"``) with their fields
as ``args``. Times are microseconds since the earliest record of all runs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pipeline.core import events as ev
from pipeline.observe.runs import ms_to_ns, s_to_ns
from pipeline.observe.runs import Run, Trace

# Records drawn as instants (the rest are drawn as slices or are part of the state slices).
_INSTANTS = (ev.RunStarted, ev.DeviceInitialized, ev.SettingResolved, ev.BackendsResolved, ev.BuildPlanned,
             ev.StepSkipped, ev.FeatureDowngraded, ev.ReferenceFallback, ev.LazyMemInitialized, ev.BackendsAnnotated,
             ev.InstanceVerified, ev.ResourcesReleased, ev.RunFailed, ev.RunInterrupted, ev.RunFinished,
             ev.CommandStarted, ev.CommandFinished)
_NOT_SUBSTEPS = (ev.StateTransition, ev.RunnerTransition, ev.RunFinished, ev.RunnerReady, ev.CommandFinished)


def _args(rec: ev.Event) -> dict[str, Any]:
    d = msgspec.to_builtins(rec)
    for k in ("event", "schema_version", "ts_ns", "run_id", "rank"):
        d.pop(k, None)
    return d


def _slice(name: str, cat: str, start_ns: int, dur_ns: int, pid: int, tid: int, t0: int,
           args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": (start_ns - t0) / 1e3, "dur": max(dur_ns, 0) / 1e3,
            "pid": pid, "tid": tid, "args": args}


def _substeps(run: Run, pid: int, tid: int, t0: int) -> list[dict[str, Any]]:
    out = []
    for r in run.records:
        dur = getattr(r, "duration_ms", None)
        if dur is not None and not isinstance(r, _NOT_SUBSTEPS) and not (isinstance(r, ev.InstanceVerified) and not dur):
            # (an instance_verified from before its duration was recorded has none to draw)
            label = (f"build {r.role} ({r.backend})" if isinstance(r, ev.BackendBuilt) else
                     f"verify {r.role} ({r.backend})" if isinstance(r, ev.InstanceVerified) else ev.event_name(type(r)))
            ns = ms_to_ns(dur)  # saturating: a recorded 1e308 or NaN still draws
            out.append(_slice(label, "substep", r.ts_ns - ns, ns, pid, tid, t0, _args(r)))
    for j in run.all(ev.JitVariantLoaded):  # JIT compiles (and cache loads) as slices from their start
        out.append(_slice(f"jit {j.status} {j.variant}", "jit", j.started_ns, s_to_ns(j.seconds), pid, tid, t0,
                          _args(j)))
    steps = run.all(ev.ModelStepVerified)
    if steps:  # the stack's checks run after the last instance verification (or ready) to the last step
        start = ([r.ts_ns for r in run.all(ev.InstanceVerified)] or [r.ts_ns for r in run.all(ev.RunnerReady)]
                 or [steps[0].ts_ns])[-1]
        out.append(_slice("model steps", "model_steps", start, steps[-1].ts_ns - start, pid, tid, t0,
                          {"steps": [f"{s.step} bs={s.batch_size}" for s in steps]}))
        out += [{"name": f"step {s.step}", "cat": "model_step", "ph": "i", "s": "t", "ts": (s.ts_ns - t0) / 1e3,
                 "pid": pid, "tid": tid, "args": _args(s)} for s in steps]
    beats: dict[tuple[str, int], list[ev.Heartbeat]] = {}
    for h in run.all(ev.Heartbeat):
        beats.setdefault((h.what, h.started_ns or h.ts_ns - s_to_ns(h.elapsed_s)), []).append(h)
    for (what, start), hs in beats.items():
        out.append(_slice(what, "long_step", start, hs[-1].ts_ns - start, pid, tid, t0,
                          {"heartbeats": len(hs), "last": hs[-1].message}))
        out += [{"name": h.message or f"still in {h.state}: {what}", "cat": "heartbeat", "ph": "i", "s": "t",
                 "ts": (h.ts_ns - t0) / 1e3, "pid": pid, "tid": tid, "args": {"elapsed_s": h.elapsed_s}} for h in hs]
    return out


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """The ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` object for every run of ``trace``."""
    runs = [r for r in trace.runs if r.records]
    events: list[dict[str, Any]] = []
    if not runs:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = min(min([s["start_ns"] for s in r.runner_states() + r.states()] or [r.records[0].ts_ns]) for r in runs)
    pids = {rid: i + 1 for i, rid in enumerate(dict.fromkeys(r.run_id for r in runs))}
    for rid, pid in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"run {rid}"}})
    for run in runs:
        pid, tid = pids[run.run_id], run.rank
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"rank {tid}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for cat, rows in (("runner_state", run.runner_states()), ("state", run.states())):
            for i, s in enumerate(rows):
                dur = ms_to_ns(s["duration_ms"])
                if i + 1 < len(rows):  # a state's own clock can overrun the next record by µs: keep slices disjoint
                    dur = min(dur, max(0, rows[i + 1]["start_ns"] - s["start_ns"]))
                events.append(_slice(s["state"], cat, s["start_ns"], dur, pid, tid, t0, {"outcome": s["outcome"]}))
        events += _substeps(run, pid, tid, t0)
        events += [{"name": ev.event_name(type(r)), "cat": "decision", "ph": "i", "s": "t",
                    "ts": (r.ts_ns - t0) / 1e3, "pid": pid, "tid": tid, "args": _args(r)}
                   for r in run.records if isinstance(r, _INSTANTS)]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: Trace, path: str, flag: str = "path") -> int:
    """Write :func:`chrome_trace` to ``path`` whole or not at all; returns the number of trace events written.

    Written through a temporary file beside ``path``, renamed over it once complete
    (:func:`pipeline.core.files.replace_atomically`): a write that fails (a full disk) leaves a file already there
    unchanged and no temporary file. ``path`` must be a regular file (or not exist): a FIFO or device raises
    UsageError ``not_a_regular_file`` and a symbolic link ``output_is_symlink`` (the rename would replace the link),
    naming ``flag``; other write failures raise OSError.
    """
    from pipeline.core.files import check_output, refuse_symlink, replace_atomically

    refuse_symlink(path, flag=flag, what="the timeline file")
    check_output(path, flag=flag, what="the timeline file")
    obj = chrome_trace(trace)
    replace_atomically(path, msgspec.json.encode(obj))
    return len(obj["traceEvents"])
