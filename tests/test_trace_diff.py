"""``inspect --diff A B`` (issue 18 §5): per-state time deltas and changed decisions between two starts."""

from __future__ import annotations

import json
import time

import pytest

from conftest import CONFIGS, run_main
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.faults import Faults
from pipeline.core.model_spec import load_model_spec

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}


class SleepAt(Faults):
    """A fault that sleeps instead of raising: ``seconds`` at every point matching ``at``."""

    def __init__(self, at, seconds):
        super().__init__(at=at)
        self.seconds = seconds

    def hit(self, point, *objs):
        self.visited.append(point)
        if self.matches(point):
            time.sleep(self.seconds)


@pytest.fixture(scope="module")
def tiny():
    cfg = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    cfg["num_hidden_layers"] = 2
    return load_model_spec(cfg), PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64, page_size=1)


def _start(tiny, path, faults=None, **args):
    model, pool = tiny
    req = SetupRequest(args=AttentionArgs(**args), model=model, pool=pool, device="cpu")
    build_attention_backends(req, installed=INSTALLED, log_file=str(path), faults=faults).close()


@pytest.mark.parametrize("state", ["resolve", "build-mode"])
def test_a_two_second_sleep_is_reported_in_its_state(tiny, tmp_path, state):
    """A 2 s sleep injected at one state's fault point: that state's delta is 2000 ms ± 50 ms, every other
    state's is under 50 ms, and no decision changed."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _start(tiny, a)
    _start(tiny, b, SleepAt([f"state:{state}"], 2.0))
    p = run_main("inspect", "--diff", "--json", str(a), str(b))
    assert p.returncode == 0, p.stderr
    (rank,) = json.loads(p.stdout)["diff"]["ranks"]
    deltas = {s["state"]: s["delta_ms"] for s in rank["states"] if s["machine"] == "setup"}
    assert deltas[state] == pytest.approx(2000.0, abs=50.0)
    assert all(abs(d) < 50.0 for s, d in deltas.items() if s != state), deltas
    assert rank["decisions"] == []
    text = run_main("inspect", "--diff", str(a), str(b)).stdout
    assert f"setup:{state}" in text and "no decision changed" in text


def test_changed_decisions_are_listed(tiny, tmp_path):
    """TBO on in B: the mode, the instances, the annotation target and the flag itself show as A -> B."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _start(tiny, a)
    _start(tiny, b, enable_two_batch_overlap=True)
    (rank,) = json.loads(run_main("inspect", "--diff", "--json", str(a), str(b)).stdout)["diff"]["ranks"]
    changed = {c["key"]: (c["a"], c["b"]) for c in rank["decisions"]}
    assert changed["plan.mode"] == ("normal", "tbo")
    assert changed["args.enable_two_batch_overlap"] == (False, True)
    assert changed["annotated.target"][1] == "TboAttnBackend"
    assert [i["role"] for i in changed["plan.instances"][1]] == ["tbo.primary", "tbo.child0", "tbo.child1"]
    assert not any(k.startswith("device.") for k in changed)  # same machine: no device fact changed


@pytest.mark.parametrize("logs", [1, 3])
def test_diff_needs_exactly_two_logs(tiny, tmp_path, logs):
    a = tmp_path / "a.jsonl"
    _start(tiny, a)
    p = run_main("inspect", "--diff", "--json", *[str(a)] * logs)
    assert p.returncode == 2 and json.loads(p.stdout)["error"]["flags"][0]["name"] == "--diff"


def test_diff_of_an_unreadable_log_is_exit_2(tiny, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _start(tiny, a)
    b.write_text("not json\n")
    assert run_main("inspect", "--diff", str(a), str(b)).returncode == 2


def test_a_log_with_appended_starts_says_which_one_it_compares(tiny, tmp_path):
    """A log that several starts appended to: the diff compares each rank's last start and says so (how many starts
    the log holds, which run it took), in --json (starts_a/starts_b) and in the text."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _start(tiny, a)
    _start(tiny, a, enable_two_batch_overlap=True)
    _start(tiny, b)
    (rank,) = json.loads(run_main("inspect", "--diff", "--json", str(a), str(b)).stdout)["diff"]["ranks"]
    assert (rank["starts_a"], rank["starts_b"]) == (2, 1)
    assert {"key": "plan.mode", "a": "tbo", "b": "normal"} in rank["decisions"]  # the last start of A: the TBO one
    text = " ".join(run_main("inspect", "--diff", str(a), str(b)).stdout.split())
    assert f"A holds 2 starts of rank 0 (appended runs): comparing the last, run {rank['run_a']}" in text
    assert "B holds" not in text
