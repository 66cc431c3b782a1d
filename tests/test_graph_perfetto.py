"""attn-setup graph (mermaid/dot) and the Perfetto (Chrome trace-event) timeline."""

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from pipeline.core import events as ev
from pipeline.cli import main
from pipeline.core.eventlog import EventLog
from pipeline.setup.table import SETUP, State
from pipeline.observe.perfetto import chrome_trace
from pipeline.observe.trace import read_trace

GOLDEN = Path(__file__).parent / "data" / "golden"
MERMAID_LINE = re.compile(r"^(---|attn-setup state machine|stateDiagram-v2|direction LR|classDef s_\w+ [\w:,]+|"
                          r'state "[\w-]+" as [A-Z_]+|class [A-Z_]+ s_\w+|(\[\*\]|[A-Z_]+) --> [A-Z_]+(: .+)?|)$')


def _mermaid(tmp_path, capsys, *log):
    out = tmp_path / "m.mmd"
    assert main(["graph", *map(str, log), "-o", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text()
    bad = [ln for ln in text.splitlines() if not MERMAID_LINE.match(ln.strip())]
    assert bad == []  # every line is a mermaid stateDiagram statement we know
    return text


def test_mermaid_has_every_state_and_transition(tmp_path, capsys):
    text = _mermaid(tmp_path, capsys)
    for s in State:
        assert f'state "{s.value}" as {s.name}' in text
    for step in SETUP.steps:
        src, dst = State(step.state), State(SETUP.next_state(step))
        assert re.search(rf"{src.name} --> {dst.name}: {step.trigger}\b", text)
    assert "class DONE s_default" in text


def test_mermaid_highlights_failed_path(tmp_path, capsys):
    text = _mermaid(tmp_path, capsys, GOLDEN / "failed_pdmux.jsonl")
    cls = dict(re.findall(r"class ([A-Z_]+) s_(\w+)", text))
    assert cls == {"DEVICE_INIT": "taken", "RESOLVE": "failed", "BUILD_MODE": "default", "NPU_LAZY_MEM": "default",
                   "ANNOTATE": "default", "DONE": "default", "FAILED": "failed"}


def test_dot_and_svg(tmp_path, capsys):
    assert main(["graph", str(GOLDEN / "ok_default.jsonl"), "-o", str(tmp_path / "g.dot")]) == 0
    dot = (tmp_path / "g.dot").read_text()
    assert dot.startswith("digraph") and 'DONE [label="done", fillcolor="honeydew"' in dot
    svg = tmp_path / "g.svg"
    code = main(["graph", "-o", str(svg)])
    err = capsys.readouterr()
    if shutil.which("dot") is None:
        assert code == 2 and not svg.exists() and "'dot' program" in " ".join(err.err.split())
    else:
        assert code == 0 and "<svg" in svg.read_text()
    assert main(["graph", "-o", str(tmp_path / "g.txt")]) == 2


def test_perfetto_states_nested_and_one_track_per_rank(tmp_path, capsys):
    out = tmp_path / "p.json"
    logs = [GOLDEN / "tp2_rank0.jsonl", GOLDEN / "tp2_rank1.jsonl"]
    assert main(["inspect", *map(str, logs), "--perfetto", str(out)]) == 0
    obj = json.loads(out.read_text())
    evs = obj["traceEvents"]
    slices = [e for e in evs if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {0, 1} and len({e["pid"] for e in slices}) == 1
    for rank in (0, 1):
        states = [e for e in slices if e["cat"] == "state" and e["tid"] == rank]
        assert [e["name"] for e in states] == ["device-init", "resolve", "build-mode", "npu-lazy-mem", "annotate", "done"]
        build = states[2]
        (sub,) = [e for e in slices if e["cat"] == "substep" and e["tid"] == rank]
        assert sub["name"] == "build primary (torch_native)"
        assert build["ts"] - 1 <= sub["ts"] and sub["ts"] + sub["dur"] <= build["ts"] + build["dur"] + 1
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}


def test_perfetto_heartbeat_slice_nested(tmp_path):
    log = EventLog("hb", 0, tmp_path / "hb.jsonl")
    log.emit(ev.RunStarted, state="device-init", request={})
    log.emit(ev.StateTransition, state="build-mode", from_state="device-init", to="build-mode", trigger="t",
             duration_ms=1.0)
    t = time.perf_counter()
    with log.heartbeat("cuda graph capture", every_s=0.03):
        time.sleep(0.12)
    log.emit(ev.StateTransition, state="npu-lazy-mem", from_state="build-mode", to="npu-lazy-mem", trigger="built",
             duration_ms=(time.perf_counter() - t) * 1e3 + 0.5)
    log.close()
    evs = chrome_trace(read_trace(tmp_path / "hb.jsonl"))["traceEvents"]
    (long,) = [e for e in evs if e.get("cat") == "long_step"]
    build = next(e for e in evs if e.get("cat") == "state" and e["name"] == "build-mode")
    assert long["name"] == "cuda graph capture" and long["args"]["heartbeats"] >= 2
    assert build["ts"] <= long["ts"] and long["ts"] + long["dur"] <= build["ts"] + build["dur"]
    assert sum(e.get("cat") == "heartbeat" for e in evs) == long["args"]["heartbeats"]
