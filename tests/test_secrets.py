"""No secret value appears in any output: trace, stdout/stderr of run/inspect/replay/graph, Perfetto."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from pipeline.core.eventlog import secrets_from_env
import pytest


def _cli(*args, env):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, env=env, timeout=300)


def test_secrets_from_env():
    assert secrets_from_env({"ATTN_SETUP_SECRET_HF_TOKEN": "a", "ATTN_SETUP_SECRET_": "b", "OTHER": "c",
                             "ATTN_SETUP_SECRET_EMPTY": ""}) == {"HF_TOKEN": "a"}


def test_no_secret_in_any_output(tmp_path):
    secret = "hf_" + uuid.uuid4().hex
    env = {**os.environ, "ATTN_SETUP_SECRET_HF_TOKEN": secret, "ATTN_SETUP_SECRET_API_KEY": "sk-" + secret[::-1]}
    log = tmp_path / "t.jsonl"
    outputs = [_cli("-v", "run", "--device", "cpu", "--log-file", str(log), env=env)]
    assert outputs[0].returncode == 0, outputs[0].stderr.decode()[-2000:]
    outputs += [_cli("-v", "run", "--device", "cpu", "--json", "--enable-pdmux", "--log-file", str(log), env=env)]
    assert outputs[-1].returncode == 3
    outputs += [_cli("inspect", str(log), env=env), _cli("inspect", str(log), "--json", "--perfetto",
                                                          str(tmp_path / "p.json"), env=env),
                _cli("replay", str(log), env=env), _cli("replay", str(log), "--json", env=env),
                _cli("graph", str(log), "-o", str(tmp_path / "g.mmd"), env=env)]
    assert [o.returncode for o in outputs[2:]] == [1, 1, 0, 0, 0]
    blobs = [o.stdout for o in outputs] + [o.stderr for o in outputs]
    blobs += [log.read_bytes(), (tmp_path / "p.json").read_bytes(), (tmp_path / "g.mmd").read_bytes()]
    for s in (secret, "sk-" + secret[::-1], secret[::-1]):
        assert not any(s.encode() in b for b in blobs)
    # the secrets were really carried (by name) and redacted in the first record of both runs
    firsts = [json.loads(x) for x in log.read_text().splitlines() if '"run_started"' in x]
    assert len(firsts) == 2 and all(f["request"]["secrets"] == {"API_KEY": "<redacted>", "HF_TOKEN": "<redacted>"}
                                    for f in firsts)
    assert b"runner_started" in outputs[0].stderr  # -v prints each event as a short line (nested objects counted)


def test_library_logs_redacted(tmp_path):
    import structlog

    from pipeline.core import events as ev
    from pipeline.core.eventlog import EventLog

    secret = "tok-" + uuid.uuid4().hex
    log = EventLog("r", 0, tmp_path / "x.jsonl", secrets=(secret,))
    with structlog.testing.capture_logs() as cap:
        log.emit(ev.StepSkipped, state="resolve", what="x", reason=f"contains {secret} inside \"quotes\"")
    log.close()
    assert secret not in json.dumps(cap) and secret.encode() not in (tmp_path / "x.jsonl").read_bytes()
    assert "contains <redacted> inside" in (tmp_path / "x.jsonl").read_text()


# -- 5. a secret equal to ordinary text does not break replay ----------------------------------------------------
def _replay_json(*logs: str) -> tuple[int, dict]:
    import json

    from conftest import run_main

    proc = run_main("replay", "--json", *logs)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def secret_traces(tmp_path_factory):
    """One good CPU run per secret that matches ordinary log text (in-process, like the tester's)."""
    from conftest import run_main

    d, out = tmp_path_factory.mktemp("secret"), {}
    mp = pytest.MonkeyPatch()
    try:
        for secret in ("torch_native", "cpu", "a"):
            mp.setenv("ATTN_SETUP_SECRET_TOK", secret)
            log = d / f"{secret}.jsonl"
            assert run_main("run", "--device", "cpu", "--json", "--log-file", str(log)).returncode == 0
            out[secret] = str(log)
    finally:
        mp.undo()
    return out


def test_a_redacted_decision_is_compared_around_the_marker(secret_traces):
    """The finding: ``ATTN_SETUP_SECRET_TOK=torch_native`` made replay report ``DIVERGED … recorded '<redacted>'``
    (exit 1) on a good run; now the fields holding the marker are compared around it and listed."""
    rc, out = _replay_json(secret_traces["torch_native"])
    assert rc == 0 and out["same"] and out["divergence"] is None, out
    run = out["runs"][0]
    assert run["redacted"] == ["resolve.prefill", "resolve.decode", "build-mode.instances", "annotate.names"]
    assert len(run["checked"]) == 21 and run["stopped"] == ""  # every decision the run recorded


@pytest.mark.parametrize("secret,fields", [
    ("cpu", ["device"]),
    ("a", ["args.kv_cache_dtype", "args.dtype", "model.model_type", "model.architectures.0", "model.dtype"])])
def test_a_redacted_request_is_request_redacted_not_trace_unreadable(secret_traces, secret, fields):
    """``=cpu`` / ``=a`` redact the recorded request's device or dtypes and names: that trace was
    ``trace_unreadable``; it reads fine and holds no usable request: exit 2 ``request_redacted`` naming the fields."""
    rc, out = _replay_json(secret_traces[secret])
    err = out["error"]
    assert rc == 2 and err["code"] == "request_redacted", err
    assert {"name": "fields", "value": fields} in err["flags"] and "redacted because a secret" in err["message"]
    assert err["remedy"].startswith("use secrets that do not occur in ordinary values")


def test_matches_around_redaction():
    from pipeline.observe.replay import matches_around_redaction as m

    assert m("<redacted>", "torch_native") and m("torch_n<redacted>tive", "torch_native")
    assert m({"a": ["x<redacted>", 1]}, {"a": ["xy", 1]})
    assert not m("torch_n<redacted>tive", "triton") and not m("<redacted>", "") and not m("<redacted>", 3)
    assert not m({"a": "<redacted>"}, {"a": "x", "b": 1}) and not m(["<redacted>"], ["x", "y"])


def test_a_secret_equal_to_a_state_name_leaves_the_transitions_alone(tmp_path):
    """``ATTN_SETUP_SECRET_TOK=ready`` rewrote ``runner_transition.to`` to ``<redacted>`` (inspect then showed a
    ``<redacted>`` state); a transition's states and trigger are machine names, kept, while free text is still
    redacted."""
    from pipeline.core import events as ev
    from pipeline.core.eventlog import EventLog

    path = tmp_path / "t.jsonl"
    log = EventLog("r1", 0, path, secrets=("ready",))
    log.emit(ev.RunnerTransition, state="capture-cuda-graphs", from_state="capture-cuda-graphs", to="ready",
             trigger="graphs_settled", duration_ms=1.0, outcome="ok")
    log.emit(ev.CommandStarted, state="args", command="run", argv=["--note", "is ready"])
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert recs[0]["to"] == "ready" and recs[0]["from"] == "capture-cuda-graphs"
    assert recs[1]["argv"] == ["--note", "is <redacted>"]
