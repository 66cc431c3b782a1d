"""Every bundled config's attention through flashinfer, fa3 and triton on the GPU vs the model's own eager attention.

:func:`pipeline.runtime.model_oracle.check_model` with the prompt one past the largest window or chunk (at most 4200
tokens), q / k / v and the KV pool in bfloat16, the transformers model in float32. ``benchmarks/model_oracle.py``
prints the same runs as a table.

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_model_oracle_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pipeline.runtime.model_oracle import check_model  # noqa: E402

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.json"))


@pytest.mark.parametrize("backend", ["flashinfer", "fa3", "triton"])
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_bundled_family_matches_the_model_code(path, backend):
    results = check_model(path, backend, device="cuda", backend_dtype=torch.bfloat16, max_seq=4200)
    assert results and all(r.passed for r in results), results
