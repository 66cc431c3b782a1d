"""A FlashInfer workspace size from SGLANG_FLASHINFER_WORKSPACE_SIZE goes through the one workspace check the flag
goes through: a value below what the resolved backend needs is refused naming the variable, its value and the
minimum, and the remedy (set the variable to that minimum) then plans."""

from __future__ import annotations

import json

import pytest

from pipeline.backends.flashinfer import rules
from pipeline.cli import main
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.profiles import get

H200 = ["plan", "--json", "--device-profile", "h200", "--installed", "torch,triton,flashinfer-python"]
CASES = [([], "flashinfer"), (["--model", "examples/configs/deepseek-v2-lite.json", "--attention-backend",
                               "flashinfer"], "flashinfer"),
         (["--model", "examples/configs/qwen3-8b.json", "--max-reqs", "160", "--cuda-graph-max-bs", "160"], "flashinfer")]


def _plan(capsys, argv):
    code = main([*H200, *argv])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv,backend", CASES)
def test_env_value_below_the_minimum_is_refused_naming_the_variable(argv, backend, capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", "1000")
    code, out = _plan(capsys, argv)
    err = out["error"]
    assert code == 3 and err["code"] == "workspace_too_small" and err["state"] == "build-mode"
    flags = {f["name"]: f["value"] for f in err["flags"]}
    assert flags["SGLANG_FLASHINFER_WORKSPACE_SIZE"] == 1000 and "--flashinfer-workspace-size" in flags
    need = flags["needed_bytes"]
    assert err["allowed"] == [f">= {need}"] and "SGLANG_FLASHINFER_WORKSPACE_SIZE=1000" in err["message"]
    # the minimum is the backend's own bound, computed independently here from its sizing rule
    model = load_model_spec(argv[argv.index("--model") + 1]) if "--model" in argv else \
        load_model_spec("examples/configs/llama-3.1-8b.json")
    shapes = rules.shapes_of(model.layer_kinds())
    reqs = int(argv[argv.index("--max-reqs") + 1]) if "--max-reqs" in argv else 8  # run's default
    assert need == rules.workspace_need(shapes, num_sms=get("h200").sm_count, max_batch_size=reqs,
                                         cuda_graph_max_bs=reqs).bytes
    assert err["remedy"] == f"set SGLANG_FLASHINFER_WORKSPACE_SIZE to at least {need}"
    # the remedy is true: that value plans, one byte less does not
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(need))
    assert _plan(capsys, argv)[0] == 0
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(need - 1))
    assert _plan(capsys, argv)[0] == 3


def test_the_flag_wins_over_the_variable_and_is_named_as_the_flag(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(1 << 30))
    code, out = _plan(capsys, ["--flashinfer-workspace-size", "1000"])
    names = [f["name"] for f in out["error"]["flags"]]
    assert code == 3 and names[0] == "--flashinfer-workspace-size" and "SGLANG_FLASHINFER_WORKSPACE_SIZE" not in names
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", "1000")  # the flag's valid value wins over a bad env one
    assert _plan(capsys, ["--flashinfer-workspace-size", str(1 << 30)])[0] == 0


def test_a_backend_without_a_workspace_does_not_read_the_variable(capsys, monkeypatch):
    """triton keeps no FlashInfer workspace: the variable is not its setting, so 1000 is not refused for it."""
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", "1000")
    code, out = _plan(capsys, ["--attention-backend", "triton"])
    assert code == 0 and out["plan"]["workspaces"][0]["bytes"] == 0


@pytest.mark.parametrize("argv", [["--flashinfer-workspace-size", "1000"],
                                  ["--flashinfer-workspace-size", "1000", "--max-reqs", "8192",
                                   "--cuda-graph-max-bs", "8192"]])
def test_a_flag_sized_workspace_remedy_names_only_the_flag(argv, capsys, monkeypatch):
    """The remedy said "set --flashinfer-workspace-size (or SGLANG_FLASHINFER_WORKSPACE_SIZE) to at least N" for a size
    the flag set, yet the flag wins over the variable: setting the variable to N planned the same refusal.
    Every alternative the remedy names now plans."""
    monkeypatch.delenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", raising=False)
    code, out = _plan(capsys, argv)
    remedy, need = out["error"]["remedy"], {f["name"]: f["value"] for f in out["error"]["flags"]}["needed_bytes"]
    assert code == 3 and "SGLANG_FLASHINFER_WORKSPACE_SIZE" not in remedy
    assert remedy.startswith(f"set --flashinfer-workspace-size to at least {need}")
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(need))  # what the old remedy offered: still refused
    assert _plan(capsys, argv)[0] == 3
    fixed = list(argv)
    fixed[fixed.index("--flashinfer-workspace-size") + 1] = str(need)
    assert _plan(capsys, fixed)[0] == 0


def test_a_default_sized_workspace_remedy_still_names_both(capsys, monkeypatch):
    monkeypatch.delenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", raising=False)
    # 8192, not 100000: the graphs of a 100000 top (~9.7 TB estimated) are refused once the workspace fits
    argv = ["--max-reqs", "8192", "--cuda-graph-max-bs", "8192"]
    code, out = _plan(capsys, argv)
    need = {f["name"]: f["value"] for f in out["error"]["flags"]}["needed_bytes"]
    assert code == 3 and f"(or SGLANG_FLASHINFER_WORKSPACE_SIZE) to at least {need}" in out["error"]["remedy"]
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(need))
    assert _plan(capsys, argv)[0] == 0
