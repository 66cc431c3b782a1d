"""``inspect --diff A B``: per-state time deltas and changed decisions between two starts."""

from __future__ import annotations

import gc
import json
import time

import pytest

from conftest import CONFIGS, run_main
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.faults import Faults
from pipeline.core.model_spec import load_model_spec

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}


class Clocked(Faults):
    """Records every fault point with the test's own ``time.perf_counter()`` on arrival, and sleeps ``seconds`` at
    the points matching ``at`` (the sleep's own length measured too): the independent reference for each state's
    duration, so that scheduler noise in the states' real work cannot move the comparison."""

    def __init__(self, at=(), seconds=0.0):
        super().__init__(at=at)
        self.seconds, self.slept_ms, self.t = seconds, 0.0, {"call": time.perf_counter()}

    def hit(self, point, *objs):
        self.visited.append(point)
        self.t[point] = time.perf_counter()
        if self.matches(point):
            time.sleep(self.seconds)
            self.slept_ms += (time.perf_counter() - self.t[point]) * 1e3


def _bounds_ms(clock, states):
    """Each setup state's recorded duration, bracketed by the test's clock: ``(low, high)`` in ms.

    The machine times a state from the previous state's trigger to its own (the previous transition's log line
    included), and both triggers fire just after a ``state:<s>:done`` point, so for every state but the first the
    two ``:done`` points give its duration (low = high). The first state's clock starts inside the call, before its
    first fault point: its duration lies between its own work (``state:<s>`` → ``:done``) and the whole call so far."""
    out, prev = {}, None
    for s in states:
        done = clock.t[f"state:{s}:done"]
        if prev is None:
            out[s] = ((done - clock.t[f"state:{s}"]) * 1e3, (done - clock.t["call"]) * 1e3)
        else:
            out[s] = ((done - prev) * 1e3,) * 2
        prev = done
    return out


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
    """A 2 s sleep injected at one state's fault point: the reported delta of every setup state is the
    change the test's own clock measured in that state, within ± 50 ms — the slept state's includes the whole
    measured sleep (≥ 2 s), no other state's does —, and no decision changed. The reference is each state's measured
    duration in both runs, not a fixed 2000 / 0 ms, so a loaded machine slowing the states' real work moves the
    reported and the expected delta alike."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    gc.disable()  # a collection (~0.6 s with torch loaded) between a :done point and the trigger's clock read
    try:          # would move a state's recorded time away from what the test's clock saw
        clock_a = Clocked()  # each clock starts just before its own call (the first state's outer bound)
        _start(tiny, a, clock_a)
        clock_b = Clocked([f"state:{state}"], 2.0)
        _start(tiny, b, clock_b)
    finally:
        gc.enable()
    p = run_main("inspect", "--diff", "--json", str(a), str(b))
    assert p.returncode == 0, p.stderr
    (rank,) = json.loads(p.stdout)["diff"]["ranks"]
    rows = {s["state"]: s for s in rank["states"] if s["machine"] == "setup"}
    work = [s for s in rows if s != "done"]
    assert work == ["device-init", "resolve", "build-mode", "npu-lazy-mem", "annotate"]
    assert rows["done"]["delta_ms"] == 0.0
    assert clock_b.slept_ms >= 2000.0 and clock_a.slept_ms == 0.0
    ba, bb = _bounds_ms(clock_a, work), _bounds_ms(clock_b, work)
    for s in work:
        lo, hi = bb[s][0] - ba[s][1], bb[s][1] - ba[s][0]  # the change the test's clock allows, B − A
        assert lo - 50.0 <= rows[s]["delta_ms"] <= hi + 50.0, (s, rows[s], (lo, hi))
        assert (rows[s]["b_ms"] >= clock_b.slept_ms) == (s == state), (s, rows[s], clock_b.slept_ms)
    assert rank["decisions"] == []
    text = run_main("inspect", "--diff", str(a), str(b)).stdout
    assert f"setup:{state}" in text and "no decision changed" in text


def test_changed_decisions_are_listed(tiny, tmp_path):
    """TBO on in B: the mode, the instances, the annotation target and the flag itself show as A -> B."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _start(tiny, a)
    _start(tiny, b, enable_two_batch_overlap=True, moe_a2a_backend="deepep")
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
    _start(tiny, a, enable_two_batch_overlap=True, moe_a2a_backend="deepep")
    _start(tiny, b)
    (rank,) = json.loads(run_main("inspect", "--diff", "--json", str(a), str(b)).stdout)["diff"]["ranks"]
    assert (rank["starts_a"], rank["starts_b"]) == (2, 1)
    assert {"key": "plan.mode", "a": "tbo", "b": "normal"} in rank["decisions"]  # the last start of A: the TBO one
    text = " ".join(run_main("inspect", "--diff", str(a), str(b)).stdout.split())
    assert f"A holds 2 starts of rank 0 (appended runs): comparing the last, run {rank['run_a']}" in text
    assert "B holds" not in text
