"""``attn-setup graph [LOG] -o FILE``: the state machine, with a recorded run's path highlighted.

The format follows FILE's extension: ``.mmd`` — mermaid ``stateDiagram-v2`` text produced by
pytransitions' own diagram support (``GraphMachine(graph_engine="mermaid")``), always available;
``.dot`` — Graphviz source; ``.svg``/``.png`` — rendered by Graphviz's ``dot`` program. When ``dot``
is not on PATH the command exits 2 (``graphviz_missing``, nothing written) and names it; ``.mmd``
still works. With LOG, the states the run went through are marked ``taken`` and the state it
failed in ``failed`` (``--rank`` picks the run; default: the first failed run, else the first).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from pipeline.errors import EXIT_OK, UsageError
from pipeline.machine import STEPS, TERMINAL, TRANSITIONS, State

FORMATS = (".mmd", ".dot", ".svg", ".png")
STYLE = {"taken": {"fill": "honeydew", "color": "darkgreen"}, "failed": {"fill": "mistyrose", "color": "red"}}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("graph", help="draw the state machine (.mmd/.dot/.svg/.png), a run's path highlighted")
    p.add_argument("log", nargs="?", default=None, metavar="LOG", help="trace whose path to highlight")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="output file; format from its extension")
    p.add_argument("--rank", type=int, default=None, help="which rank's run to highlight")
    return p


def path_of(log: Optional[str], rank: Optional[int]) -> tuple[list[State], Optional[State]]:
    """(states the run entered, the state it failed in or None) from a trace; ([], None) without one."""
    if log is None:
        return [], None
    from pipeline.trace import read_trace

    trace = read_trace(log).require_records()
    runs = [r for r in trace.runs if rank is None or r.rank == rank] or [trace.run(rank=rank)]
    run = next((r for r in runs if r.status == "failed"), runs[0])
    rows = run.states()
    known = {st.value for st in State}  # runner steps (load-model, capture-cuda-graphs …) are not drawn here
    taken = [State(s["state"]) for s in rows if s["state"] in known]
    failed = next((State(s["state"]) for s in rows
                   if s["outcome"] == "failed" and s["state"] != "failed" and s["state"] in known), None)
    return taken, failed


def styles(taken: list[State], failed: Optional[State]) -> dict[State, str]:
    out = {s: "taken" for s in taken}
    if failed is not None:
        out[failed] = out[State.FAILED] = "failed"
    return out


def mermaid(taken: list[State], failed: Optional[State]) -> str:
    """Mermaid text from pytransitions' mermaid engine, with our node styles and state labels."""
    from transitions.extensions.diagrams import GraphMachine

    from pipeline.machine import SetupModel

    model = SetupModel()
    gm = GraphMachine(model=model, states=list(State), transitions=TRANSITIONS, initial=State.DEVICE_INIT,
                      auto_transitions=False, graph_engine="mermaid", show_conditions=True,
                      title="attn-setup state machine")
    gm.style_attributes["node"].update(STYLE)
    graph = gm.model_graphs[id(model)]
    graph.reset_styling()
    for s, style in styles(taken, failed).items():
        graph.set_node_style(s, style)
    text = graph.get_graph(title="attn-setup state machine").draw(None)
    text = "\n".join(("  class" + line[len("  Class"):]) if line.startswith("  Class ") else line
                     for line in text.splitlines())
    for s in State:  # readable labels: the state values sglang users know
        text = text.replace(f'state "{s.name}" as {s.name}', f'state "{s.value}" as {s.name}')
    return text + "\n"


def dot(taken: list[State], failed: Optional[State]) -> str:
    """Graphviz source of the machine (same styles as :func:`mermaid`)."""
    st = styles(taken, failed)
    lines = ["digraph attn_setup {", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", fillcolor=white];']
    for s in State:
        attrs = STYLE.get(st.get(s, ""), {})
        extra = f', fillcolor="{attrs["fill"]}", color="{attrs["color"]}", penwidth=2' if attrs else ""
        lines.append(f'  {s.name} [label="{s.value}"{extra}];')
    edges = [(src, dst, t) for t, src, dst, _, _ in STEPS] + [(s, State.FAILED, "fail") for s in State
                                                               if s not in TERMINAL]
    for src, dst, t in edges:
        on_path = src in taken and dst in taken and (dst is not State.FAILED or failed is src)
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
    taken, failed = path_of(ns.log, ns.rank)
    if ns.log is not None and not taken:
        print(f"note: {ns.log} never entered the setup machine (the runner stopped, or the trace ends, before "
              "its attention step started it; 'attn-setup inspect' shows where): nothing is highlighted", file=sys.stderr)
    try:
        if ext == ".mmd":
            out.write_text(mermaid(taken, failed))
        elif ext == ".dot":
            out.write_text(dot(taken, failed))
        else:
            subprocess.run(["dot", f"-T{ext[1:]}", "-o", str(out)], input=dot(taken, failed).encode(), check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise UsageError(f"cannot write {str(out)!r}: {getattr(e, 'strerror', None) or e}", code="usage",
                         flags=[("-o", ns.output)], remedy="pick a writable output path") from None
    print(f"wrote {out}")
    return EXIT_OK
