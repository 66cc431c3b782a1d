"""startup_summary on a GPU: graph bytes per batch size and JIT variants accounted.

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_startup_gpu.py``. A flashinfer run with decode
graphs at bs 1, 2, 4, 8: every captured size has a ``capture-cuda-graphs`` phase and ``graph_bytes`` > 0 for the
first (largest) capture (later sizes reuse its pool and may take 0), the metrics file carries the same bytes per
``bs``, each FlashInfer variant appears as a ``jit:`` phase and a ``jit_variant_loaded`` record with its key fields,
and the top-level phases with ``unaccounted_s`` add up to the wall time.
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

from pipeline.core import events as ev  # noqa: E402
from pipeline.core import wire
from pipeline.cli import main  # noqa: E402


def test_flashinfer_graphs_accounted(tmp_path):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    log, prom = tmp_path / "a.jsonl", tmp_path / "m.prom"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["run", "--device", "cuda", "--attention-backend", "flashinfer", "--cuda-graph-bs", "1", "2", "4", "8",
                     "--json", "--log-file", str(log), "--metrics-file", str(prom)])
    assert code == 0, out.getvalue()[-3000:]
    recs = [wire.decode_line(x) for x in log.read_bytes().splitlines()]
    caps = {r.bs: r.graph_bytes for r in recs if isinstance(r, ev.CudaGraphCaptured)}
    assert sorted(caps) == [1, 2, 4, 8] and caps[8] > 0 and all(b >= 0 for b in caps.values())
    s = next(r for r in recs if isinstance(r, ev.StartupSummary))
    assert {p.name for p in s.phases if p.parent == "capture-cuda-graphs"} == {"bs=1", "bs=2", "bs=4", "bs=8"}
    jit = [r for r in recs if isinstance(r, ev.JitVariantLoaded)]
    assert jit and all(r.fields.get("arch") == "sm90" and r.status in ("cached", "compiling") for r in jit)
    assert {f"jit:{r.variant}" for r in jit} == {p.name for p in s.phases if p.name.startswith("jit:")}
    top = sum(p.seconds for p in s.phases if not p.parent)
    assert top + s.unaccounted_s == pytest.approx(s.wall_s, abs=1e-3)
    fam = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    assert {int(x.labels["bs"]): x.value for x in fam["attn_setup_cuda_graph_bytes"].samples} == caps
    print(json.dumps({"graph_bytes": caps, "jit": [(r.variant, r.status, r.seconds) for r in jit],
                      "coverage": s.coverage, "wall_s": s.wall_s}))
