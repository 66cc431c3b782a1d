"""``attn-setup plan``: JSON shape, exit codes 0/2/3 (in-process), and no torch/triton/flashinfer import (a subprocess)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pipeline.platforms import profiles
from pipeline.core.contracts import AttentionArgs
from pipeline.core.errors import BackendUnavailable
from pipeline.core.model_spec import load_model_spec
from states import resolve

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "examples" / "configs"
ALL = "torch,triton,flashinfer-python"


def plan(*argv: str) -> tuple[int, dict]:
    from conftest import run_main

    proc = run_main("plan", *argv, "--json")
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_h200_plan_json_has_run_objects_and_rejected():
    """h200 + flashinfer missing: triton pair, rejected per half, plan and skips objects as run prints."""
    rc, out = plan("--device-profile", "h200", "--installed", "torch,triton")
    assert rc == 0 and out["ok"] is True
    text = out["resolved"].pop("evidence_text")  # versions assumed, not known: the measured table cannot apply
    assert out["resolved"] == {"prefill": "triton", "decode": "triton", "is_draft_override": False,
                               "rules": {"prefill": "auto", "decode": "auto"},
                               "dtype": {"value": "bfloat16", "source": "auto:checkpoint"}, "not_attention": [],
                               "evidence": {"prefill": "unmeasured", "decode": "unmeasured"}}
    assert text["decode"].startswith("decode: triton — unmeasured: ")
    assert [r["backend"] for r in out["rejected"]["prefill"]] == ["flashinfer", "fa3"]
    assert any("flashinfer-python" in x for x in out["rejected"]["decode"][0]["reasons"])
    assert out["plan"] == {"mode": "normal", "hybrid": False,
                           "instances": [{"role": "primary", "backend": "triton", "workspace": "ws-shared"}],
                           "workspaces": [{"id": "ws-shared", "owner": "primary", "bytes": 0,
                                           "shared_by": ["primary"]}]}
    assert out["skips"] == [{"what": "npu_lazy_mem", "reason": "device type is 'cuda', zbal lazy memory exists on npu only"}]
    assert out["device"]["compute_capability"] == [9, 0] and out["device"]["source"].startswith("profile:h200")


# Every bundled config planned on the H200 with every package assumed installed: the pair, the dtype and
# its rule, and the layers no attention backend serves — written from the capability records, the dtype
# rule (pipeline/dtypes.py) and the configs (examples/configs/README.md), not by running the tool.
H200_PINNED = {
    "llama-3.1-8b.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),
    "qwen2.5-7b.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),
    "mistral-7b-v0.1.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),
    "gemma-2-9b.json": ("flashinfer", ("bfloat16", "auto:float32_to_bfloat16"), []),  # float32 checkpoint
    "qwen3-8b.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),
    "deepseek-v2-lite.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),     # MLA: measured fastest on sm90
    "deepseek-v3.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),           # MLA 576/512, 128 heads
    "gpt-oss-20b.json": ("flashinfer", ("float16", "auto:missing_torch_dtype_as_float32_to_float16"), []),  # sglang
    "qwen3-next-80b-a3b-instruct.json": ("flashinfer", ("bfloat16", "auto:checkpoint"),
                                         [("linear_attention", [i for i in range(48) if (i + 1) % 4])]),
    "llama-4-scout-17b-16e-instruct.json": ("triton", ("bfloat16", "auto:checkpoint"), []),  # chunked layers
    "gemma-3-12b-it.json": ("flashinfer", ("bfloat16", "auto:checkpoint"), []),
}


def test_every_bundled_config_has_a_pinned_h200_plan():
    """The table covers exactly the shipped configs."""
    assert sorted(H200_PINNED) == sorted(p.name for p in CFG.glob("*.json"))


@pytest.mark.parametrize("config", sorted(H200_PINNED))
def test_bundled_config_plans_on_h200(config):
    """plan --device-profile h200, every package: the pinned pair, dtype rule and not-attention layers."""
    from pipeline.cli import main

    backend, dtype, others = H200_PINNED[config]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--device-profile", "h200", "--installed", ALL, "--model", str(CFG / config), "--json"])
    out = json.loads(buf.getvalue())
    assert rc == 0 and out["ok"], out
    res = out["resolved"]
    assert (res["prefill"], res["decode"]) == (backend, backend)
    assert (res["dtype"]["value"], res["dtype"]["source"]) == dtype
    assert [(g["kind"], g["layer_ids"]) for g in res["not_attention"]] == others


def test_plan_human_output_shows_dtype_rule_and_not_attention(capsys):
    """The tables name the dtype with its rule and the linear-attention layers with their ids."""
    from pipeline.cli import main

    assert main(["plan", "--device-profile", "h200", "--installed", ALL, "--model",
                 str(CFG / "qwen3-next-80b-a3b-instruct.json")]) == 0
    text = capsys.readouterr().out
    assert "dtype: bfloat16 (auto:checkpoint)" in text
    assert "linear_attention layers 0..2, 4..6, 8..10" in text


def test_qwen_flashinfer_workspace_is_512_mib_in_the_plan():
    """Qwen-family models get sglang's 512 MiB FlashInfer workspace in the planned bytes."""
    rc, out = plan("--device-profile", "h100", "--installed", ALL, "--model", str(CFG / "qwen2.5-7b.json"))
    assert rc == 0 and out["plan"]["workspaces"][0]["bytes"] == 512 * 2**20


def test_decode_only_flag_records_auto_prefill_and_hybrid_plan():
    """Only --decode-attention-backend: prefill from auto, a hybrid plan with both halves."""
    rc, out = plan("--device-profile", "h200", "--installed", ALL, "--decode-attention-backend", "triton")
    assert rc == 0 and out["resolved"]["rules"] == {"prefill": "auto", "decode": "phase_flag"}
    assert out["plan"]["hybrid"] and [i["backend"] for i in out["plan"]["instances"]] == ["flashinfer", "triton"]


def test_refused_configuration_exits_3_with_one_error_info():
    """fa3 forced on an A100: exit 3, ErrorInfo naming the flag, the arch and the working backends."""
    rc, out = plan("--device-profile", "a100", "--installed", ALL, "--attention-backend", "fa3")
    assert rc == 3 and out["ok"] is False
    err = out["error"]
    assert err["code"] == "capability_mismatch" and err["state"] == "resolve"
    assert {"--attention-backend", "device.arch"} <= {f["name"] for f in err["flags"]}
    assert sorted(err["allowed"]) == ["flashinfer", "torch_native", "triton"] and "sm90" in err["message"]


def test_draft_worker_with_mla_draft_model_exits_3_naming_the_draft_flag():
    """A draft model the inherited backend cannot serve: remedy names --speculative-draft-attention-backend."""
    rc, out = plan("--device-profile", "h200", "--installed", ALL, "--attention-backend", "fa3",
                   "--speculative-algorithm", "EAGLE", "--draft-worker", "--draft-model",
                   str(CFG / "deepseek-v2-lite.json"))
    assert rc == 3 and "--speculative-draft-attention-backend" in out["error"]["remedy"]


@pytest.mark.parametrize("argv", [
    ("--device-profile", "tpu-v9"),
    ("--device-profile", "cpu", "--installed", "torch,flash-attn"),
    ("--device-profile", "cpu", "--model", "/nonexistent/config.json"),
    ("--device-profile", "cpu", "--page-size", "not-a-number"),
])
def test_usage_errors_exit_2(argv):
    """Unknown profile, unknown package, unreadable file, bad flag value: exit 2 with an ErrorInfo."""
    rc, out = plan(*argv)
    assert rc == 2 and out["ok"] is False and out["error"]["remedy"]


def test_plan_imports_no_torch_triton_or_flashinfer():
    """In-process: running plan leaves torch, triton and flashinfer out of sys.modules."""
    code = ("import sys, io, contextlib; from pipeline.cli import main;"
            "buf = io.StringIO();"
            "rc = [main(['plan', '--device-profile', p, '--json']) for p in ('h200', 'cpu', 'mi300x')];"
            "bad = [m for m in ('torch', 'triton', 'flashinfer') if m in sys.modules];"
            "print(rc, bad); sys.exit(0 if rc == [0, 0, 0] and not bad else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_named_profile_plans():
    """Each named profile plans the bundled Llama on its own source-cited facts."""
    for name, facts in profiles.PROFILES.items():
        assert facts.source.startswith(f"profile:{name}")
        rc, out = plan("--device-profile", name, "--installed", ALL)
        assert rc == 0 and out["device"]["name"] == facts.name


def test_nvidia_smi_output_is_parsed_without_torch():
    """A recorded nvidia-smi line of an H200 becomes cuda sm90 facts with the profile's SM count."""
    facts = profiles.parse_nvidia_smi("0, NVIDIA H200, 9.0, 143771, 580.159.03\n")
    assert (facts.type, facts.arch, facts.total_memory_bytes, facts.sm_count) == ("cuda", "sm90", 143771 << 20, 132)
    assert facts.source == "auto:nvidia-smi"
    assert profiles.parse_nvidia_smi("") is None and profiles.parse_nvidia_smi("0, Old GPU, [N/A], 1024, 1\n") is None


def test_auto_without_any_gpu_tool_is_cpu(monkeypatch):
    """auto: no NVML, no nvidia-smi → the cpu facts, saying so in source."""
    monkeypatch.setattr(profiles, "from_nvml", lambda index=0: None)
    monkeypatch.setattr(profiles.shutil, "which", lambda exe: None)
    facts = profiles.get("auto")
    assert facts.type == "cpu" and facts.source.startswith("auto:cpu")


def test_run_refuses_when_metadata_and_import_disagree_on_the_outcome():
    """Metadata says flashinfer is installed, its import fails: the run refuses naming the package."""
    llama = load_model_spec(CFG / "llama-3.1-8b.json")
    meta = {"torch": True, "triton": True, "flashinfer-python": True}
    imp = {**meta, "flashinfer-python": False}
    with pytest.raises(BackendUnavailable) as ei:
        resolve.decide_for_run(AttentionArgs(), llama, profiles.PROFILES["h200"], is_draft_worker=False,
                               metadata=meta, imported=imp, import_errors={"flashinfer-python": "ImportError: libcuda"})
    info = ei.value.info
    assert info.code == "package_presence_mismatch" and [f.value for f in info.flags] == ["flashinfer-python"]
    assert "libcuda" in info.message and "flashinfer-python" in info.remedy


def test_run_ignores_a_disagreement_that_changes_nothing():
    """On a CPU device a broken flashinfer changes nothing: torch_native, no error."""
    llama = load_model_spec(CFG / "llama-3.1-8b.json")
    meta = {"torch": True, "triton": True, "flashinfer-python": True}
    res = resolve.decide_for_run(AttentionArgs(), llama, profiles.PROFILES["cpu"], is_draft_worker=False,
                                 metadata=meta, imported={**meta, "flashinfer-python": False})
    assert msgspec.to_builtins(res.pair) == {"prefill": "torch_native", "decode": "torch_native",
                                             "is_draft_override": False}


def test_installed_remedy_is_true_when_followed(capsys):
    """--installed replaces the assumed set: `--installed flashinfer` on h200 is refused with a remedy naming the
    full set, and following that remedy plans (exit 0) on FlashInfer (item 3)."""
    import json

    from pipeline.cli import main

    for given in ("flashinfer", "", "triton"):
        assert main(["plan", "--json", "--device-profile", "h200", "--installed", given]) == 3
        err = json.loads(capsys.readouterr().out)["error"]
        assert "replaces the assumed set" in err["remedy"]
        fix = err["remedy"].split("pass --installed ", 1)[1].split(" ", 1)[0]
        assert fix == "torch,triton,flashinfer"
        assert main(["plan", "--json", "--device-profile", "h200", "--installed", fix]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["ok"] and out["installed"] == {"torch": True, "triton": True, "flashinfer-python": True}


GOLDEN = ROOT / "tests" / "data" / "golden"


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.glob("*.jsonl")))
def test_plan_shows_the_graph_sizes_and_lazy_memory_a_recorded_run_took(name, monkeypatch):
    """``plan``'s ``cuda_graphs`` and ``npu_lazy_mem`` for each golden run's request and device facts equal what that
    run recorded: the decode batch sizes it captured (``runner_ready.graph_batch_sizes``, or the ``cuda_graph`` skip
    reason), and npu-lazy-mem's setting (bytes, source) and outcome (initialized, or the skip reason)."""
    from pipeline.cli.plan import plan_report
    from pipeline.core import events as ev
    from pipeline.core.contracts import SetupRequest
    from pipeline.core.errors import AttnSetupError
    from pipeline.observe.trace import read_trace

    for run in read_trace(GOLDEN / name).runs:
        started, facts = run.started, run.first(ev.DeviceInitialized)
        setting = next((s for s in run.all(ev.SettingResolved) if s.field == "zbal_local_mem_size"), None)
        if started is None or facts is None or setting is None:
            continue  # refused before npu-lazy-mem decided: nothing recorded to compare
        monkeypatch.delenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", raising=False)
        if setting.source == "env":
            monkeypatch.setenv(setting.env_var, str(setting.value))
        req = msgspec.convert(started.request, SetupRequest)
        try:
            out = plan_report(req, facts.facts, dict(started.packages))
        except AttnSetupError:
            continue  # a run refused at build-mode by a check this version adds
        lazy, z = run.first(ev.LazyMemInitialized), out["npu_lazy_mem"]
        skip = next((s for s in run.all(ev.StepSkipped) if s.what == "npu_lazy_mem"), None)
        assert (z["bytes"], z["source"], z["run"]) == (setting.value, setting.source, lazy is not None)
        assert z["reason"] == ("" if skip is None else skip.reason)
        ready = run.first(ev.RunnerReady)
        g = out["cuda_graphs"]
        graph_skip = next((s for s in run.all(ev.StepSkipped) + run.all(ev.FeatureDowngraded)
                           if s.what == "cuda_graph"), None)
        if ready is not None:
            assert g["batch_sizes"] == list(ready.graph_batch_sizes), (name, g)
            assert g["count"] == len(ready.graph_batch_sizes) and g["capture"] == bool(ready.graph_batch_sizes)
        if graph_skip is not None:
            assert not g["capture"] and g["reason"] == graph_skip.reason and g["batch_sizes"] == []


def test_plan_human_output_names_graph_sizes_and_lazy_memory(capsys, monkeypatch):
    """The human plan says which decode batch sizes are captured and whether zbal lazy memory is set up (and why
    not), with the size's source."""
    from pipeline.cli import main

    assert main(["plan", "--device-profile", "h200", "--installed", ALL, "--cuda-graph-bs", "1", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # lines wrap at the console width
    assert "cuda graphs: decode batch sizes 1, 4 (2 sizes, largest 4)" in text
    assert "npu lazy memory: not initialized: device type is 'cuda', zbal lazy memory exists on npu only" in text
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "1048576")
    assert main(["plan", "--device-profile", "ascend-910b", "--installed", "torch"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # lines wrap at the console width
    assert "npu lazy memory: 1.0 MiB of zbal lazy memory (from env SGLANG_ZBAL_LOCAL_MEM_SIZE)" in text
    assert "cuda graphs: not captured: CUDA graphs need a CUDA device; this run is on npu" in text
    assert main(["plan", "--device-profile", "ascend-910b", "--installed", "torch", "--draft-worker"]) == 0
    assert "npu lazy memory: not initialized: draft worker" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "--device-profile", "h200", "--installed", "torch,triton", "--attention-backend", "triton",
                 "--max-reqs", "200"]) == 0
    assert "decode batch sizes 1, 2, 4, 8, 16, 24, …, 200 (28 sizes, largest 200)" in " ".join(capsys.readouterr().out.split())


def test_plan_warns_about_lookalike_environment_variables(capsys, monkeypatch):
    """A set variable one edit away from one attn-setup reads gets the same stderr warning from plan as from run
    (plan said nothing)."""
    from pipeline.cli import main

    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZ", "5")
    assert main(["plan", "--device-profile", "cpu", "--json"]) == 0
    err = " ".join(capsys.readouterr().err.split())   # broken at spaces to stderr's width, as every human line
    assert ("warning: environment variable SGLANG_FLASHINFER_WORKSPACE_SIZ is not one attn-setup reads; did you mean "
            "SGLANG_FLASHINFER_WORKSPACE_SIZE?") in err


def test_plan_prints_its_verdict_last(capsys):
    """The human plan ends with ``ok``, after the CUDA-graph, NPU, graph-memory and JIT lines (new user: ``ok`` sat in
    the middle, with those lines after it)."""
    from pipeline.cli import main

    assert main(["plan", "--device-profile", "h200", "--installed", ALL, "--max-reqs", "16"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines[-1] == "ok" and lines.count("ok") == 1
    before = [i for i, line in enumerate(lines) if line.startswith(("cuda graphs:", "npu lazy memory:",
                                                                   "decode CUDA graphs:"))]
    assert len(before) == 3 and max(before) < len(lines) - 1


def test_a_refused_plan_leads_with_its_refusal(capsys, monkeypatch):
    """A refused plan's first line names the refusal: the error block alone (its first line is the headline), or,
    with look-alike variable warnings to show, a headline naming the exit code first, the warnings, then the error
    block, as a failed run prints it. ``--json`` keeps its object."""
    from pipeline.cli import main

    argv = ["plan", "--device-profile", "cpu", "--attention-backend", "flashinfer"]
    assert main(argv) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error [capability_mismatch] in state resolve:")
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZ", "5")
    assert main(argv) == 3
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("attn-setup plan refused (exit 3) in state resolve: capability_mismatch:")
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning: environment variable"))
    block = next(i for i, line in enumerate(lines) if line.startswith("error [capability_mismatch]"))
    assert 0 < warning < block and lines[-1].strip().startswith("remedy: set --attention-backend")
    assert main([*argv, "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "capability_mismatch" and err.startswith("warning: environment")
