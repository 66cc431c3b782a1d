"""The FlashInfer API our backends call, checked against the installed FlashInfer (the supported 0.7.2) on the GPU.

Three short probes to run first on a new FlashInfer (``pytest -m gpu tests/gpu/test_flashinfer_api.py``):
the installed version is the one resolve accepts; our JIT module names (``pipeline.backends.flashinfer.jit``, which
``plan`` reads torch-free) are FlashInfer's own ``JitSpec`` names for every kind of variant; and building and
running every wrapper kind we use — paged/ragged prefill, CUDA-core and tensor-core decode, the attention-sink
module, MLA (canonical ``plan(metadata=)`` / ``run(query=, kv_cache=)``), fp8 KV, CUDA-graph capture and replay —
raises no warning from FlashInfer (a deprecated call would) and imports none of its optional heavy packages
(cuda-tile, nvidia-cutlass-dsl, nvidia-cudnn-frontend, nccl4py), which therefore need not be installed; and the
workspace bound (pipeline.backends.flashinfer.rules, FlashInfer 0.7.2's formulas) is all FlashInfer asks for.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from fi_reference import Scenario, make_kind, make_layer, make_mla_kind  # noqa: E402
from pipeline.backends.flashinfer import backend as fib  # noqa: E402
from pipeline.backends.flashinfer.jit import Variant, module_name, spec_for  # noqa: E402
from pipeline.backends.packages import is_supported, requirement  # noqa: E402
from pipeline.core.contracts import ForwardMode  # noqa: E402

HEAVY = ("cutlass", "cudnn", "nccl4py", "cuda.tile", "cuda_tile")


def test_the_installed_flashinfer_is_the_supported_one():
    """Metadata and the imported module agree, and both name a version resolve accepts (0.7.2)."""
    import flashinfer

    dist = importlib.metadata.version("flashinfer-python")
    assert flashinfer.__version__ == dist
    assert is_supported("flashinfer-python", dist), (dist, requirement("flashinfer-python"))


def _variants():
    for kind, backend, (q, kv), swa, cap in itertools.product(
            ("decode", "prefill", "sink", "mla"), ("cuda_core", "fa2", "fa3"),
            (("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float8_e4m3fn"),
             ("float16", "float8_e5m2")), (False, True), (False, True)):
        if (kind == "decode") != (backend == "cuda_core") or (kind in ("sink", "mla") and cap) \
                or (kind == "mla" and (swa or kv == "float8_e5m2")):
            continue
        dims = (576, 512) if kind == "mla" else (128, 128)
        yield Variant(kind=kind, backend=backend, q_dtype=q, kv_dtype=kv, head_dim_qk=dims[0], head_dim_vo=dims[1],
                      sliding_window=swa, logit_softcap=cap, arch="sm90")


def test_module_names_are_flashinfers_own():
    """module_name (torch-free, what ``plan`` and ``--require-warm-cache`` look for) equals the name of
    the JitSpec FlashInfer loads for each variant (writes generated sources, compiles nothing)."""
    got = {v.name: (module_name(v), spec_for(v).name) for v in _variants()}
    assert len(got) >= 40
    assert {k: ours for k, (ours, theirs) in got.items() if ours != theirs} == {}


def _extend_decode_graph(sc, be, kind, sinks=None):
    """Ragged extend, paged extend (a cached prefix), eager decode at 2 and 9 requests (CUDA-core and tensor-core
    wrappers for a group-4 kind), then CUDA-graph capture and one replay at 4 requests; returns the outputs."""
    layer, outs = make_layer(kind, 0, sinks), []
    for mode, reqs, prefix, new in ((ForwardMode.EXTEND, [0, 1], [0, 0], [7, 33]),
                                    (ForwardMode.EXTEND, [2, 3], [0, 90], [5, 17]),
                                    (ForwardMode.DECODE, [0, 1], [0, 0], [1, 1]),
                                    (ForwardMode.DECODE, list(range(9)), [0, 0, 0, 0, 40, 50, 60, 70, 80], [1] * 9)):
        sc.fill_prefix(reqs, prefix)
        fb = sc.batch(mode, reqs, new)
        t = sum(new)
        q = sc.randn(t, kind.num_heads, kind.head_dim_qk)
        k, v = sc.randn(t, kind.num_kv_heads, kind.head_dim_qk), sc.randn(t, kind.num_kv_heads, kind.head_dim_v)
        be.init_forward_metadata(fb)
        outs.append(be.forward(q, k, v, layer, fb))
    fb = sc.batch(ForwardMode.DECODE, [0, 1, 2, 3], [1] * 4)
    be.init_cuda_graph_state(4, 4)
    be.init_forward_metadata_capture_cuda_graph(4, 4, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE,
                                                None)
    q = sc.randn(4, kind.num_heads, kind.head_dim_qk)
    be.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
    graph, out = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        out["o"] = be.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
    be.init_forward_metadata_replay_cuda_graph(4, fb.req_pool_indices, fb.seq_lens, 0, None, ForwardMode.DECODE, None,
                                               fb.seq_lens.cpu())
    graph.replay()
    torch.cuda.synchronize()
    return outs + [out["o"]]


CASES = {
    "gqa": (lambda: [make_kind(32, 8, 128)], {}, "flashinfer"),
    "gqa-fa3": (lambda: [make_kind(32, 8, 128)], {}, "fa3"),
    "window-softcap": (lambda: [make_kind(16, 8, 128, window=64, softcap=30.0)], {}, "flashinfer"),
    "sinks": (lambda: [make_kind(64, 8, 64, sinks=True)], {}, "flashinfer"),
    "fp8": (lambda: [make_kind(32, 8, 128)], {"kv_dtype": torch.float8_e4m3fn}, "flashinfer"),
    "mla": (lambda: [make_mla_kind(16)], {}, "flashinfer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_our_calls_warn_nothing_and_need_no_heavy_package(case):
    """Every FlashInfer call of one backend's life (build, plans, runs, graph capture and replay) emits no warning
    from FlashInfer — its deprecated forms all warn — gives finite outputs, and imports none of the packages 0.7.2
    lists but our paths do not use."""
    kinds, kw, name = CASES[case]
    kinds = kinds()
    sc = Scenario(kinds, page_size=16, max_reqs=16, max_context_len=1024, ws_bytes=256 << 20, name=name, **kw)
    sinks = torch.randn(kinds[0].num_heads, device="cuda") if kinds[0].has_sinks else None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        be = (fib.create_fa3 if name == "fa3" else fib.create)(sc.ctx)
        outs = _extend_decode_graph(sc, be, kinds[0], sinks)
    ours = [f"{w.category.__name__} {w.filename}:{w.lineno}: {w.message}" for w in seen
            if "flashinfer" in w.filename or "flashinfer" in str(w.message).lower()
            or w.filename.startswith(os.path.dirname(fib.__file__))]
    assert ours == []
    assert all(torch.isfinite(o.float()).all() for o in outs)
    assert [m for m in sys.modules if m.startswith(HEAVY)] == []
    be.close()


@pytest.mark.parametrize("h,hkv", [(32, 8), (32, 1)])
def test_the_computed_workspace_is_all_flashinfer_needs(h, hkv):
    """FlashInfer 0.7.2 sizes FA2's split-KV partial outputs per query row (the group size times less than 0.6.13):
    a workspace of exactly ``workspace_need`` bytes plans and captures the largest tensor-core decode graph (256
    requests of 4000 tokens, group 4) and the worst eager split (MQA, group 32, one long request), and replays."""
    from pipeline.backends.flashinfer import rules as sz

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    kind = make_kind(h, hkv, 128)
    need = sz.workspace_need([sz.HeadShape(h, hkv, 128)], num_sms=n_sm, max_batch_size=256, cuda_graph_max_bs=256)
    sc = Scenario([kind], page_size=16, max_reqs=257, max_context_len=8192, num_slots=1 << 21, ws_bytes=need.bytes,
                  sm_count=n_sm, extra={"cuda_graph_max_bs": 256})
    be = fib.create(sc.ctx)
    layer, reqs = make_layer(kind, 0), list(range(1, 257))
    sc.fill_prefix([0], [8000])
    fb = sc.batch(ForwardMode.DECODE, [0], [1])  # one long request: the eager plan splits its KV the most
    be.init_forward_metadata(fb)
    assert torch.isfinite(be.forward(sc.randn(1, h, 128), sc.randn(1, hkv, 128), sc.randn(1, hkv, 128), layer,
                                     fb).float()).all()
    sc.fill_prefix(reqs, [4000] * 256)
    fb = sc.batch(ForwardMode.DECODE, reqs, [1] * 256)
    be.init_cuda_graph_state(256, 256)
    be.init_forward_metadata_capture_cuda_graph(256, 256, fb.req_pool_indices, fb.seq_lens, None, ForwardMode.DECODE,
                                                None)
    q = sc.randn(256, h, 128)
    be.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
    graph, out = torch.cuda.CUDAGraph(), {}
    with torch.cuda.graph(graph):
        out["o"] = be.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out["o"].float()).all()
    be.close()
