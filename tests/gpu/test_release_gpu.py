"""On a CUDA GPU: a run failed at any fault point, or closed after success, returns device memory to the baseline.

Baseline = ``torch.cuda.memory_allocated()`` after one warm run (cuBLAS handles and FlashInfer / Triton JIT
modules persist by design). For flashinfer (normal and TBO) and triton, every fault point a successful run
visits (``pipeline.core.faults.points_of_run``) is injected in turn: the run must fail with ``InjectedFault``,
nothing it built may stay alive (weak references die), allocated bytes must return exactly to the
baseline, and a new run must then succeed.
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from pipeline.setup.build import build_attention_backends  # noqa: E402
from pipeline.cli.flags import default_model_path  # noqa: E402
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest  # noqa: E402
from pipeline.core.faults import Faults, InjectedFault, points_of_run  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402

pytestmark = pytest.mark.gpu


def _req(backend: str, tbo: bool) -> SetupRequest:
    args = AttentionArgs(attention_backend=backend, page_size=16, enable_two_batch_overlap=tbo, cuda_graph_bs=[1, 4])
    return SetupRequest(args=args, model=load_model_spec(default_model_path()), device="cuda:0",
                        pool=PoolFacts(max_reqs=8, max_context_len=1024, num_token_slots=8192, page_size=16))


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("backend,tbo", [("flashinfer", False), ("flashinfer", True), ("triton", False)])
def test_every_fault_point_returns_memory_to_baseline(backend, tbo):
    """Fault at each point → InjectedFault, nothing alive, memory_allocated back to the warm baseline."""
    req = _req(backend, tbo)
    build_attention_backends(req).close()  # warm run
    base = _allocated()
    points = points_of_run(lambda f: build_attention_backends(req, faults=f).close())
    assert any(p.startswith("build:instance:") for p in points)
    assert _allocated() == base
    for point in points:
        faults = Faults(at=[point])
        with pytest.raises(InjectedFault):
            build_attention_backends(req, faults=faults)
        assert faults.alive() == [], point
        assert _allocated() == base, point
    with build_attention_backends(req) as out:
        assert out.prefill_attention_backend_str == backend and _allocated() > base
    assert _allocated() == base
