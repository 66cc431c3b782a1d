"""The CLI explains itself, the minor items: ``-v`` where it has no effect is refused,
``graph --json``, ``graph`` highlights what a failed run did, a timeline heading true to its rows."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from pipeline.cli import main

GOLDEN = ROOT / "tests" / "data" / "golden"
TRACES = ROOT / "tests" / "data" / "bad_inputs" / "traces"


@pytest.mark.parametrize("argv", [
    ["plan", "-v"], ["-v", "plan"], ["warmup", "-v", "--device", "cpu"], ["-v", "backends"],
    ["-v", "replay", str(GOLDEN / "ok_default.jsonl")], ["-v", "inspect", str(GOLDEN / "ok_default.jsonl")],
    ["-v", "graph", "-o", "x.mmd"],
])
def test_verbose_is_refused_where_it_has_no_effect(capsys, argv):
    """-v prints a start's events; only run starts anything: elsewhere exit 2 naming -v, why, and where the
    detail is — as JSON with --json, before anything runs."""
    command = next(a for a in argv if not a.startswith("-"))
    assert main([*argv, "--json"] if command != "graph" else argv) == 2
    cap = capsys.readouterr()
    text = " ".join((cap.out + cap.err).split())
    assert f"'attn-setup {command}' has none" in text and "drop -v" in text and "attn-setup run -v" in text
    assert f"see 'attn-setup {command} --help'" in text
    if command != "graph":
        err = json.loads(cap.out)["error"]
        assert err["code"] == "usage" and err["flags"] == [{"name": "-v", "value": True}]


def test_verbose_run_prints_event_lines(capsys, tmp_path):
    """run -v (before or after the subcommand) still prints the short event lines on stderr."""
    assert main(["run", "-v", "--device", "cpu", "--json", "--num-layers", "1", "--decode-steps", "0",
                 "--log-file", str(tmp_path / "l.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "backends_resolved" in err and "runner_ready" in err


def _graph_json(capsys, *argv: str) -> dict:
    assert main(["graph", *argv, "--json"]) == 0
    cap = capsys.readouterr()
    return {**json.loads(cap.out), "_stderr": cap.err}


@pytest.mark.parametrize("machine", ["setup", "runner"])
def test_graph_json_lists_the_machine(capsys, machine):
    from pipeline.cli.graph import machine_spec

    spec = machine_spec(machine)
    out = _graph_json(capsys, "--machine", machine)
    assert out["ok"] and out["machine"] == machine and out["path"] is None and out["output"] is None
    assert [s["name"] for s in out["states"]] == [s.value for s in spec.State]
    assert all(s["style"] is None for s in out["states"])
    chain = [(s.state, spec.next_state(s)) for s in spec.steps]  # the forward transitions, in order
    forward = [(t["source"], t["dest"]) for t in out["transitions"] if t["dest"] != spec.failed]
    assert forward == chain
    fails = {t["source"] for t in out["transitions"] if t["dest"] == spec.failed}
    assert fails == {s.state for s in spec.steps}  # every working state can fail
    assert out["initial"] == spec.steps[0].state and out["success"] == spec.success


def test_graph_json_with_a_file_writes_both(capsys, tmp_path):
    out = _graph_json(capsys, str(GOLDEN / "failed_pdmux_tbo.jsonl"), "-o", str(tmp_path / "g.mmd"))
    styles = {s["name"]: s["style"] for s in out["states"]}
    assert styles == {"device-init": "taken", "resolve": "failed", "build-mode": None, "npu-lazy-mem": None,
                      "annotate": None, "done": None, "failed": "failed"}
    assert out["path"]["failed"] == "resolve" and out["path"]["failure"]["code"] == "conflicting_options"
    text = (tmp_path / "g.mmd").read_text()
    assert "class RESOLVE s_failed" in text and "class FAILED s_failed" in text


def test_graph_marks_a_verification_failure_after_ready(capsys, tmp_path):
    """A run that failed verification after the runner reached ready: ready (runner) / done (setup) is marked
    failed — not a clean path — and the machine's own failed state is not (it never moved there)."""
    log = str(TRACES / "verification_nan_text.jsonl")
    for machine, last in (("runner", "ready"), ("setup", "done")):
        out = _graph_json(capsys, log, "--machine", machine)
        styles = {s["name"]: s["style"] for s in out["states"]}
        assert styles[last] == "failed" and styles["failed"] is None, styles
        assert all(v == "taken" for k, v in styles.items() if k not in (last, "failed"))
        assert out["path"]["status"] == "failed" and out["path"]["failure"]["code"] == "verification_failed"
        assert f"reached {last}" in out["_stderr"] and "never moved to failed" in out["_stderr"]
    assert main(["graph", log, "--machine", "runner", "-o", str(tmp_path / "r.dot")]) == 0
    capsys.readouterr()
    dot = (tmp_path / "r.dot").read_text()
    assert 'READY [label="ready", fillcolor="mistyrose"' in dot and 'FAILED [label="failed"];' in dot


def test_graph_needs_an_output_or_json(capsys):
    assert main(["graph"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "needs -o FILE (or --json)" in err and "see 'attn-setup graph --help'" in err


def test_timeline_heading_names_what_the_table_holds():
    from pipeline.cli.run import timeline_title

    setup = [{"state": "device-init", "outcome": "ok", "duration_ms": 1.0}]
    runner = [{"state": s, "outcome": "ok", "duration_ms": 1.0} for s in ("init-distributed", "load-model")]
    assert timeline_title({"states": setup, "runner_states": []}) == "timeline (setup states; the runner did not start)"
    assert "under attention" not in timeline_title({"states": [], "runner_states": runner})
    assert "under attention" in timeline_title(
        {"states": setup, "runner_states": runner + [{"state": "attention", "outcome": "ok", "duration_ms": 1.0}]})
