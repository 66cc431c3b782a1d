"""No secret value appears in any output: trace, stdout/stderr of run/inspect/replay/graph, Perfetto."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from pipeline.core.eventlog import secrets_from_env


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
