"""``attn-setup graph [LOG …] -o FILE|--json [--machine setup|runner]``: a state machine, a recorded run's path highlighted.

Details: docs/internals.md, ``pipeline.cli.graph``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from pipeline.core.errors import EXIT_OK, UsageError
from pipeline.core.numbers import ascii_int

FORMATS = (".mmd", ".dot", ".svg", ".png")
STYLE = {"taken": {"fill": "honeydew", "color": "darkgreen"}, "failed": {"fill": "mistyrose", "color": "red"}}


def machine_spec(name: str) -> Any:
    """The step table of ``setup`` (the six-state pipeline) or ``runner`` (the runner's outer machine)."""
    if name == "runner":
        from pipeline.runtime.table import RUNNER

        return RUNNER
    from pipeline.setup.table import SETUP

    return SETUP


TITLES = {"setup": "attn-setup state machine", "runner": "attn-setup runner machine"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("graph", help="draw the setup or runner machine (.mmd/.dot/.svg/.png), a run's path highlighted")
    p.add_argument("logs", nargs="*", metavar="LOG",
                   help="trace(s) whose run's path to highlight (several: every rank's log; default: none)")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="output file; format from its extension (default: none; required unless --json)")
    p.add_argument("--json", action="store_true",
                   help="print the machine as one JSON object: states (each with its highlight), transitions, the "
                        "run's path; with -o the file is written too")
    p.add_argument("--rank", type=ascii_int, default=None,
                   help="which rank's run to highlight (default: the first failed run, else the first)")
    p.add_argument("--machine", choices=("setup", "runner"), default="setup",
                   help="setup: the six-state pipeline; runner: the runner's outer machine (init-distributed … ready)")
    return p


def path_of(logs: Any, rank: Optional[int], machine: str = "setup") -> tuple[list[Any], Optional[Any]]:
    """(states the run entered, the state it failed in or None) of ``machine`` from one trace or
    several (merged as ``inspect`` merges them); ([], None) without one. See :func:`trace_path`."""
    taken, failed, _run = trace_path(logs, rank, machine)
    return taken, failed


def trace_path(logs: Any, rank: Optional[int], machine: str = "setup") -> tuple[list[Any], Optional[Any], Any]:
    """(states entered, the state the run failed in or None, the run or None) of ``machine``.

    The failed state is the one the machine failed in (its ``failed`` outcome) or, for a run that failed after
    the machine finished without failing — ``attn-setup run`` verifies after the runner reached ``ready`` and
    the setup machine ``done`` — its success state, when the failure names it or is ``verification_failed``:
    the picture shows what the trace did, never a clean path for a failed run. The machine's own ``failed``
    state is highlighted only when the machine entered it."""
    if not logs:
        return [], None, None
    from pipeline.observe.trace import read_trace

    spec = machine_spec(machine)
    trace = read_trace(logs).require_records()
    known = {st.value for st in spec.State}  # the other machine's states are not drawn here

    def rows_of(r: Any) -> list[dict[str, Any]]:
        return r.runner_states() if machine == "runner" else r.states()

    runs = [r for r in trace.runs if rank is None or r.rank == rank] or [trace.run(rank=rank)]
    runs = [r for r in runs if any(s["state"] in known for s in rows_of(r))] or runs  # runs that entered it
    run = next((r for r in runs if r.status == "failed"), runs[0])
    rows = rows_of(run)
    taken = [spec.State(s["state"]) for s in rows if s["state"] in known]
    failed = next((spec.State(s["state"]) for s in rows
                   if s["outcome"] == "failed" and s["state"] != spec.failed and s["state"] in known), None)
    info = run.failure
    if failed is None and info is not None and taken and taken[-1].value == spec.success and (
            info.state == spec.success or info.code == "verification_failed"):
        failed = taken[-1]  # failed after the machine finished: verification runs once ready / done
    return taken, failed, run


def styles(taken: list[Any], failed: Optional[Any], machine: str = "setup") -> dict[Any, str]:
    out = {s: "taken" for s in taken}
    if failed is not None:
        out[failed] = "failed"
        fail_state = machine_spec(machine).State(machine_spec(machine).failed)
        if fail_state in taken:  # the machine itself moved to failed
            out[fail_state] = "failed"
    return out


def mermaid(taken: list[Any], failed: Optional[Any], machine: str = "setup") -> str:
    """Mermaid text from pytransitions' mermaid engine, with our node styles and state labels."""
    from transitions.extensions.diagrams import GraphMachine

    spec, title = machine_spec(machine), TITLES[machine]
    model = spec.diagram_model()
    gm = GraphMachine(model=model, states=list(spec.State), transitions=spec.transitions(),
                      initial=spec.State(spec.steps[0].state), auto_transitions=False, graph_engine="mermaid",
                      show_conditions=True, title=title)
    gm.style_attributes["node"].update(STYLE)
    graph = gm.model_graphs[id(model)]
    graph.reset_styling()
    for s, style in styles(taken, failed, machine).items():
        graph.set_node_style(s, style)
    text = graph.get_graph(title=title).draw(None)
    text = "\n".join(("  class" + line[len("  Class"):]) if line.startswith("  Class ") else line
                     for line in text.splitlines())
    for s in spec.State:  # readable labels: the state values sglang users know
        text = text.replace(f'state "{s.name}" as {s.name}', f'state "{s.value}" as {s.name}')
    return text + "\n"


def dot(taken: list[Any], failed: Optional[Any], machine: str = "setup") -> str:
    """Graphviz source of the machine (same styles as :func:`mermaid`)."""
    spec = machine_spec(machine)
    st = styles(taken, failed, machine)
    fail_state = spec.State(spec.failed)
    lines = [f"digraph attn_setup{'_runner' if machine == 'runner' else ''} {{", "  rankdir=LR;",
             '  node [shape=box, style="rounded,filled", fillcolor=white];']
    for s in spec.State:
        attrs = STYLE.get(st.get(s, ""), {})
        extra = f', fillcolor="{attrs["fill"]}", color="{attrs["color"]}", penwidth=2' if attrs else ""
        lines.append(f'  {s.name} [label="{s.value}"{extra}];')
    edges = [(spec.State(s.state), spec.State(spec.next_state(s)), s.trigger) for s in spec.steps]
    edges += [(spec.State(s.state), fail_state, "fail") for s in spec.steps]
    for src, dst, t in edges:
        on_path = src in taken and dst in taken and (dst is not fail_state or failed is src)
        lines.append(f'  {src.name} -> {dst.name} [label="{t}"{", penwidth=2.5" if on_path else ""}];')
    return "\n".join(lines + ["}"]) + "\n"


def machine_obj(taken: list[Any], failed: Optional[Any], run: Any, machine: str = "setup") -> dict[str, Any]:
    """``--json``: the machine's states and transitions from its step table, and the run's path.

    ``{machine, title, initial, success, failed_state, states: [{name, style}], transitions: [{trigger, source,
    dest, conditions}], path}`` — ``style`` is ``taken``, ``failed`` or null (as the drawing colours them);
    ``path`` is null without a LOG, else ``{run_id, rank, launch_id, status, taken: [state…], failed: state|null,
    failure: {code, state, message}|null}`` (the failure worded with the flags, as ``inspect`` words it).
    :func:`cmd` adds ``ok`` and ``output``.
    """
    spec = machine_spec(machine)
    st = styles(taken, failed, machine)
    from pipeline.cli.inspect import failure_of

    info = None if run is None else failure_of(run)  # in the command line's words (--attention-backend fa3)
    return {
        "machine": machine, "title": TITLES[machine], "initial": spec.steps[0].state, "success": spec.terminal[0],
        "failed_state": spec.failed,
        "states": [{"name": s.value, "style": st.get(s)} for s in spec.State],
        "transitions": [{"trigger": t["trigger"], "source": spec.State(src).value,
                         "dest": spec.State(t["dest"]).value, "conditions": list(t.get("conditions") or [])}
                        for t in spec.transitions()
                        for src in (t["source"] if isinstance(t["source"], (list, tuple)) else [t["source"]])],
        "path": None if run is None else {
            "run_id": run.run_id, "rank": run.rank, "launch_id": run.launch_id, "status": run.status,
            "taken": [s.value for s in taken], "failed": None if failed is None else failed.value,
            "failure": None if info is None else {"code": info.code, "state": info.state, "message": info.message}},
    }


def cmd(ns: argparse.Namespace) -> int:
    if ns.output is None and not ns.json:
        raise UsageError("attn-setup graph needs -o FILE (or --json)", code="usage", flags=[("-o", "")],
                         allowed=[f"FILE{e}" for e in FORMATS] + ["--json"],
                         remedy="add -o graph.mmd (mermaid, always works) or --json; see 'attn-setup graph --help'")
    out = Path(ns.output) if ns.output is not None else None
    ext = out.suffix.lower() if out is not None else ""
    if out is not None and ext not in FORMATS:
        raise UsageError(f"cannot tell the format of {ns.output!r} from its extension", code="usage",
                         flags=[("-o", ns.output)], allowed=list(FORMATS), remedy="name the output FILE.mmd (always works)")
    if ext in (".svg", ".png") and shutil.which("dot") is None:
        raise UsageError(f"writing {ext} needs Graphviz's 'dot' program, which is not on PATH", code="graphviz_missing",
                         flags=[("-o", ns.output)], allowed=[".mmd", ".dot"],
                         remedy="install Graphviz (apt-get install graphviz / brew install graphviz), or use -o FILE.mmd")
    from pipeline.cli.flags import check_log_paths

    check_log_paths(ns.logs)
    taken, failed, run = trace_path(ns.logs, ns.rank, ns.machine)
    if ns.logs and not taken:
        what = ("the runner machine (a pipeline run from code has no runner; the setup machine is drawn with "
                "--machine setup)" if ns.machine == "runner" else
                "the setup machine (the runner stopped, or the trace ends, before its attention step started it)")
        print(f"note: {' '.join(ns.logs)} never entered {what}; 'attn-setup inspect' shows where: nothing is "
              "highlighted", file=sys.stderr)
    fail_state = machine_spec(ns.machine).failed
    if failed is not None and fail_state not in [s.value for s in taken] and run is not None:
        info = run.failure
        print(f"note: run {run.run_id} rank {run.rank} failed after the {ns.machine} machine reached "
              f"{failed.value} ({info.code if info else 'failed'}): {failed.value} is marked failed; the machine "
              f"itself never moved to {fail_state}", file=sys.stderr)
    if out is not None:
        from pipeline.core.files import check_output, replace_atomically

        check_output(out, flag="-o", what="the diagram file")  # a regular file; missing folders are created
        try:  # written whole or not at all: a full disk leaves no empty or cut file behind
            if ext == ".mmd":
                replace_atomically(out, mermaid(taken, failed, ns.machine).encode())
            elif ext == ".dot":
                replace_atomically(out, dot(taken, failed, ns.machine).encode())
            else:
                replace_atomically(out, subprocess.run(["dot", f"-T{ext[1:]}"], capture_output=True, check=True,
                                                       input=dot(taken, failed, ns.machine).encode()).stdout)
        except (OSError, subprocess.CalledProcessError) as e:
            raise UsageError(f"cannot write {str(out)!r}: {getattr(e, 'strerror', None) or e}", code="usage",
                             flags=[("-o", ns.output)], remedy="pick a writable output path") from None
    if ns.json:
        from pipeline.cli.output import emit_json

        emit_json({"ok": True, **machine_obj(taken, failed, run, ns.machine),
                   "output": None if out is None else str(out)})
    else:
        print(f"wrote {out}")
    return EXIT_OK
