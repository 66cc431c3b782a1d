"""The FlashInfer workspace default follows sglang's rule: the architecture name, not model_type.

sglang's FlashInferAttnBackend raises the workspace from 384 MiB to 512 MiB exactly when
``hf_config.architectures`` contains Qwen2ForCausalLM, Qwen3ForCausalLM, MiMoForCausalLM,
Qwen3VLForConditionalGeneration or Qwen3VLMoeForConditionalGeneration (the table below is written
from that source, not from our constant). Explicit field > env var > that default.
"""

from __future__ import annotations

import json

import pytest

from conftest import CONFIGS
from pipeline.backends.flashinfer import rules
from pipeline.core.contracts import AttentionArgs
from pipeline.core.model_spec import load_model_spec

MiB = 1 << 20
BASE = json.loads((CONFIGS / "qwen3-8b.json").read_text())

# (architectures, model_type, bytes sglang plans) — MoE and the Qwen2/2.5-VL classes are not in sglang's list.
CASES = [
    (["Qwen2ForCausalLM"], "qwen2", 512 * MiB),
    (["Qwen3ForCausalLM"], "qwen3", 512 * MiB),
    (["MiMoForCausalLM"], "mimo", 512 * MiB),
    (["Qwen3VLForConditionalGeneration"], "qwen3_vl", 512 * MiB),
    (["Qwen3VLMoeForConditionalGeneration"], "qwen3_vl_moe", 512 * MiB),
    (["Qwen3MoeForCausalLM"], "qwen3_moe", 384 * MiB),
    (["Qwen2MoeForCausalLM"], "qwen2_moe", 384 * MiB),
    (["Qwen2VLForConditionalGeneration"], "qwen2_vl", 384 * MiB),
    (["Qwen2_5_VLForConditionalGeneration"], "qwen2_5_vl", 384 * MiB),
    (["LlamaForCausalLM"], "llama", 384 * MiB),
    ([], "qwen2", 384 * MiB),  # no architectures: sglang's membership test is false
    (["LlamaForCausalLM", "MiMoForCausalLM"], "llama", 512 * MiB),  # any listed name counts
]


@pytest.mark.parametrize("archs,model_type,want", CASES, ids=lambda v: str(v))
def test_default_keys_on_the_architecture_name(archs, model_type, want, monkeypatch):
    """The default is 512 MiB exactly for sglang's architecture names, whatever the model_type says."""
    monkeypatch.delenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", raising=False)
    spec = load_model_spec({**BASE, "architectures": archs, "model_type": model_type})
    assert rules.flashinfer_workspace_size(AttentionArgs(), spec) == (want, "default")


def test_explicit_field_and_env_still_win(monkeypatch):
    """A MiMo model with the env var set keeps the user's value (sglang would overwrite it; we never replace it)."""
    spec = load_model_spec({**BASE, "architectures": ["MiMoForCausalLM"], "model_type": "mimo"})
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(100 * MiB))
    assert rules.flashinfer_workspace_size(AttentionArgs(), spec) == (100 * MiB, "env")
    assert rules.flashinfer_workspace_size(AttentionArgs(flashinfer_workspace_size=7 * MiB), spec) == (7 * MiB,
                                                                                                           "field")


def test_plan_shows_the_architecture_rule(tmp_path, capsys, monkeypatch):
    """plan on h100: a Qwen3-MoE config plans 384 MiB, the same config named MiMo 512 MiB."""
    from pipeline.cli import main

    monkeypatch.delenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", raising=False)
    got = {}
    for archs, mt in ((["Qwen3MoeForCausalLM"], "qwen3_moe"), (["MiMoForCausalLM"], "mimo")):
        cfg = tmp_path / f"{mt}.json"
        cfg.write_text(json.dumps({**BASE, "architectures": archs, "model_type": mt}))
        assert main(["plan", "--device-profile", "h100", "--installed", "torch,triton,flashinfer-python",
                     "--model", str(cfg), "--json"]) == 0
        got[mt] = json.loads(capsys.readouterr().out)["plan"]["workspaces"][0]["bytes"]
    assert got == {"qwen3_moe": 384 * MiB, "mimo": 512 * MiB}
