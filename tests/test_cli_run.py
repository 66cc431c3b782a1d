"""`attn-setup run` on every bundled config, with each config's pinned CPU outcome (in-process: ``run_main``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import CONFIGS, run_main
from pipeline.core import events as ev
from pipeline.core import wire

SIX = ["device-init", "resolve", "build-mode", "npu-lazy-mem", "annotate", "done"]
RUNNER = ["init-distributed", "load-model", "init-memory-pool", "attention", "capture-cuda-graphs", "ready"]

# config → (extra flags, exit code, mode, roles verified); written from the rules, not by running the tool.
PINNED = {
    "llama-3.1-8b.json": ([], 0, "normal", ["primary"]),
    "qwen2.5-7b.json": (["--page-size", "16"], 0, "normal", ["primary"]),
    "mistral-7b-v0.1.json": (["--page-size", "64"], 0, "normal", ["primary"]),
    "gemma-2-9b.json": (["--enable-two-batch-overlap", "--moe-a2a-backend", "deepep"], 0, "tbo",
                        ["tbo.primary", "tbo.child0", "tbo.child1", "tbo.wrapper"]),
    "qwen3-8b.json": (["--enable-pdmux"], 3, None, []),  # PD-mux needs GPU SMs: refused on CPU
    "deepseek-v2-lite.json": (["--kv-cache-dtype", "fp8_e4m3"], 0, "normal", ["primary"]),
    # 128 heads of 7168 hidden: a CPU run would build ~0.6 GB of weights per layer, so CI pins the refusal of a
    # GPU-only backend instead (exit 3 before the model loads); tests/gpu/test_bundled_run_gpu.py runs it on CUDA
    "deepseek-v3.json": (["--attention-backend", "flashinfer"], 3, None, []),
    "gpt-oss-20b.json": (["--attention-backend", "torch_native"], 0, "normal", ["primary"]),
    "qwen3-next-80b-a3b-instruct.json": (["--page-size", "16"], 0, "normal", ["primary"]),
    "llama-4-scout-17b-16e-instruct.json": ([], 0, "normal", ["primary"]),
    "gemma-3-12b-it.json": ([], 0, "normal", ["primary"]),
}
# config → (dtype, its rule, not-attention layers of what the run builds): --num-layers defaults to the first 2
# attention layers (more when a kind starts later), so Qwen3-Next builds layers 0..7 (attention 3 and 7).
RUN_DTYPE = {"gemma-2-9b.json": ("bfloat16", "auto:float32_to_bfloat16", []),
             "gpt-oss-20b.json": ("float16", "auto:missing_torch_dtype_as_float32_to_float16", []),  # no torch_dtype
             "qwen3-next-80b-a3b-instruct.json": ("bfloat16", "auto:checkpoint",
                                                  [{"kind": "linear_attention", "layer_ids": [0, 1, 2, 4, 5, 6]}])}
# the served sliding window of the windowed configs: verification builds its instances for window 7 instead
WINDOWS = {"mistral-7b-v0.1.json": 4096, "gemma-2-9b.json": 4096, "gpt-oss-20b.json": 128,
           "gemma-3-12b-it.json": 1024}


run_cli = run_main


def test_every_bundled_config_is_pinned():
    """The table covers exactly the shipped configs."""
    assert sorted(PINNED) == sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("config", sorted(PINNED))
def test_run_outcome_per_config(config, tmp_path):
    """run --json: exit code, states, plan and every instance verified as pinned; the log replays the states."""
    flags, code, mode, roles = PINNED[config]
    log = tmp_path / "{run_id}.rank{rank}.jsonl"
    proc = run_cli("run", "--device", "cpu", "--json", "--model", str(CONFIGS / config), "--log-file", str(log), *flags)
    assert proc.returncode == code, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is (code == 0)
    assert set(out) == {"ok", "run_id", "states", "resolved", "plan", "skips", "warnings", "verified", "log_file",
                        "error", "runner_states", "model_steps", "summary", "device"}
    records = [wire.decode_line(l) for l in Path(out["log_file"]).read_bytes().splitlines()]
    check_summary(records, out["summary"])
    assert all(r.run_id == out["run_id"] for r in records)
    transitions = [r for r in records if isinstance(r, ev.StateTransition)]
    if code == 0:
        assert [s["state"] for s in out["states"]] == SIX
        assert [t.from_state for t in transitions] + [transitions[-1].to] == SIX
        assert out["plan"]["mode"] == mode and out["error"] is None
        assert [v["role"] for v in out["verified"]] == roles
        assert all(v["passed"] and v["max_rel_err"] <= v["tol"] for v in out["verified"])
        note = f"sliding window {WINDOWS[config]}->7" if config in WINDOWS else "sliding window"
        assert all((note in v["detail"]) is (config in WINDOWS) for v in out["verified"])
        assert out["resolved"]["prefill"] == "torch_native"
        dtype, rule, others = RUN_DTYPE.get(config, ("bfloat16", "auto:checkpoint", []))
        assert out["resolved"]["dtype"] == {"value": dtype, "source": rule}
        assert out["resolved"]["not_attention"] == others
        assert [(r.value, r.source) for r in records if isinstance(r, ev.SettingResolved) and r.field == "dtype"] \
            == [(dtype, rule)]
        assert [s["state"] for s in out["runner_states"]] == RUNNER
        assert out["model_steps"] and all(s["passed"] and not s["graph"] for s in out["model_steps"])
    else:
        assert out["error"]["code"] and out["error"]["remedy"] and out["verified"] == []
        assert transitions[-1].to == "failed"
        assert not any(isinstance(r, ev.BackendBuilt) for r in records)
        assert any(isinstance(r, ev.RunFailed) and r.error.code == out["error"]["code"] for r in records)


def check_summary(records, summary):
    """The startup_summary against the records it came from, recomputed here: it is the last record before
    command_finished and equals --json's ``summary``; each runner state's phase is its transition's duration,
    each setup state's its state_transition's, each instance's its instance_verified's; ``startup`` runs from
    the process start to command_started; top-level phases + unaccounted = wall = process start to the summary."""
    import msgspec

    s = records[-2]
    assert isinstance(s, ev.StartupSummary) and isinstance(records[-1], ev.CommandFinished)
    assert msgspec.to_builtins(s) == summary
    top = {p.name: p.seconds for p in s.phases if not p.parent}
    runner = False  # setup states logged by a preflight refusal belong to preflight
    for r in records:
        runner = runner or isinstance(r, ev.RunnerStarted)
        if isinstance(r, ev.RunnerTransition):
            assert top[r.from_state] == pytest.approx(r.duration_ms / 1e3, abs=1e-6)
        if isinstance(r, ev.StateTransition):
            assert any(p.parent == ("attention" if runner else "preflight") and p.name == r.from_state
                       and p.seconds == pytest.approx(r.duration_ms / 1e3, abs=1e-6) for p in s.phases)
        if isinstance(r, ev.InstanceVerified):
            assert any(p.parent == "verification" and p.name == r.role and r.duration_ms > 0
                       and p.seconds == pytest.approx(r.duration_ms / 1e3, abs=1e-6) for p in s.phases)
    cmd = next(r for r in records if isinstance(r, ev.CommandStarted))
    assert s.process_start_ns > 0 and top["startup"] == pytest.approx((cmd.ts_ns - s.process_start_ns) / 1e9, abs=1e-5)
    # wall_s ends when the summary is taken; the record is stamped when written, after the phases are summed
    # (microseconds, or a few ms when the 2-core machine is busy)
    assert 0 <= (s.ts_ns - s.process_start_ns) / 1e9 - s.wall_s < 0.1
    assert sum(top.values()) + s.unaccounted_s == pytest.approx(s.wall_s, abs=1e-4)
    assert all(p.seconds >= 0 for p in s.phases)
    assert abs(s.unaccounted_s) < 0.25  # the gaps between named phases are small (in-process: no exit to cover)


def test_log_file_placeholders(tmp_path):
    """{run_id} and {rank} are filled into --log-file."""
    proc = run_cli("run", "--device", "cpu", "--json", "--rank", "1", "--world-size", "2", "--num-layers", "1",
                   "--decode-steps", "0", "--log-file", str(tmp_path / "x-{run_id}-r{rank}.jsonl"))
    out = json.loads(proc.stdout)
    assert Path(out["log_file"]).name == f"x-{out['run_id']}-r1.jsonl"


@pytest.mark.parametrize("args,code,field", [
    (["--page-size", "0"], 2, "--page-size"),
    (["--attention-backend", "nope"], 2, "--attention-backend"),
    (["--attention-backend", "flashmla"], 3, "--attention-backend"),
    (["--page-size", "abc"], 2, None),
    (["--model", "/nonexistent/config.json"], 2, "--model"),
    (["--no-such-flag"], 2, None),
    (["--sm-group-num", "0"], 2, "--sm-group-num"),
    (["--enable-pdmux", "--enable-two-batch-overlap"], 3, "--enable-pdmux"),
])
def test_bad_input_exit_codes(args, code, field, tmp_path):
    """Bad flags exit 2, refused configurations exit 3, each with one ErrorInfo naming the flag (as typed)."""
    proc = run_cli("run", "--device", "cpu", "--json", "--log-file", str(tmp_path / "l.jsonl"), *args)
    assert proc.returncode == code, proc.stdout + proc.stderr[-1000:]
    err = json.loads(proc.stdout)["error"]
    assert err["message"] and err["remedy"]
    if field:
        assert field in [f["name"] for f in err["flags"]]


def test_human_output_has_tables(tmp_path):
    """Without --json the states and verification tables are printed."""
    proc = run_cli("run", "--device", "cpu", "--log-file", str(tmp_path / "l.jsonl"), "--num-layers", "1",
                   "--decode-steps", "0")
    assert proc.returncode == 0
    for word in ("device-init", "npu-lazy-mem", "verification", "torch_native", "dtype: bfloat16 (auto:checkpoint)"):
        assert word in proc.stdout
    # the verdict is the last line, after the startup summary, as plan's (it sat above the summary table)
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    summary = next(i for i, line in enumerate(lines) if line.startswith("startup summary"))
    assert lines[-1] == "ok" and lines.count("ok") == 1 and summary < len(lines) - 1


def test_human_output_of_a_hybrid_names_dtype_rule_and_not_attention_layers(tmp_path, capsys):
    """run (tables) on Qwen3-Next: the dtype with its rule and the linear-attention layers it skipped."""
    from pipeline.cli import main

    assert main(["run", "--device", "cpu", "--model", str(CONFIGS / "qwen3-next-80b-a3b-instruct.json"),
                 "--num-layers", "1", "--decode-steps", "1", "--log-file", str(tmp_path / "l.jsonl")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # lines wrap at words to the console's width
    assert "dtype: bfloat16 (auto:checkpoint)" in out
    assert "not attention (no KV cache, computed by the model's own kernels): linear_attention layers 0, 1, 2" in out


def test_mem_bytes_too_small_is_refused_before_the_model_loads(tmp_path, capsys):
    """Exit 3 means nothing was allocated: the byte budget is checked in preflight, not after load-model."""
    from pipeline.cli import main

    log = tmp_path / "l.jsonl"
    assert main(["run", "--device", "cpu", "--mem-bytes", "1000", "--log-file", str(log), "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["error"]["code"] == "pool_budget_too_small" and out["error"]["flags"][0] == {"name": "--mem-bytes", "value": 1000}
    events = [json.loads(x)["event"] for x in log.read_text().splitlines()]
    assert "model_loaded" not in events and "runner_started" not in events
    assert events[-3:] == ["run_failed", "startup_summary", "command_finished"]  # the refusal, the summary, the exit code


def test_pool_must_hold_the_verification_batches_before_the_model_loads(tmp_path, capsys):
    """The slots run's checks allocate (verify + model steps, whole pages) are the boundary: one less is
    refused in preflight naming the flag and the need; exactly that many runs (pages 1 and 16)."""
    from pipeline.cli import main
    from pipeline.memory.pools import check_needs

    for ps in (1, 16):
        need = check_needs(8, ps).slots
        log = tmp_path / f"l{ps}.jsonl"
        assert main(["run", "--device", "cpu", "--page-size", str(ps), "--num-token-slots", str(need - ps),
                     "--log-file", str(log), "--json"]) == 3
        out = json.loads(capsys.readouterr().out)
        assert out["error"]["code"] == "pool_budget_too_small" and out["error"]["allowed"] == [f">= {need}"]
        assert "model_loaded" not in log.read_text()
    assert main(["run", "--device", "cpu", "--num-token-slots", str(need), "--page-size", "16",
                 "--log-file", str(tmp_path / "ok.jsonl"), "--json"]) == 0
    capsys.readouterr()
    for frac in ("0", "nan", "1.5"):  # outside (0, 1]: refused as the flags are read
        assert main(["run", "--device", "cpu", "--mem-fraction", frac, "--log-file", str(tmp_path / "f.jsonl"),
                     "--json"]) == 2
        out = json.loads(capsys.readouterr().out)
        assert out["error"]["flags"][0]["name"] == "--mem-fraction" and out["error"]["state"] == "args"


@pytest.mark.parametrize("args,code", [([], 0), (["--attention-backend", "triton"], 3),
                                       (["--cuda-graph-bs", "64"], 3)])
def test_run_resolves_once(tmp_path, monkeypatch, args, code):
    """One resolve per run: the preflight decides, the setup machine takes its decisions (and a refusal is raised
    at its own state, logged there), nothing decides again; every state of the setup machine is still logged."""
    import states.resolve as rs
    from pipeline.cli import main

    calls, real = [], rs.decide

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(rs, "decide", counting)
    log = tmp_path / "l.jsonl"
    assert main(["run", "--device", "cpu", "--json", "--num-layers", "1", "--decode-steps", "0", "--log-file",
                 str(log), *args]) == code
    assert len(calls) == 1
    recs = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    moved = [(r.from_state, r.to) for r in recs if isinstance(r, ev.StateTransition)]
    if code == 0:
        assert [f for f, _ in moved] == ["device-init", "resolve", "build-mode", "npu-lazy-mem", "annotate"]
    else:  # refused in preflight: logged by the setup machine where it happened, before anything was built
        failed = next(r for r in recs if isinstance(r, ev.RunFailed))
        assert moved[-1][1] == "failed" and moved[-1][0] == failed.error.state
        assert not [r for r in recs if isinstance(r, (ev.BackendBuilt, ev.RunnerStarted))]


def test_an_in_process_run_frees_its_memory_when_it_returns(tmp_path):
    """No reference cycle keeps the run's pools or weights alive after ``main()`` returns: with the cyclic garbage
    collector off, no tensor above 1 MB is left (an in-process H200 run kept its 130 GB KV pool until gc ran;
    the setup context and the runner's stack sat in cycles with their machines' callbacks)."""
    import gc

    import torch

    gc.collect()
    gc.disable()
    try:
        proc = run_main("run", "--device", "cpu", "--json", "--num-layers", "2", "--decode-steps", "1",
                        "--log-file", str(tmp_path / "a.jsonl"))
        # type(o), not isinstance(o): isinstance reads o.__class__, and one of the objects gc holds is
        # torch.distributed.reduce_op, whose every attribute read warns that it is deprecated
        left = [(tuple(o.shape), str(o.dtype)) for o in gc.get_objects()
                if issubclass(type(o), torch.Tensor) and o.numel() > 1 << 18]
    finally:
        gc.enable()
    assert proc.returncode == 0 and left == []


def test_failed_run_prints_its_error_last_under_a_rule(capsys, tmp_path):
    """Text mode: a refused run's headline first on stderr (tests/test_failed_run_output.py), its report on stdout,
    then on stderr a red rule naming the failure and its exit code, then the error block and nothing after it (the
    error is where the eye lands when the prompt returns); --json prints the same one object as before, without
    the headline or the rule."""
    from pipeline.cli import main

    argv = ["run", "--device", "cpu", "--enable-pdmux", "--enable-two-batch-overlap", "--log-file",
            str(tmp_path / "l.jsonl")]
    assert main(argv) == 3
    out, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[0].startswith("attn-setup run failed (exit 3) in state resolve: conflicting_options:")
    rule = next(i for i, x in enumerate(lines) if x.startswith("attn-setup run failed (exit 3) ─"))
    assert lines[rule + 1].startswith("error [conflicting_options] in state resolve")
    assert lines[-1] == "  remedy: drop --enable-pdmux and --enable-two-batch-overlap"
    assert "startup summary" in out and "run failed" not in out
    out_lines = [x.strip() for x in out.splitlines() if x.strip()]
    assert out_lines[-1] == "failed" and out_lines.count("failed") == 1   # stdout's verdict last, after the summary
    assert main([*argv, "--json"]) == 3
    out, err = capsys.readouterr()
    # dropping PD-mux alone leaves TBO, which needs attention DP or an EP all-to-all (sglang's rule)
    assert json.loads(out)["error"]["remedy"] == "drop --enable-pdmux and --enable-two-batch-overlap"
    assert "run failed" not in out + err


def _ns(**kw):
    import argparse

    return argparse.Namespace(**{**dict(world_size=1, rank=0, decode_steps=3), **kw})


def test_large_model_notice_suggests_fewer_layers_than_in_use():
    """``run --model deepseek-v3.json`` (default 2 layers, 5.9 GiB) said "--num-layers 2 verifies the same
    layer kinds in seconds": the count already in use. The notice names a count below the one in use (run's
    default, else the fewest with one layer of each kind) with its estimate, or says it is already the fewest."""
    from conftest import CONFIGS
    from pipeline.cli.run import run_notices
    from pipeline.core.contracts import AttentionArgs, SetupRequest
    from pipeline.core.model_spec import load_model_spec

    def notice(cfg: str, layers: int) -> str:
        req = SetupRequest(args=AttentionArgs(), model=load_model_spec(CONFIGS / cfg), device="cpu")
        return " ".join(run_notices(_ns(), req, layers, False))

    v3 = notice("deepseek-v3.json", 2)
    assert v3.startswith("2 attention layers need about 5.9 GiB")
    assert "--num-layers 2" not in v3 and "--num-layers 1 verifies the same layer kinds with about 2.9 GiB" in v3
    assert notice("deepseek-v3.json", 1) == ""  # 2.9 GiB: below the notice's 4 GiB
    from pipeline.cli.run import _fewer

    v3_spec = load_model_spec(CONFIGS / "deepseek-v3.json")
    assert _fewer(v3_spec, 1, "bfloat16") == "1 is already the fewest attention layers that include every layer kind " \
                                            "of this model"
    assert "--num-layers 2 verifies the same layer kinds with about 0.8 GiB" in notice("llama-3.1-8b.json", 32)
    # Gemma-3 needs 6 leading layers for both kinds: 7 suggests 6, never fewer than cover both kinds
    g3 = notice("gemma-3-12b-it.json", 40)
    assert "--num-layers 6 verifies" in g3


def test_notices_before_a_slow_or_memory_hungry_run_and_a_lone_rank():
    """Item 8: `--num-layers 32` (13.6 GB peak measured) and `--decode-steps 100` are announced from the config;
    item 7: `--world-size 2` outside torchrun says that one rank runs alone. Defaults stay quiet."""
    from conftest import CONFIGS
    from pipeline.core.contracts import AttentionArgs, SetupRequest
    from pipeline.runtime.model import AttentionStack
    from pipeline.core.model_spec import load_model_spec
    from pipeline.cli.run import run_notices, weight_bytes

    spec = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    req = SetupRequest(args=AttentionArgs(), model=spec, device="cpu")
    assert run_notices(_ns(), req, 2, False) == []
    (mem,) = run_notices(_ns(), req, 32, False)
    assert "12.5 GiB" in mem and "--num-layers 2" in mem        # 2.5 GiB bf16 + 10.0 GiB float64
    (steps,) = run_notices(_ns(decode_steps=100), req, 2, False)
    assert "--decode-steps 100" in steps
    (lone,) = run_notices(_ns(world_size=2, rank=1), req, 2, False)
    assert "torchrun --nproc-per-node 2" in lone and "rank 1 alone" in lone
    assert run_notices(_ns(world_size=2, rank=1), req, 2, True) == []
    # the estimate is the stack's own size (independent count: the built tensors), MLA included
    for cfg in ("llama-3.1-8b.json", "deepseek-v2-lite.json", "gpt-oss-20b.json"):
        s = load_model_spec(CONFIGS / cfg)
        import torch

        st = AttentionStack(s, dtype=torch.bfloat16, device="cpu", num_layers=1)
        no_sinks = st.param_bytes() - sum(L.sinks.numel() * L.sinks.element_size() for L in st.layers if L.sinks is not None)
        assert weight_bytes(s, 1, "bfloat16") == (no_sinks, no_sinks * 4)
