"""A terminating signal at any point of ``run`` and of the command line's start: the process's exit code is the one
the log records (``command_finished``) and the one ``--json`` reports, and an early Ctrl-C is a clean 130. Real
processes (the exit status is what is tested), each a one-layer CPU run of ~2 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT

# ``run`` with one of its functions wrapped so that the process sends itself a signal at that point
SCRIPT = """
import os, signal, sys
import pipeline.cli.run as r
where, sig = sys.argv[1], getattr(signal, sys.argv[2])
real = getattr(r, where)
def wrapped(*a, **kw):
    if where == "finish_log":
        real(*a, **kw)
        os.kill(os.getpid(), sig)
        return None
    os.kill(os.getpid(), sig)
    return real(*a, **kw)
setattr(r, where, wrapped)
sys.argv = ["attn-setup", *sys.argv[3:]]
from pipeline.cli import entry
entry()
"""


def _run(tmp_path, where: str, sig: str) -> tuple[int, dict, list[dict]]:
    log = tmp_path / "l.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), where, sig, "run", "--device", "cpu",
                        "--num-layers", "1", "--decode-steps", "1", "--json", "--log-file", str(log)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert "Traceback" not in p.stderr, p.stderr
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    return p.returncode, json.loads(p.stdout), recs


@pytest.mark.parametrize("where, sig, want", [
    ("_summary", "SIGTERM", 143),   # while the startup summary is written
    ("_print", "SIGTERM", 143),     # while the report is printed
    ("finish_log", "SIGTERM", 0),   # after command_finished: the logged 0 stands
    ("_summary", "SIGINT", 130),
])
def test_a_signal_near_the_end_exits_as_the_log_says(tmp_path, where, sig, want):
    code, report, recs = _run(tmp_path, where, sig)
    last = recs[-1]
    assert last["event"] == "command_finished" and last["exit_code"] == code == want, (code, last)
    assert report["ok"] is (want == 0)
    if want:
        (stop,) = [r for r in recs if r["event"] == "run_interrupted"]
        assert stop["signal"] == sig and report["error"]["code"] == "interrupted"


@pytest.mark.parametrize("after", ["pipeline.launch", "torch"])
def test_sigint_while_starting_is_a_clean_130(tmp_path, after):
    """Ctrl-C while the console script imports the command line (just after ``pipeline.launch`` set its handlers) or
    torch: exit 130 and one ``interrupted`` error, never a KeyboardInterrupt traceback. ``-X importtime`` tells when
    the child is there (each import's line on stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-c", "from pipeline.launch import main; main()", "run",
                          "--device", "cpu", "--num-layers", "1", "--log-file", str(tmp_path / "l.jsonl")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if line.rstrip().endswith(f"| {after}") or (after == "torch" and "| torch." in line):
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    err = "".join(x for x in seen + err.splitlines(keepends=True) if not x.startswith("import time:"))
    assert p.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, (p.returncode, err)
    assert "interrupted" in err


def test_the_console_script_is_the_early_entry():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["attn-setup"] == "pipeline.launch:main"


# -- one behaviour for every failed run; its flags and model configs refused before torch is imported ----------
REFUSED = [(["--model", "{bad}"], 3, "model_config_malformed"), (["--page-size", "0"], 2, "out_of_domain"),
           (["--log-file", "{dir}"], 2, "usage"), (["--nope"], 2, "usage")]


@pytest.mark.parametrize("extra, code, err", REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_a_run_refused_at_its_command_line_reports_as_every_failed_run(tmp_path, extra, code, err):
    """A broken --model, a bad flag value, a bad --log-file: the run's headline, 'log: none', the verdict, the error
    in full (exit 2/3) — never another command's format — and torch never imported (a fresh process)."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"bad')
    argv = ["run", "--device", "cpu", *[a.format(bad=bad, dir=tmp_path) for a in extra]]
    script = ("import sys, json; from pipeline.cli import main; c = main(sys.argv[1:]); "
              "print(json.dumps([c, 'torch' in sys.modules]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=60)
    got, torch_imported = json.loads(p.stdout.splitlines()[-1])
    assert got == code and not torch_imported, (got, p.stderr)
    assert " ".join(p.stderr.split()).startswith(f"attn-setup run failed (exit {code}) in state args: {err}: ")
    assert "log: none: refused at its command line" in " ".join(p.stderr.split())
    assert p.stdout.splitlines()[0] == "failed" and f"error [{err}] in state args" in p.stderr
    p = subprocess.run([sys.executable, "-c", script, *argv, "--json"], capture_output=True, text=True, env=env,
                       timeout=60)
    report = json.loads(p.stdout.splitlines()[0])
    assert report["ok"] is False and report["error"]["code"] == err and report["log_file"] is None


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_torch_import_waits_for_the_whole_import(sig):
    """A Ctrl-C or SIGTERM inside ``import torch`` left torch half-imported (the run then failed with
    ``internal_error: cannot load module more than once``) or was lost: run holds both signals until the import is
    whole, then ends as an interrupt (KeyboardInterrupt, SIGTERM named) before its log opens."""
    import os
    import signal

    from pipeline.cli import run as run_cmd

    steps = []

    def importing() -> dict:
        steps.append("begun")
        os.kill(os.getpid(), getattr(signal, sig))  # arrives mid-import
        steps.append("whole")
        return {"seconds": 0.0}

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            run_cmd._import_torch_whole(importing)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert steps == ["begun", "whole"]
    assert ("SIGTERM" in str(e.value)) == (sig == "SIGTERM")
