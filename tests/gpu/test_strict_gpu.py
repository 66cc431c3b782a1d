"""Issue 13 §4 and §6 on a real GPU (H200): warnings, --strict and early refusals through `attn-setup run --device cuda`.

- graph sizes above --max-reqs and a too-small FlashInfer workspace are refused in preflight, before the model
  loads or any pool exists (they were refused at capture / in build-mode after allocation before);
- DeepSeek-V2-Lite (MLA: only torch_native) and fp8 KV run on the reference backend with a reference_fallback
  and a cuda_graph warning; --strict refuses them (exit 3) and the flags its remedy names make the strict run pass;
- a strict FlashInfer run has no warning and captures its decode graphs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pipeline.cli import main  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
SMALL = ["--num-layers", "1", "--decode-steps", "1", "--page-size", "16"]


def _run(tmp_path, capsys, *argv: str) -> tuple[int, dict, list[str]]:
    log = tmp_path / "run.jsonl"
    log.unlink(missing_ok=True)
    code = main(["run", "--device", "cuda", "--json", "--log-file", str(log), *argv])
    out = json.loads(capsys.readouterr().out)
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()] if log.exists() else []
    return code, out, events


def test_graph_sizes_above_max_reqs_refused_before_the_model_loads(tmp_path, capsys):
    """--cuda-graph-bs 1 2 113 --max-reqs 4 on cuda: exit 3 in build-mode, no model, pool or backend was made."""
    code, out, events = _run(tmp_path, capsys, *SMALL, "--cuda-graph-bs", "1", "2", "113", "--max-reqs", "4")
    assert code == 3 and out["error"]["code"] == "invalid_value" and out["runner_states"] == []
    assert not {"model_loaded", "memory_pool_sized", "backend_built", "cuda_graph_captured"} & set(events)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
def test_small_flashinfer_workspace_refused_before_the_model_loads(tmp_path, capsys):
    """--flashinfer-workspace-size 1048576: exit 3 workspace_too_small before anything is allocated."""
    code, out, events = _run(tmp_path, capsys, *SMALL, "--attention-backend", "flashinfer",
                             "--flashinfer-workspace-size", "1048576")
    assert code == 3 and out["error"]["code"] == "workspace_too_small" and out["runner_states"] == []
    assert not {"model_loaded", "memory_pool_sized", "backend_built"} & set(events)


# What still has no GPU backend on sm90: fp8 KV on MLA layers (flashinfer and triton claim MLA and fp8, not both
# together) and a float32 model (the GPU records take bf16/fp16 q only). DeepSeek MLA and fp8 KV alone now resolve
# flashinfer, so they no longer exercise the fallback.
@pytest.mark.parametrize("flags", [["--model", str(CONFIGS / "deepseek-v2-lite.json"), "--kv-cache-dtype", "fp8_e4m3"],
                                   ["--dtype", "float32"]], ids=["deepseek-mla-fp8", "float32"])
def test_reference_fallback_warns_strict_refuses_and_its_remedy_runs(tmp_path, capsys, flags):
    """Warned run passes with both warnings; --strict exits 3 (reference_fallback) before the model loads; the
    remedy's flags (--attention-backend torch_native --disable-cuda-graph) make the strict run pass, warning-free."""
    code, out, events = _run(tmp_path, capsys, *SMALL, *flags)
    assert code == 0, out["error"]
    assert [(w["code"], w["what"]) for w in out["warnings"]] == [("reference_fallback", "prefill+decode"),
                                                                 ("feature_downgraded", "cuda_graph")]
    assert "reference_fallback" in events
    code, out, events = _run(tmp_path, capsys, *SMALL, *flags, "--strict")
    err = out["error"]
    assert code == 3 and err["code"] == "reference_fallback" and out["runner_states"] == []
    assert err["remedy"].startswith("set --attention-backend torch_native and --disable-cuda-graph")
    code, out, _ = _run(tmp_path, capsys, *SMALL, *flags, "--strict", "--attention-backend", "torch_native",
                        "--disable-cuda-graph")
    assert code == 0 and out["warnings"] == [], out["error"]


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
def test_strict_flashinfer_run_has_no_warning_and_captures_graphs(tmp_path, capsys):
    """--strict --attention-backend flashinfer: exit 0, no warning, decode graphs captured and verified."""
    code, out, events = _run(tmp_path, capsys, *SMALL, "--strict", "--attention-backend", "flashinfer",
                             "--cuda-graph-bs", "1", "4")
    assert code == 0 and out["warnings"] == [], out["error"]
    assert events.count("cuda_graph_captured") == 2 and any(s["graph"] for s in out["model_steps"])
