"""``attn-setup graph [LOG …] -o FILE [--machine setup|runner]``: a state machine, a recorded run's path highlighted.

``--machine setup`` (default) draws the six-state setup machine (:data:`pipeline.setup.table.SETUP`),
``--machine runner`` the runner's outer machine (:data:`pipeline.runtime.table.RUNNER`: init-distributed …
ready), both from their step tables. The format follows FILE's extension: ``.mmd`` — mermaid
``stateDiagram-v2`` text produced by pytransitions' own diagram support
(``GraphMachine(graph_engine="mermaid")``), always available; ``.dot`` — Graphviz source;
``.svg``/``.png`` — rendered by Graphviz's ``dot`` program. When ``dot`` is not on PATH the command
exits 2 (``graphviz_missing``, nothing written) and names it; ``.mmd`` still works. With LOGs (one
or several, e.g. every rank's), the states the run went through are marked ``taken`` and the state
it failed in ``failed`` (``--rank`` picks the run; default: the first failed run, else the first).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from pipeline.core.errors import EXIT_OK, UsageError

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
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="output file; format from its extension")
    p.add_argument("--rank", type=int, default=None,
                   help="which rank's run to highlight (default: the first failed run, else the first)")
    p.add_argument("--machine", choices=("setup", "runner"), default="setup",
                   help="setup: the six-state pipeline; runner: the runner's outer machine (init-distributed … ready)")
    return p


def path_of(logs: Any, rank: Optional[int], machine: str = "setup") -> tuple[list[Any], Optional[Any]]:
    """(states the run entered, the state it failed in or None) of ``machine`` from one trace or
    several (merged as ``inspect`` merges them); ([], None) without one."""
    if not logs:
        return [], None
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
    return taken, failed


def styles(taken: list[Any], failed: Optional[Any], machine: str = "setup") -> dict[Any, str]:
    out = {s: "taken" for s in taken}
    if failed is not None:
        out[failed] = out[machine_spec(machine).State(machine_spec(machine).failed)] = "failed"
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


def cmd(ns: argparse.Namespace) -> int:
    out = Path(ns.output)
    ext = out.suffix.lower()
    if ext not in FORMATS:
        raise UsageError(f"cannot tell the format of {ns.output!r} from its extension", code="usage",
                         flags=[("-o", ns.output)], allowed=list(FORMATS), remedy="name the output FILE.mmd (always works)")
    if ext in (".svg", ".png") and shutil.which("dot") is None:
        raise UsageError(f"writing {ext} needs Graphviz's 'dot' program, which is not on PATH", code="graphviz_missing",
                         flags=[("-o", ns.output)], allowed=[".mmd", ".dot"],
                         remedy="install Graphviz (apt-get install graphviz / brew install graphviz), or use -o FILE.mmd")
    from pipeline.cli.log_paths import check_log_paths

    check_log_paths(ns.logs)
    taken, failed = path_of(ns.logs, ns.rank, ns.machine)
    if ns.logs and not taken:
        what = ("the runner machine (a pipeline run from code has no runner; the setup machine is drawn with "
                "--machine setup)" if ns.machine == "runner" else
                "the setup machine (the runner stopped, or the trace ends, before its attention step started it)")
        print(f"note: {' '.join(ns.logs)} never entered {what}; 'attn-setup inspect' shows where: nothing is "
              "highlighted", file=sys.stderr)
    from pipeline.core.files import check_output

    check_output(out, flag="-o", what="the diagram file")  # a regular file; missing folders are created
    try:
        if ext == ".mmd":
            out.write_text(mermaid(taken, failed, ns.machine))
        elif ext == ".dot":
            out.write_text(dot(taken, failed, ns.machine))
        else:
            subprocess.run(["dot", f"-T{ext[1:]}", "-o", str(out)], input=dot(taken, failed, ns.machine).encode(),
                           check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise UsageError(f"cannot write {str(out)!r}: {getattr(e, 'strerror', None) or e}", code="usage",
                         flags=[("-o", ns.output)], remedy="pick a writable output path") from None
    print(f"wrote {out}")
    return EXIT_OK
