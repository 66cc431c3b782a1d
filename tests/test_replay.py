"""Replay of golden traces; a changed rule is reported as the exact divergence."""

import json
from pathlib import Path

import pytest

import pipeline
from pipeline import testing
from pipeline.core.errors import UsageError
from pipeline.observe.replay import Divergence, replay
from pipeline.core import events as ev
from pipeline.core import wire

GOLDEN = Path(__file__).parent / "data" / "golden"
ALL = sorted(GOLDEN.glob("*.jsonl"))


def _raw(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_golden_traces_exist():
    assert len(ALL) >= 10


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_golden_trace_replays(path):
    result = testing.assert_replays(path)
    (run,) = result.runs
    failed = any(r["event"] == "run_failed" for r in _raw(path))
    # ok runs compare every decision through annotate; refused ones up to the recorded error
    assert run.checked[-1] == ("resolve.error.message" if failed else "annotate.names")
    assert run.stopped == ("failed in resolve as recorded" if failed else "")


def test_pipeline_replay_is_callable_and_merges():
    result = pipeline.replay([GOLDEN / "tp2_rank0.jsonl", GOLDEN / "tp2_rank1.jsonl"])
    assert result.same and [(r.run_id, r.rank) for r in result.runs] == [("golden-tp2", 0), ("golden-tp2", 1)]


def test_changed_blas_rule_diverges(monkeypatch):
    import states.device_init as di

    monkeypatch.setattr(di, "decide_blas", lambda device_type: True)
    d = replay(GOLDEN / "ok_default.jsonl").divergence
    assert d == Divergence(state="device-init", field="blas_init", recorded=False, now=True)


def test_changed_mode_rule_diverges(monkeypatch):
    import states.build_mode as bm
    from pipeline.core.contracts import Mode

    monkeypatch.setattr(bm, "decide_mode", lambda args, is_draft_worker: (Mode.TBO, []))
    d = replay(GOLDEN / "ok_default.jsonl").divergence
    assert (d.state, d.field, d.recorded, d.now) == ("build-mode", "mode", "normal", "tbo")
    with pytest.raises(AssertionError, match="state 'build-mode', field 'mode': recorded 'normal', now 'tbo'"):
        testing.assert_replays(GOLDEN / "ok_default.jsonl")


def test_dropped_refusal_diverges(monkeypatch):
    import states.resolve as rs

    monkeypatch.setattr(rs, "check_modes", lambda *a, **k: None)
    d = replay(GOLDEN / "failed_pdmux.jsonl").divergence
    assert (d.state, d.field, d.recorded, d.now) == ("resolve", "error.code", "capability_mismatch", None)


def test_changed_lazy_mem_rule_diverges(monkeypatch):
    import states.npu_lazy_mem as nl

    monkeypatch.setattr(nl, "decide", lambda *a: nl.LazyMemDecision(run=False, reason="changed"))
    d = replay(GOLDEN / "ok_default.jsonl").divergence
    assert (d.state, d.field, d.now) == ("npu-lazy-mem", "reason", "changed")
    assert d.recorded == "device type is 'cpu', zbal lazy memory exists on npu only"


def test_replay_uses_recorded_environment_not_current(monkeypatch):
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "999")
    assert replay(GOLDEN / "ok_default.jsonl").same
    monkeypatch.delenv("SGLANG_ZBAL_LOCAL_MEM_SIZE")
    rec = [r for r in _raw(GOLDEN / "ok_zbal_env.jsonl") if r["event"] == "setting_resolved"][0]
    assert (rec["value"], rec["source"]) == (4096, "env")
    assert replay(GOLDEN / "ok_zbal_env.jsonl").same


def test_unreadable_trace(tmp_path):
    p = tmp_path / "junk.jsonl"
    p.write_text("garbage\n")
    with pytest.raises(UsageError) as e:
        replay(p)
    assert e.value.info.code == "trace_unreadable"


def test_record_trace_on_fake_gpu_replays(tmp_path):
    from pipeline.core.contracts import SetupRequest
    from pipeline.core.model_spec import load_model_spec

    req = SetupRequest(model=load_model_spec(GOLDEN.parents[2] / "pipeline/data/configs/llama-3.1-8b.json"),
                       device="cuda:0", pool=pipeline.PoolFacts(max_reqs=2, max_context_len=64, num_token_slots=64))
    t = testing.record_trace(req, tmp_path / "fake.jsonl", facts=testing.cuda_facts(),
                             installed={"torch": True, "triton": False, "flashinfer-python": False})
    run = t.runs[0]
    d = run.decisions()
    assert d["device"]["blas_init"] is True and d["resolved"]["prefill"] == "torch_native"
    assert d["resolved"]["rejected"]["prefill"][0]["backend"] == "flashinfer"
    testing.assert_replays(tmp_path / "fake.jsonl")


def _record(tmp_path, config, name, **args):
    from pipeline.core.contracts import AttentionArgs, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    model = load_model_spec(GOLDEN.parents[2] / "examples/configs" / config)
    req = SetupRequest(args=AttentionArgs(**args), model=model, device="cpu",
                       pool=pipeline.PoolFacts(max_reqs=2, max_context_len=64, num_token_slots=16))
    testing.record_trace(req, tmp_path / name)
    return tmp_path / name


def test_dtype_rule_is_recorded_and_replayed(tmp_path, monkeypatch):
    """gemma-2 (float32 checkpoint): setting_resolved dtype bfloat16 from auto:float32_to_bfloat16 replays the
    same; a changed rule diverges at resolve / setting.dtype."""
    import states.resolve as rs
    from pipeline.core.contracts import DtypeChoice

    path = _record(tmp_path, "gemma-2-9b.json", "gemma2.jsonl")
    rec = [r for r in _raw(path) if r["event"] == "setting_resolved" and r["field"] == "dtype"]
    assert [(r["state"], r["value"], r["source"]) for r in rec] == [("resolve", "bfloat16", "auto:float32_to_bfloat16")]
    run = testing.assert_replays(path).runs[0]
    assert "resolve.setting.dtype" in run.checked
    monkeypatch.setattr(rs, "resolve_dtype", lambda args, model: DtypeChoice(value="float32", source="auto:checkpoint"))
    d = replay(path).divergence
    assert (d.state, d.field) == ("resolve", "setting.dtype")
    assert (d.recorded, d.now) == (["bfloat16", "auto:float32_to_bfloat16"], ["float32", "auto:checkpoint"])


def test_not_attention_layers_are_recorded_and_replayed(tmp_path):
    """Qwen3-Next: backends_resolved records the linear-attention layer ids; the trace replays the same and the
    inspect view shows them."""
    path = _record(tmp_path, "qwen3-next-80b-a3b-instruct.json", "qwen3next.jsonl")
    rec = next(r for r in _raw(path) if r["event"] == "backends_resolved")
    assert rec["not_attention"] == [{"kind": "linear_attention", "layer_ids": [i for i in range(48) if (i + 1) % 4]}]
    run = testing.assert_replays(path).runs[0]
    assert "resolve.not_attention" in run.checked
    assert run_decisions(path)["resolved"]["not_attention"] == rec["not_attention"]
    from pipeline.cli.inspect import _decision_lines

    assert "  not attention (no KV cache): linear_attention layers 0..2, 4..6, 8..10, 12..14, 16..18, 20..22, " \
           "24..26, 28..30, 32..34, 36..38, 40..42, 44..46 (36)" in _decision_lines(run_decisions(path))


def run_decisions(path):
    return testing.read_trace(path).runs[0].decisions()


def test_dtype_refusal_is_recorded_and_replayed(tmp_path):
    """--dtype float16 on gemma-2 fails in resolve with dtype_refused; replay fails the same way."""
    path = _record(tmp_path, "gemma-2-9b.json", "fp16.jsonl", dtype="float16")
    failed = next(r for r in _raw(path) if r["event"] == "run_failed")
    assert (failed["error"]["code"], failed["error"]["state"]) == ("dtype_refused", "resolve")
    run = testing.assert_replays(path).runs[0]
    assert run.stopped == "failed in resolve as recorded"


GOLDEN_TRACES = sorted((Path(__file__).resolve().parent / "data" / "golden").glob("*.jsonl"))


def _cut(src: Path, n: int, dst: Path) -> Path:
    dst.write_bytes(b"".join(src.read_bytes().splitlines(keepends=True)[:n]))
    return dst


@pytest.mark.parametrize("src", GOLDEN_TRACES, ids=lambda p: p.stem)
def test_no_prefix_of_a_recorded_trace_diverges(src, tmp_path):
    """Every prefix of every golden trace (each replays the same whole) replays the same or is trace_incomplete,
    never a divergence: a value the cut left out is not compared."""
    assert replay(src).same
    lines = src.read_bytes().splitlines()
    for n in range(1, len(lines)):
        path = _cut(src, n, tmp_path / f"{n}.jsonl")
        try:
            got = replay(path)
        except UsageError as e:
            assert e.info.code == "trace_incomplete", (n, e.info.message)
            assert "the trace ends in state" in e.info.message and e.exit_code == 2
            continue
        assert got.same and not any(r.ends_in for r in got.runs), (n, got)


def _lazy_cut(tmp_path: Path) -> Path:
    """A recorded ``run`` log cut right after its transition into npu-lazy-mem, as the finding's ``head -20``."""
    src = next(p for p in GOLDEN_TRACES if p.stem == "h200_flashinfer")
    lines = src.read_bytes().splitlines()
    n = next(i for i, line in enumerate(lines, 1)
             if (r := wire.decode_line(line)) and isinstance(r, ev.StateTransition) and r.to == "npu-lazy-mem")
    return _cut(src, n, tmp_path / "inc.jsonl")


def test_the_findings_cut_is_incomplete_not_diverged(tmp_path):
    from conftest import run_main

    inc = _lazy_cut(tmp_path)
    proc = run_main("replay", str(inc))
    assert proc.returncode == 2 and "DIVERGED" not in proc.stdout + proc.stderr
    assert proc.stderr.startswith("error [trace_incomplete]")
    text = " ".join(proc.stderr.split())
    assert "the trace ends in state 'npu-lazy-mem', before the run recorded its end" in text
    assert "decision(s) recorded up to there are the same now" in text
    err = json.loads(run_main("replay", str(inc), "--json").stdout)["error"]
    assert err["code"] == "trace_incomplete"
    assert {f["name"]: f["value"] for f in err["flags"]}["state"] == "npu-lazy-mem"
    # inspect agrees: incomplete
    assert ": incomplete" in run_main("inspect", str(inc)).stdout.splitlines()[0]


def test_a_real_divergence_before_the_cut_is_still_one(tmp_path):
    """Compare what was recorded: a recorded decision that differs is still DIVERGED (exit 1), cut or not."""
    from conftest import run_main

    inc = _lazy_cut(tmp_path)
    lines = inc.read_bytes().splitlines()
    i = next(i for i, line in enumerate(lines) if isinstance(wire.decode_line(line), ev.BuildPlanned))
    rec = json.loads(lines[i])
    rec["mode"] = "tbo"  # recorded normal: now a different mode than the rules decide
    lines[i] = json.dumps(rec).encode()
    inc.write_bytes(b"\n".join(lines) + b"\n")
    proc = run_main("replay", str(inc))
    assert proc.returncode == 1 and "DIVERGED in state 'build-mode'" in " ".join(proc.stdout.split())


@pytest.mark.parametrize("garble", [False, True], ids=["removed", "garbled"])
@pytest.mark.parametrize("src", [GOLDEN / "ok_default.jsonl", GOLDEN / "h200_hybrid.jsonl",
                                 GOLDEN / "failed_pdmux.jsonl"], ids=lambda p: p.stem)
def test_a_lost_line_in_a_run_that_goes_on_is_never_same(src, garble, tmp_path):
    """Any one line of a complete trace removed or garbled: replay still compares every other decision, and is
    never 'same' with fewer decisions checked than the whole trace; a lost decision record is trace_unreadable
    (exit 2) naming the state and the record (and the unreadable line)."""
    whole = len(replay(src).runs[0].checked)
    lines = src.read_bytes().splitlines()
    for i in range(1, len(lines) - 1):  # the first is run_started, the last ends the run
        kept = lines[:i] + ([b'{"event": "garbled'] if garble else []) + lines[i + 1:]
        path = tmp_path / f"{i}.jsonl"
        path.write_bytes(b"\n".join(kept) + b"\n")
        try:
            got = replay(path)
        except UsageError as e:
            assert e.info.code == "trace_unreadable" and e.exit_code == 2, (i, e.info.message)
            flags = {f.name: f.value for f in e.info.flags}
            if "state" not in flags:  # the run's own first record is the one lost
                assert "has no run_started record" in e.info.message, (i, e.info.message)
                continue
            assert flags["state"] in e.info.message and flags["record"] in e.info.message
            if garble:
                assert f"{path}:{i + 1} (not_json)" in e.info.message
            continue
        if got.same:
            assert len(got.runs[0].checked) == whole, (i, lines[i][:80], got.runs[0])
