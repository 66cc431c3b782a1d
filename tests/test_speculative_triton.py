"""Our Triton kernels on EAGLE trees and draft branches, on CPU under ``TRITON_INTERPRET=1``, against the float64
reference that applies the tree mask; target-verify and draft-decode CUDA graphs emulated (tests/graph_emulation.py).

Small shapes and 16-wide tiles keep the interpreter fast. Interpreter mode is fixed when triton is first imported:
as in tests/test_triton_interpret.py, this module sets ``TRITON_INTERPRET=1`` when it can, and otherwise re-runs
itself in a fresh process (one test reports it); on a CUDA machine it is skipped (tests/gpu/test_speculative_gpu.py
runs the compiled kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
DIRECT = not HAS_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and (
    "triton" not in sys.modules or type(sys.modules["triton"].language.sum).__name__ == "InterpretedFunction")

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="CUDA present: tests/gpu/test_speculative_gpu.py runs the kernels")

from graph_emulation import emulate_graphs, replays_match_eager  # noqa: E402
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool  # noqa: E402
from pipeline.core.contracts import ForwardMode, LayerKind, ModelSpec, SpeculativeParams  # noqa: E402
from pipeline.core.errors import CapabilityMismatch  # noqa: E402
from pipeline.runtime.verify import verify_backend  # noqa: E402


@pytest.mark.skipif(DIRECT, reason="triton is in interpreter mode in this process: the tests run directly")
def test_interpreter_suite_in_subprocess():
    """Triton was imported before TRITON_INTERPRET could be set: run this module in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def _direct(request):
    if not DIRECT and request.node.name != "test_interpreter_suite_in_subprocess":
        pytest.skip("ran in a subprocess with TRITON_INTERPRET=1 (see test_interpreter_suite_in_subprocess)")


def _backend(kinds, r2t=None):
    from pipeline.backends.triton import launch
    from pipeline.backends.triton.backend import TritonAttnBackend

    dims = [(k.num_heads, k.num_kv_heads, k.head_dim_qk, k.head_dim_v) for k in kinds]
    return TritonAttnBackend(torch_device="cpu", layer_dims=dims, num_sms=4, req_to_token_pool=r2t,
                             decode_config=launch.DecodeConfig(block_n=16, block_n_single=32, split_min=32,
                                                               num_warps=4, num_stages=1),
                             extend_config=launch.ExtendConfig(block_m=16, block_n=16, num_warps=4, num_stages=1))


def spec_of(steps: int, topk: int, draft: int) -> SpeculativeParams:
    return SpeculativeParams(algorithm="EAGLE", num_steps=steps, topk=topk, num_draft_tokens=draft, source="flags")


def _kind(**kw) -> LayerKind:
    base = dict(kind="full", layer_ids=[0], num_heads=4, num_kv_heads=2, head_dim_qk=32, head_dim_v=32,
                scaling=32 ** -0.5)
    return LayerKind(**{**base, **kw})


KINDS = {"gqa": _kind(), "window": _kind(kind="sliding", num_kv_heads=1, sliding_window=5),
         "softcap-sinks": _kind(num_kv_heads=4, logit_softcap=4.0, has_sinks=True),
         "chunk": _kind(kind="chunked", attention_chunk_size=6)}


def _verify(kind, page_size, spec, draft, seed=0):
    r2t = ReqToTokenPool(8, 160, "cpu")
    kv = KVPool(128 * page_size, page_size, [(kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v)],
                torch.bfloat16, "cpu")
    return verify_backend(_backend([kind]), role="primary", name="triton", model=None, layer_kinds=[kind],
                          req_to_token_pool=r2t, kv_pool=kv, torch_device="cpu", dtype="bfloat16", spec=spec,
                          draft=draft, decode_steps=1, seed=seed)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_mask_in_the_extend_kernel(kind, page_size):
    """Random trees (top-k 2 or 4, 2-3 deep, one request a single token) through the extend kernel's tree mask, with
    windows and chunks counted on positions prefix + depth, against float64."""
    spec = (spec_of(2, 2, 5), spec_of(3, 4, 8))[(sorted(KINDS).index(kind) + page_size) % 2]  # both over the cases
    r = _verify(KINDS[kind], page_size, spec, draft=False)
    assert r.passed and r.max_rel_err < 1e-2, r.detail


@pytest.mark.parametrize("kind", ["gqa", "window"])
def test_draft_decode_over_the_token_table(kind):
    r = _verify(KINDS[kind], 4, spec_of(3, 3, 7), draft=True)
    assert r.passed and r.max_rel_err < 1e-2, r.detail


def test_the_kernel_check_fails_without_the_tree(monkeypatch):
    """The check can fail: the extend kernel run causally (the tree mask left out) is far from the reference."""
    import pipeline.backends.triton.backend as tb

    monkeypatch.setattr(tb, "_tree_args", lambda tree: {})
    r = _verify(KINDS["gqa"], 1, spec_of(3, 4, 8), draft=False)
    assert not r.passed and r.max_rel_err > 0.1


def test_mla_trees_are_refused_by_the_kernel():
    """The MLA extend kernel has no tree mask: a tree on an MLA layer is refused naming it (resolve refuses it first,
    from the record's tree_features); a chain runs."""
    mla = LayerKind(kind="full", layer_ids=[0], num_heads=4, num_kv_heads=1, head_dim_qk=48, head_dim_v=32,
                    scaling=0.2, is_mla=True)
    r2t = ReqToTokenPool(8, 160, "cpu")
    kv = KVPool(512, 1, [(1, 48, 32)], torch.bfloat16, "cpu", mla_layers=[0])
    be = _backend([mla])
    with pytest.raises(CapabilityMismatch, match="no tree mask"):
        verify_backend(be, role="p", name="triton", model=None, layer_kinds=[mla], req_to_token_pool=r2t, kv_pool=kv,
                       torch_device="cpu", dtype="bfloat16", spec=spec_of(3, 4, 8), decode_steps=1)
    r = verify_backend(_backend([mla]), role="p", name="triton", model=None, layer_kinds=[mla],
                       req_to_token_pool=ReqToTokenPool(8, 160, "cpu"),
                       kv_pool=KVPool(512, 1, [(1, 48, 32)], torch.bfloat16, "cpu", mla_layers=[0]),
                       torch_device="cpu", dtype="bfloat16", spec=spec_of(3, 1, 4), decode_steps=1)
    assert r.passed, r.detail


# ---------------------------------------------------------------- CUDA graphs, emulated

def _stack():
    from pipeline.runtime.model import AttentionStack

    spec = ModelSpec(model_type="probe", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, v_head_dim=32, scaling=32 ** -0.5, layer_types=["full"],
                     dtype="bfloat16", source="probe")
    return AttentionStack(spec, dtype=torch.bfloat16, device="cpu", seed=0)


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE])
def test_graph_replay_of_new_trees_and_branches(monkeypatch, mode):
    """Captured at sizes 4, 2, 1; each replay of a new batch (3 requests: padded to 4; new trees, new branches)
    equals the eager step of the same backend: the replay metadata rewrote the tree masks, positions and token
    tables in the graph buffers. The buffers made are the ones the graph-memory estimate counts."""
    from pipeline.backends import records
    from pipeline.runtime.cuda_graphs import DecodeGraphRunner

    emulate_graphs(monkeypatch)
    stack, spec, gen = _stack(), spec_of(3, 3, 6), torch.Generator().manual_seed(0)
    r2t = ReqToTokenPool(6, 96, "cpu")
    kv = KVPool(512, 4, [(2, 32, 32)], torch.bfloat16, "cpu")
    alloc = PageAllocator(r2t, 512, 4, seed=1)
    be, eager = _backend(stack.spec.layer_kinds(), r2t), _backend(stack.spec.layer_kinds())
    runner = DecodeGraphRunner(stack, be, r2t, kv, [1, 2, 4], mode=mode, spec=spec)
    runner.capture()
    errs = replays_match_eager(runner, stack, eager, alloc, kv, gen, torch.bfloat16)
    assert max(errs) < 1e-6, (mode, errs)
    made = [t.numel() * t.element_size() for k, t in be._graph.items() if "." in k]
    est = records.triton_graph_state_allocs(stack.spec.layer_kinds(), [1, 2, 4], max_context_len=96, page_size=4,
                                            num_sms=4, mode=mode.value, tokens_per_req=runner.tokens_per_req)
    est_spec = [b for _, b in est[3:]]
    if mode is ForwardMode.DRAFT_DECODE:  # the scratch estimate is a bound (split count without its cap)
        assert made[:-1] == est_spec[:-1] and made[-1] <= est_spec[-1]
    else:
        assert made == est_spec
