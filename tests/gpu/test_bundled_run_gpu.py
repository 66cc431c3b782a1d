"""``attn-setup run --device cuda`` for every bundled config, in process: every instance verifies.

Default backend choice for each config under examples/configs/, plus the issue's two failing
commands (Gemma-2 on flashinfer in bf16 with page 16; gpt-oss with page 16, auto → flashinfer). Each
run must exit 0 with every built instance (and wrapper) verified against float64 — on instances
built for the verification windows, which the detail states — and every model step passing.
``benchmarks/gpu_bundled_configs.py`` prints the same runs as a table.

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_bundled_run_gpu.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pipeline.cli import main  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
RUNS = [(p.name, []) for p in sorted(CONFIGS.glob("*.json"))] + [
    ("gemma-2-9b.json", ["--attention-backend", "flashinfer", "--dtype", "bfloat16", "--page-size", "16"]),
    ("gpt-oss-20b.json", ["--page-size", "16"]),
    # MLA by auto on a GPU backend with decode graphs; fp8 KV by auto on flashinfer
    ("deepseek-v3.json", ["--num-layers", "2"]),
    ("deepseek-v2-lite.json", ["--page-size", "64"]),
    ("llama-3.1-8b.json", ["--kv-cache-dtype", "fp8_e4m3", "--page-size", "16"]),
    ("qwen3-8b.json", ["--kv-cache-dtype", "fp8_e5m2"]),
]
# these resolve a GPU backend by auto and replay their decode steps from captured graphs
GPU_BY_AUTO = {"deepseek-v2-lite.json": "flashinfer", "deepseek-v3.json": "flashinfer"}
WINDOWS = {"mistral-7b-v0.1.json": 4096, "gemma-2-9b.json": 4096, "gpt-oss-20b.json": 128}


def run_json(config: str, flags: list[str], log: Path) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["run", "--device", "cuda", "--json", "--model", str(CONFIGS / config), "--log-file", str(log),
                     *flags])
    return code, json.loads(buf.getvalue())


@pytest.mark.parametrize("config,flags", RUNS, ids=[f"{c}{'-' + '-'.join(f) if f else ''}" for c, f in RUNS])
def test_run_verifies_every_instance(config, flags, tmp_path):
    """Exit 0; every instance and wrapper passes against float64; windows were shrunk and rebuilt for it."""
    code, out = run_json(config, flags, tmp_path / "run.jsonl")
    bad = [(v["role"], v["max_rel_err"], v["detail"]) for v in out["verified"] if not v["passed"]]
    assert code == 0 and out["ok"], (out["error"], bad)
    assert out["verified"] and not bad
    assert out["model_steps"] and all(s["passed"] for s in out["model_steps"]), out["model_steps"]
    if config in WINDOWS:
        assert all(f"sliding window {WINDOWS[config]}->7" in v["detail"] for v in out["verified"])
    if flags[:2] == ["--attention-backend", "flashinfer"]:
        assert out["resolved"]["prefill"] == out["resolved"]["decode"] == "flashinfer"
    fp8 = "--kv-cache-dtype" in flags
    if config in GPU_BY_AUTO or fp8:
        want = GPU_BY_AUTO.get(config, "flashinfer")
        assert out["resolved"]["prefill"] == out["resolved"]["decode"] == want, out["resolved"]
        assert any(s["graph"] for s in out["model_steps"] if s["mode"] == "decode"), out["model_steps"]
    if fp8:
        assert all(flags[flags.index("--kv-cache-dtype") + 1].replace("fp8_", "float8_") in v["detail"]
                   for v in out["verified"])
