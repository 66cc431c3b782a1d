"""Issue 14 items 12/13 on a GPU: what ``plan`` says a run captures is what it captures, graph-size refusals hold on
a CUDA device too, and ``device_unavailable`` lists this machine's GPUs.

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_messages_gpu.py``.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pipeline.cli import main  # noqa: E402
from pipeline.core import events as ev  # noqa: E402
from pipeline.core import wire


def _main(*argv: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [[], ["--cuda-graph-bs", "1", "4"], ["--cuda-graph-max-bs", "4"]])
def test_plan_graph_sizes_are_what_the_run_captures(tmp_path, flags):
    """``plan --device-profile auto --json``'s ``cuda_graphs.batch_sizes`` equals the sizes the run on this GPU
    captured (``cuda_graph_captured`` records and ``runner_ready.graph_batch_sizes``)."""
    common = ["--attention-backend", "flashinfer", "--page-size", "16", *flags]
    code, plan = _main("plan", "--device-profile", "auto", "--json", *common)
    assert code == 0, plan
    log = tmp_path / "r.jsonl"
    code, run = _main("run", "--device", "cuda", "--json", "--num-layers", "1", "--decode-steps", "1",
                      "--log-file", str(log), *common)
    assert code == 0, run["error"]
    recs = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    captured = sorted(r.bs for r in recs if isinstance(r, ev.CudaGraphCaptured))
    ready = next(r for r in recs if isinstance(r, ev.RunnerReady))
    assert plan["cuda_graphs"]["capture"] is True
    assert plan["cuda_graphs"]["batch_sizes"] == captured == list(ready.graph_batch_sizes)


@pytest.mark.parametrize("flags,code,field", [
    (["--cuda-graph-max-bs", "100", "--max-reqs", "8"], "invalid_value", "--cuda-graph-max-bs"),
    (["--cuda-graph-max-bs", "4", "--cuda-graph-bs", "8"], "conflicting_options", "--cuda-graph-max-bs"),
])
def test_graph_size_refusals_hold_on_cuda(tmp_path, flags, code, field):
    """Refused before anything is allocated on the GPU too (exit 3, no backend built)."""
    log = tmp_path / "r.jsonl"
    got, out = _main("run", "--device", "cuda", "--json", "--log-file", str(log), *flags)
    assert got == 3 and out["error"]["code"] == code and out["error"]["flags"][0]["name"] == field
    assert b'"backend_built"' not in log.read_bytes()


def test_device_unavailable_lists_this_machines_gpus():
    """``--device npu`` on a CUDA host: ``allowed`` is cpu and every cuda:N torch sees; the remedy names cuda:0."""
    got, out = _main("run", "--device", "npu", "--json")
    assert got == 3 and out["error"]["code"] == "device_unavailable"
    assert out["error"]["allowed"] == ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert out["error"]["remedy"].startswith("pass --device cuda:0")
