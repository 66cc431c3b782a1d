"""Issue 14 §5 on a real GPU: pools and workspaces against the device's free memory, closed backends.

- ``CudaPlatform.memory_available`` is ``torch.cuda.mem_get_info``'s free bytes.
- ``run --mem-fraction 1.0`` is refused before allocation (``pool_exceeds_memory``, exit 3) — the
  CUDA context alone makes the whole device more than is free — and the fraction its remedy names
  then starts, verifies and exits 0 (a remedy must be true).
- pools from the library (``PoolFacts`` at the int32 limit) and a FlashInfer workspace above the free
  memory are refused before anything is allocated (``memory_allocated`` unchanged).
- every GPU backend (triton, flashinfer, fa3 where installed) raises ``BackendClosed`` after close.
"""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pipeline import build_attention_backends  # noqa: E402
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.errors import BackendClosed, ConfigError  # noqa: E402
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG, load_model_spec  # noqa: E402
from pipeline.platforms.cuda import CudaPlatform  # noqa: E402
from conftest import gpu_backends  # noqa: E402

BACKENDS = gpu_backends("sm{}{}".format(*torch.cuda.get_device_capability()), installed_only=True)


def run_main(*args: str):
    """``attn-setup ARGS`` in-process: (returncode, stdout)."""
    import contextlib
    import io
    import subprocess

    from pipeline.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), "")


def test_memory_available_is_mem_get_info():
    free, total = torch.cuda.mem_get_info(0)
    got = CudaPlatform().memory_available(0)
    assert 0 < got <= total and abs(got - free) <= 64 << 20


def test_mem_fraction_whole_device_refused_and_the_remedy_starts(tmp_path):
    """--mem-fraction 1.0: exit 3 before allocation; the remedy's fraction then runs to ok (exit 0)."""
    gc.collect()  # earlier tests' unreachable tensors, which a collection during the run would free
    before = torch.cuda.memory_allocated(0)
    proc = run_main("run", "--device", "cuda:0", "--json", "--mem-fraction", "1.0", "--num-layers", "1",
                    "--decode-steps", "1", "--log-file", str(tmp_path / "a.jsonl"))
    out = json.loads(proc.stdout)
    assert proc.returncode == 3 and out["error"]["code"] == "pool_exceeds_memory", out["error"]
    assert {f["name"] for f in out["error"]["flags"]} >= {"--mem-fraction", "limit_bytes"}
    assert torch.cuda.memory_allocated(0) == before
    frac = re.search(r"--mem-fraction ([0-9.]+)", out["error"]["remedy"]).group(1)
    proc = run_main("run", "--device", "cuda:0", "--json", "--mem-fraction", frac, "--num-layers", "1",
                    "--decode-steps", "1", "--log-file", str(tmp_path / "b.jsonl"))
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"], out["error"]
    torch.cuda.empty_cache()


def test_library_pools_beyond_the_device_are_refused_before_allocation():
    """Refused in build-mode (pool_exceeds_memory) with nothing allocated beyond device-init's cuBLAS init, which
    every start does first (as sglang does) and which keeps its per-process workspace (32 MiB on sm90) for good:
    it is made before ``before`` is read."""
    a = torch.ones(8, 8, device="cuda:0")
    (a @ a).sum().item()
    del a
    torch.cuda.synchronize()
    gc.collect()  # earlier tests' unreachable tensors, which a collection during the run would free
    before = torch.cuda.memory_allocated(0)
    req = SetupRequest(model=load_model_spec(DEFAULT_MODEL_CONFIG), device="cuda:0",
                       pool=PoolFacts(max_reqs=2 ** 31 - 1, max_context_len=4096, num_token_slots=16384))
    with pytest.raises(ConfigError) as e:
        build_attention_backends(req)
    assert e.value.info.code == "pool_exceeds_memory" and torch.cuda.memory_allocated(0) == before


@pytest.mark.skipif("flashinfer" not in BACKENDS, reason="needs flashinfer-python")
def test_workspace_beyond_free_memory_is_refused_before_allocation():
    gc.collect()  # earlier tests' unreachable tensors, which a collection during the run would free
    before = torch.cuda.memory_allocated(0)
    free, _ = torch.cuda.mem_get_info(0)
    req = SetupRequest(args=AttentionArgs(attention_backend="flashinfer", flashinfer_workspace_size=int(free * 1.5)),
                       model=load_model_spec(DEFAULT_MODEL_CONFIG), device="cuda:0",
                       pool=PoolFacts(max_reqs=8, max_context_len=1024, num_token_slots=4096))
    with pytest.raises(ConfigError) as e:
        build_attention_backends(req)
    assert e.value.info.code == "workspace_exceeds_memory" and torch.cuda.memory_allocated(0) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_backends_raise_backend_closed_after_close(backend):
    req = SetupRequest(args=AttentionArgs(attention_backend=backend, page_size=16),
                       model=load_model_spec(DEFAULT_MODEL_CONFIG), device="cuda:0",
                       pool=PoolFacts(max_reqs=8, max_context_len=1024, num_token_slots=4096, page_size=16))
    out = build_attention_backends(req)
    held = out.attn_backend
    out.close()
    for call in (lambda: held.init_forward_metadata(None), lambda: held.init_cuda_graph_state(8, 8),
                 lambda: held.forward(None, None, None, None, None)):
        with pytest.raises(BackendClosed) as e:
            call()
        assert e.value.info.code == "backend_closed" and e.value.exit_code == 1
