"""``attn-setup replay LOG [LOG …]``: re-run the recorded decisions without a GPU.

Exit codes, and only these: 0 every run decides the same now · 1 a run diverged (the first
divergence is printed as state, field, recorded, now) · 2 the trace is unreadable (nothing to
replay from, a LOG that is not a regular file, or a recorded request/input this version cannot
use: ``trace_unreadable`` naming the run and its ``run_started`` record; a decision record (or one that feeds a decision, such as step_skipped for skips) missing or unreadable
in a run whose records go on past its state: ``trace_unreadable`` naming the state, the record and the skipped
lines, every other decision still compared), or it reads but holds no
decision to replay (every run stopped before resolve: ``nothing_to_replay`` naming each run, the
state it failed in and its recorded error code), or a run's trace ends before its last decision without
recording its end (``trace_incomplete``, naming the run and the state it ends in; only what was recorded is
compared, so a cut trace never reads as a divergence), or a run's recorded request had deciding values redacted by
a secret equal to ordinary text (``request_redacted`` naming the fields). A decision whose recorded value holds a
secret's ``<redacted>`` marker is compared around it (listed as ``redacted``), never a divergence for the marker.
"""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from pipeline.core.errors import EXIT_FAILED, EXIT_OK


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="re-run a trace's decisions on a fake platform; report the first divergence")
    p.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines trace(s) written by 'attn-setup run'")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def cmd(ns: argparse.Namespace) -> int:
    from pipeline.observe.replay import replay

    from pipeline.cli.flags import check_log_paths

    check_log_paths(ns.logs)
    result = replay(ns.logs)
    if ns.json:
        from pipeline.cli.output import emit_json

        emit_json({"same": result.same, "runs": [{**msgspec.to_builtins(r), "same": r.same} for r in result.runs],
                   "divergence": None if result.divergence is None else msgspec.to_builtins(result.divergence),
                   "skipped_lines": result.skipped_lines})
    else:
        from pipeline.cli.inspect import _safe  # trace text: terminal escapes shown escaped, as inspect does
        from pipeline.cli.output import console, print_line

        c = console()
        for r in result.runs:
            head = f"run {r.run_id} rank {r.rank}" + (f" launch {r.launch_id}" if r.launch_id else "") + ": "
            if r.ends_in:  # printed when another run diverged; alone it is trace_incomplete (exit 2)
                print_line(c, _safe(head + f"incomplete: the trace ends in state {r.ends_in!r} ({len(r.checked)} decisions "
                                     "recorded up to there, the same)"))
            elif r.divergence is None:
                print_line(c, _safe(head + f"same ({len(r.checked)} decisions checked)"
                           + (f"; {len(r.redacted)} compared around a secret's <redacted> marker: "
                              + ", ".join(r.redacted) if r.redacted else "")
                           + (f"; stopped: {r.stopped}" if r.stopped else "")))
            else:
                d = r.divergence
                print_line(c, _safe(head + f"DIVERGED in state {d.state!r}, field {d.field!r}: recorded {d.recorded!r}, "
                                     f"now {d.now!r}"))
        if result.skipped_lines:
            print_line(c, f"skipped {result.skipped_lines} unreadable line(s)")
    return EXIT_OK if result.same else EXIT_FAILED
