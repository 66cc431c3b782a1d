"""Issue 14 on a real GPU: ``weights_exceed_memory`` before load-model allocates.

DeepSeek-V3 with all 61 attention layers needs ~35.7 GiB of bf16 weights on the device and ~143 GiB for their
float64 verification copy on the host: the run is refused (exit 3) before any device memory is allocated, naming
``num_layers`` and the most layers that fit; that count, followed, starts and verifies (a remedy must be true).
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import re

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from conftest import CONFIGS  # noqa: E402
from pipeline.cli import main  # noqa: E402


def _run(*args: str) -> tuple[int, dict]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        code = main(["run", "--device", "cuda", "--json", *args])
    return code, json.loads(buf.getvalue())


def test_deepseek_v3_all_layers_refused_before_allocation_and_remedy_runs(tmp_path):
    gc.collect()  # earlier tests' unreachable tensors, which run's own collection would free mid-measurement
    before = torch.cuda.memory_allocated(0)
    model = str(CONFIGS / "deepseek-v3.json")
    code, out = _run("--model", model, "--num-layers", "61", "--log-file", str(tmp_path / "a.jsonl"))
    assert code == 3 and out["error"]["code"] == "weights_exceed_memory", out["error"]
    assert torch.cuda.memory_allocated(0) == before
    m = re.search(r"--num-layers (\d+) or fewer", out["error"]["remedy"])
    assert m, out["error"]["remedy"]
    n = min(int(m.group(1)), 2)  # the remedy's count (2 at most: enough to prove it starts, and quick)
    code, out = _run("--model", model, "--num-layers", str(n), "--log-file", str(tmp_path / "b.jsonl"))
    assert code == 0 and out["ok"] is True, out["error"]
