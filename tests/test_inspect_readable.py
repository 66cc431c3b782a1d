"""``inspect`` reads as the live run did (session 13): a multi-rank failure's text with real line ends
and dashes, every rank's value as ``rank 0: 8; rank 1: 16``, the flag the user set named (the capture list derived
from ``--max-reqs`` said to be derived); ``inspect --diff`` saying ``not set`` and exiting as ``inspect`` does; a
junk LOG named as a plain path; ``--slow-phase-s``'s warnings in ``run``'s report, its ``--json`` and ``inspect``.
In-process: the rank error is built by the exchange's own code from two ranks' reports, the starts are the library's
or ``run``'s in this process."""

from __future__ import annotations

import json
import re

import pytest

from conftest import CONFIGS, run_main
from pipeline.cli.output import render_error
from pipeline.cli.output import cli_error, command_dests
from pipeline.core import events as ev
from pipeline.core import wire
from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
from pipeline.core.contracts import Resolution, ResolvedAttentionBackendStr
from pipeline.core.errors import AttnSetupError
from pipeline.core.eventlog import EventLog
from pipeline.core.model_spec import load_model_spec
from pipeline.setup.build import build_attention_backends
from pipeline.setup.distributed import RankReport, _diverging, _divergence, _row

RES = Resolution(pair=ResolvedAttentionBackendStr(prefill="torch_native", decode="torch_native"),
                 rules={"prefill": "auto", "decode": "auto"})
REPRS = re.compile(r"\\u[0-9a-f]{4}|\\n|\{'|\['|'\]|None\b")  # a Python repr or a literal escape


def _max_reqs_divergence():
    """The error both ranks raise when ``--max-reqs`` is 8 on rank 0 and 16 on rank 1 (the capture lists follow)."""
    reports = [RankReport(rank=r, host="vm", device=DeviceFacts(type="cpu"), args=AttentionArgs(), resolution=RES,
                          digest={"pool.max_reqs": str(n), "cuda_graph_bs": bs})
               for r, (n, bs) in enumerate([(8, "1,2,4,8"), (16, "1,2,4,8,16")])]
    rows = [_row(r) for r in reports]
    return _divergence(0, rows, reports, _diverging(reports)).info


def _failed_log(path, info):
    log = EventLog("r1", rank=0, path=str(path))
    log.emit(ev.CommandStarted, state="args", command="run", argv=["run", "--device", "cpu", "--max-reqs", "8"])
    log.emit(ev.RunFailed, state="resolve", outcome="failed", error=info)
    log.emit(ev.CommandFinished, state="failed", command="run", exit_code=3, duration_ms=1.0)
    log.close()


def test_rank_divergence_reads_in_inspect_as_it_did_live(tmp_path, capsys):
    """The trial's two CPU ranks with different --max-reqs: inspect prints the table on lines of its own, the em dash,
    the flag to change is --max-reqs with every rank's value, the capture list is derived (never a flag to change),
    and no repr or escape; the live error block words the entries the same way."""
    info = _max_reqs_divergence()
    assert {f.name: f.value for f in info.flags}["derived"] == {"cuda_graph_bs": "pool.max_reqs"}
    log = tmp_path / "r.rank0.jsonl"
    _failed_log(log, info)
    p = run_main("inspect", str(log))
    text = p.stdout
    assert p.returncode == 1 and not REPRS.search(text), text
    assert "disagree on --max-reqs (and so on the decode batch sizes to capture, derived from --max-reqs) —" \
        in " ".join(text.split()), text
    assert re.search(r"^ +rank +host +device +prefill +decode +error$", text, re.M), text
    assert re.search(r"^ +1 +vm +cpu +torch_native +torch_native$", text, re.M), text
    assert "flag to change: --max-reqs = rank 0: 8; rank 1: 16" in text
    assert "derived cuda_graph_bs = rank 0: 1,2,4,8; rank 1: 1,2,4,8,16 (from --max-reqs)" in text
    assert "field diverging = cuda_graph_bs, pool.max_reqs" in text
    assert "--cuda-graph-bs" not in text
    capsys.readouterr()
    render_error(cli_error(info, command_dests("run")))  # the live run's error block
    err = capsys.readouterr().err
    assert not REPRS.search(err) and "--cuda-graph-bs" not in err, err
    assert re.search(r"^  flag +--max-reqs = rank 0: 8; rank 1: 16$", err, re.M), err
    assert re.search(r"^  rank +host +device", err, re.M), err  # the table's rows stay rows at 80 columns


def test_a_capture_list_set_by_its_own_flag_is_not_derived():
    """--cuda-graph-bs itself differing: no derived entry, the flag is the one to change."""
    reports = [RankReport(rank=r, host="vm", device=DeviceFacts(type="cpu"), args=AttentionArgs(cuda_graph_bs=bs),
                          resolution=RES,
                          digest={"pool.max_reqs": "8", "cuda_graph_bs": ",".join(map(str, bs))})
               for r, bs in enumerate([[1, 2], [1, 2, 4]])]
    info = _divergence(0, [_row(r) for r in reports], reports, _diverging(reports)).info
    assert "derived" not in {f.name for f in info.flags}
    assert "--cuda-graph-bs" in {f.name for f in cli_error(info, command_dests("run")).flags}


def test_values_are_worded_not_repred():
    from pipeline.core.value_text import value_text

    assert value_text(None) == "not set" and value_text(True) == "on"
    assert value_text("") == "''" and value_text("", no_value=True) == "(no value)"   # typed empty vs typed without one
    assert value_text(["logs/junk.jsonl"]) == "logs/junk.jsonl" and value_text([]) == "none"
    assert value_text({"0": "8", "1": "16"}) == "rank 0: 8; rank 1: 16"
    assert value_text({"host": "vm", "error": None}) == "host vm, error not set"
    assert value_text([{"state": "resolve", "what": "x"}, {"state": "annotate"}]) == \
        "(state resolve, what x), (state annotate)"


def test_a_junk_log_is_named_as_a_plain_path(tmp_path, monkeypatch):
    """``inspect logs/junk.jsonl``: ``arg LOG = logs/junk.jsonl``, not the list's repr (--json keeps the list)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "junk.jsonl").write_text("junk\nmore junk {\n")
    p = run_main("inspect", "logs/junk.jsonl")
    assert p.returncode == 2 and re.search(r"^  arg +LOG = logs/junk.jsonl$", p.stderr, re.M), p.stderr
    assert not REPRS.search(p.stderr), p.stderr
    j = run_main("inspect", "--json", "logs/junk.jsonl")
    assert json.loads(j.stdout)["error"]["flags"] == [{"name": "LOG", "value": ["logs/junk.jsonl"]}]


@pytest.fixture(scope="module")
def tiny():
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg["num_hidden_layers"] = 2
    return load_model_spec(cfg), PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64, page_size=1)


def _start(tiny, path, **args):
    model, pool = tiny
    req = SetupRequest(args=AttentionArgs(**args), model=model, pool=pool, device="cpu")
    build_attention_backends(req, installed={"torch": True, "triton": False, "flashinfer-python": False},
                             log_file=str(path)).close()


def test_diff_says_not_set_and_exits_as_inspect(tiny, tmp_path):
    """An absent value reads ``not set`` (no repr); the exit is inspect's: 0 when both started, 1 when B failed."""
    a, b, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "bad.jsonl"
    _start(tiny, a, attention_backend="torch_native")
    _start(tiny, b)
    p = run_main("inspect", "--diff", str(a), str(b))
    assert p.returncode == 0 and "changed input args.attention_backend: 'torch_native' -> not set" in p.stdout, p.stdout
    assert not REPRS.search(p.stdout), p.stdout
    assert json.loads(run_main("inspect", "--diff", "--json", str(a), str(b)).stdout)["diff"]["ok"] is True
    with pytest.raises(AttnSetupError):
        _start(tiny, bad, enable_pdmux=True, enable_two_batch_overlap=True)
    p = run_main("inspect", "--diff", "--json", str(a), str(bad))
    assert p.returncode == 1 and json.loads(p.stdout)["diff"]["ok"] is False
    assert run_main("inspect", "--diff", str(a), str(bad)).returncode == 1


def test_slow_phases_show_in_report_json_and_inspect(tmp_path):
    """``--slow-phase-s``: run's human report names the slow phases under the startup summary (before the verdict),
    ``--json``'s warnings list them (code ``slow_phase``), inspect prints the same line and ``slow_phases``."""
    log = tmp_path / "a.jsonl"
    argv = ["run", "--device", "cpu", "--num-layers", "1", "--decode-steps", "1", "--slow-phase-s", "1e-6"]
    p = run_main(*argv, "--log-file", str(log))
    assert p.returncode == 0, p.stderr
    recs = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    slow = [r for r in recs if isinstance(r, ev.SlowPhase)]
    assert slow
    out = " ".join(p.stdout.split())
    assert "warning: slow phases (over 1e-06 s): " in out and "load-model " in out, p.stdout
    assert out.index("startup summary") < out.index("slow phases") < out.rindex("ok")
    assert "--strict refuses" not in p.stdout  # not a fallback or downgrade
    j = json.loads(run_main(*argv, "--json", "--log-file", str(tmp_path / "b.jsonl")).stdout)
    warned = [w for w in j["warnings"] if w["code"] == "slow_phase"]
    assert warned and {"what", "message"} <= set(warned[0]) and any(w["what"] == "load-model" for w in warned)
    text = " ".join(run_main("inspect", str(log)).stdout.split())
    assert "slow phases (over 1e-06 s): " in text and "load-model " in text, text
    (run,) = json.loads(run_main("inspect", "--json", str(log)).stdout)["runs"]
    assert [(s["phase"], s["parent"]) for s in run["slow_phases"]] == [(r.phase, r.parent) for r in slow]
