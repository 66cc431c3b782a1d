"""GPU tests of the flashinfer/fa3 backends (H200): real kernels against the float64 reference.

Skipped without CUDA or FlashInfer. The full grid, CUDA-graph, workspace-bound and benchmark runs
live in benchmarks/flashinfer_gpu_check.py (one process, results in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from fi_reference import Scenario, dense_reference, make_kind, make_layer, rel_err  # noqa: E402
from pipeline.backends.flashinfer import backend as fib
from pipeline.backends.flashinfer import rules as sz
from pipeline.core.contracts import ForwardMode  # noqa: E402
from pipeline.core.errors import ConfigError  # noqa: E402
from pipeline.backends.capability import WorkspaceQuery


def _err(sc, be, kind, mode, reqs, prefix, new, sinks=None):
    sc.fill_prefix(reqs, prefix)
    pre = [sc.alloc.req_lens.get(r, 0) for r in reqs]
    fb = sc.batch(mode, reqs, new)
    T = sum(new)
    q = sc.randn(T, kind.num_heads, kind.head_dim_qk)
    k, v = sc.randn(T, kind.num_kv_heads, kind.head_dim_qk), sc.randn(T, kind.num_kv_heads, kind.head_dim_v)
    be.init_forward_metadata(fb)
    torch.empty(T * kind.num_heads * kind.head_dim_v * 2, dtype=torch.uint8, device="cuda").fill_(0xFF)  # poison
    out = be.forward(q, k, v, make_layer(kind, 0, sinks), fb).view(T, kind.num_heads, kind.head_dim_v)
    assert not torch.isnan(out).any()
    errs, off = [], 0
    for r, p, n in zip(reqs, pre, new):
        kr, vr = sc.request_kv(0, r, p + n)
        ref = dense_reference(q[off:off + n], kr, vr, prefix=p, scale=kind.scaling, window=kind.sliding_window,
                              softcap=kind.logit_softcap, sinks=sinks)
        errs.append(rel_err(out[off:off + n], ref))
        off += n
    return max(errs)


@pytest.mark.parametrize("name", ["flashinfer", "fa3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_and_extend_match_float64(name, page_size):
    """bf16 decode and extend (ragged and paged) are within 1e-2 of float64, never NaN."""
    kind = make_kind(32, 8, 128)
    sc = Scenario([kind], page_size=page_size, name=name, max_reqs=16, max_context_len=8192, ws_bytes=384 << 20)
    be = (fib.create_fa3 if name == "fa3" else fib.create)(sc.ctx)
    assert _err(sc, be, kind, ForwardMode.EXTEND, [0, 1, 2], [0, 0, 0], [5, 300, 77]) <= 1e-2
    assert _err(sc, be, kind, ForwardMode.EXTEND, [0, 3], [0, 900], [40, 129]) <= 1e-2
    assert _err(sc, be, kind, ForwardMode.DECODE, list(range(9)), [100 * i for i in range(9)], [1] * 9) <= 1e-2


@pytest.mark.parametrize("feat", [{"window": 64}, {"softcap": 20.0}, {"sinks": True}])
def test_features_match_float64(feat):
    """Sliding window, softcap and sinks on the flashinfer backend match float64."""
    kind = make_kind(32, 8, 128, **feat)
    sinks = torch.randn(32, device="cuda") if feat.get("sinks") else None
    sc = Scenario([kind], page_size=16, max_reqs=8, max_context_len=4096, ws_bytes=384 << 20)
    be = fib.create(sc.ctx)
    assert _err(sc, be, kind, ForwardMode.EXTEND, [0, 1], [0, 700], [200, 90], sinks) <= 1e-2
    assert _err(sc, be, kind, ForwardMode.DECODE, [0, 1, 2], [0, 0, 1500], [1, 1, 1], sinks) <= 1e-2


def test_workspace_half_refused_by_our_check():
    """At half the computed bytes the one workspace check (the registry entry's, run in build-mode, plan and
    preflight; the factory itself no longer checks twice) refuses, naming flashinfer_workspace_size; at the computed
    bytes it passes."""
    from pipeline.backends import registry

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    need = sz.workspace_need([sz.HeadShape(32, 8, 128)], num_sms=n_sm, max_batch_size=64, cuda_graph_max_bs=64)
    kinds = [make_kind(32, 8, 128)]
    entry = registry.get("flashinfer")
    entry.check_workspace(need.bytes, WorkspaceQuery(kinds=kinds, num_sms=n_sm, max_reqs=64, graph_max_bs=64))
    with pytest.raises(ConfigError) as ei:
        entry.check_workspace(need.bytes // 2, WorkspaceQuery(kinds=kinds, num_sms=n_sm, max_reqs=64, graph_max_bs=64))
    assert ei.value.info.flags[0].name == "flashinfer_workspace_size"
