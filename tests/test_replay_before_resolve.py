"""``replay`` of a trace whose runs failed before resolve: the trace reads, it holds no decision, and the error says
so — ``nothing_to_replay`` (exit 2) naming the run, the state it failed in and its recorded error code, never
``trace_unreadable``. A run that made decisions, or a lost ``run_started`` line, keeps its old outcome."""

import json
from pathlib import Path

import pytest

import pipeline
from pipeline.cli import main
from pipeline.core.errors import UsageError
from pipeline.observe.replay import replay
from pipeline.observe.trace import read_trace

DATA = Path(__file__).parent / "data"
REFUSED_DEVICE = DATA / "bad_inputs" / "traces" / "cli_run_refused_device.jsonl"  # a real `run --device cuda` on CPU
TWO_LAUNCHES = DATA / "bad_inputs" / "traces" / "two_launches_shared_run_id.jsonl"
GOLDEN = DATA / "golden"


def _flags(info):
    return {f.name: f.value for f in info.flags}


def test_run_refused_at_its_flags_is_nothing_to_replay(tmp_path, capsys):
    """A real `attn-setup run` refused at its flags (`--num-layers 100`: invalid_value, exit 3, state args), logged
    to a file as README shows: replay exits 2 with nothing_to_replay naming that run, state and code."""
    log = tmp_path / "refused.jsonl"
    assert main(["run", "--device", "cpu", "--num-layers", "100", "--log-file", str(log), "--json"]) == 3
    capsys.readouterr()
    (run,) = read_trace(log).runs
    assert (run.started, run.failure.state, run.failure.code) == (None, "args", "invalid_value")

    assert main(["replay", "--json", str(log)]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "nothing_to_replay"
    assert {f["name"]: f["value"] for f in err["flags"]} == {
        "run_id": run.run_id, "rank": 0, "state": "args", "error_code": "invalid_value"}
    assert err["message"] == (
        f"the trace is readable but holds no decision to replay: run {run.run_id} rank 0 launch {run.launch_id}: "
        "'attn-setup run' (exit 3) failed in state 'args' with invalid_value, before resolve (replay compares what "
        "resolve and the states after it decided)")
    assert "attn-setup inspect LOG" in err["remedy"]

    assert main(["replay", str(log)]) == 2
    text = " ".join(capsys.readouterr().err.split())
    assert "error [nothing_to_replay]" in text and "failed in state 'args' with invalid_value" in text
    assert "trace_unreadable" not in text and "unreadable" not in text


def test_recorded_device_refusal_names_state_and_code():
    """The recorded trace of `attn-setup run --device cuda` on a CPU-only machine (device_unavailable in args)."""
    with pytest.raises(UsageError) as e:
        replay(REFUSED_DEVICE)
    info = e.value.info
    assert (info.code, e.value.exit_code) == ("nothing_to_replay", 2)
    assert _flags(info) == {"run_id": "20261202T031627-835ac5c8", "rank": 0, "state": "args",
                            "error_code": "device_unavailable"}
    assert "'attn-setup run' (exit 3) failed in state 'args' with device_unavailable, before resolve" in info.message


def test_library_run_failed_in_device_init_is_nothing_to_replay(tmp_path):
    """A library start failed in device-init (run_started written, no device facts) replayed as `same (0 decisions
    checked)`, exit 0: it is nothing_to_replay, exit 2, naming device-init and the recorded code."""
    from pipeline.core.contracts import PoolFacts, SetupRequest
    from pipeline.core.faults import Faults
    from pipeline.core.model_spec import load_model_spec
    from pipeline.testing import FakePlatform, cpu_facts

    req = SetupRequest(model=load_model_spec(GOLDEN.parents[2] / "pipeline/data/configs/llama-3.1-8b.json"),
                       device="cpu", pool=PoolFacts(max_reqs=2, max_context_len=64, num_token_slots=64))
    log = tmp_path / "lib.jsonl"
    with pytest.raises(Exception):
        pipeline.build_attention_backends(req, platform=FakePlatform(cpu_facts()), log_file=str(log),
                                          faults=Faults(at=["state:device-init"]))
    (run,) = read_trace(log).runs
    assert run.started is not None and run.failure.state == "device-init"
    with pytest.raises(UsageError) as e:
        replay(log)
    assert e.value.info.code == "nothing_to_replay"
    assert _flags(e.value.info)["state"] == "device-init"
    assert _flags(e.value.info)["error_code"] == run.failure.code == "injected_fault"
    assert f"run {run.run_id} rank 0 launch {run.launch_id}: the run failed in state 'device-init' with " \
           "injected_fault, before resolve" in e.value.info.message


def test_refused_launch_next_to_a_good_one_still_replays():
    """Two launches of one run id: the refused one is a stopped note naming its state and code, the good one is
    compared; the result is `same` (exit 0), as before."""
    result = replay(TWO_LAUNCHES)
    refused, good = result.runs
    assert result.same and good.checked and not refused.checked
    t = read_trace(TWO_LAUNCHES)
    f = t.runs[0].failure
    assert refused.stopped == (f"no run_started record: 'attn-setup run' (exit 2) failed in state {f.state!r} with "
                               f"{f.code}, before the attention pipeline started, so it made no decision to replay")


def test_lost_run_started_line_of_a_run_that_decided_stays_unreadable(tmp_path):
    """A run that failed in resolve (after run_started) whose run_started line is gone: its decisions are
    unreadable, not absent — trace_unreadable, as before."""
    lines = (GOLDEN / "failed_pdmux.jsonl").read_text().splitlines()
    log = tmp_path / "cut.jsonl"
    log.write_text("\n".join(x for x in lines if json.loads(x)["event"] != "run_started") + "\n")
    assert read_trace(log).runs[0].failure.state == "resolve"
    with pytest.raises(UsageError) as e:
        replay(log)
    assert e.value.info.code == "trace_unreadable"
