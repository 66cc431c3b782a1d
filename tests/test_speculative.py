"""Speculative decoding on CPU: the shape rules, the tree helpers, torch_native and FlashInfer's glue (its CPU
stand-in) on random EAGLE trees and draft branches against the float64 reference that applies the tree mask, CUDA-graph
metadata replayed without a GPU, and ``run --device cpu`` with the speculative flags.

The Triton kernels' tree mask and token tables run under the interpreter in tests/test_speculative_triton.py; the
H200 grid (flashinfer, triton; eager and CUDA-graph replay) is tests/gpu/test_speculative_gpu.py.
"""

from __future__ import annotations

import json
import sys

import msgspec
import pytest
import torch

import fake_flashinfer
from conftest import CONFIGS
from fi_reference import Scenario, make_kind
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.backends.speculative import SpecInfo, check_parents, full_mask_rows, tree_mask
from pipeline.backends.torch_native import TorchNativeBackend
import pipeline.backends.torch_native as tn
from pipeline.cli import main
from pipeline.core.contracts import AttentionArgs, ForwardMode, LayerKind, SpeculativeParams
from pipeline.core.errors import BuildError, CapabilityMismatch, ConflictingOptions
from pipeline.core.model_spec import load_model_spec
from pipeline.core.speculative import decide_speculative, max_draft_tokens
from pipeline.platforms.profiles import PROFILES
from pipeline.runtime.spec_batches import path_to, random_tree
from pipeline.runtime.verify import verify_backend
from states import resolve

LLAMA = load_model_spec(CONFIGS / "llama-3.1-8b.json")
QWEN = load_model_spec(CONFIGS / "qwen3-8b.json")
ALL = {"torch": True, "triton": True, "flashinfer-python": True}


def spec_of(steps: int, topk: int, draft: int) -> SpeculativeParams:
    return SpeculativeParams(algorithm="EAGLE", num_steps=steps, topk=topk, num_draft_tokens=draft, source="flags")


# ---------------------------------------------------------------- the shape, settled as sglang 0.5.23 settles it

@pytest.mark.parametrize("model,flags,want", [
    (LLAMA, {}, (5, 4, 8, "auto:LlamaForCausalLM")),           # _auto_choose_speculative_params: Llama
    (QWEN, {}, (3, 1, 4, "auto:Qwen3ForCausalLM")),             # everything else
    (LLAMA, {"speculative_algorithm": "STANDALONE"}, (3, 1, 4, "auto:LlamaForCausalLM")),
    (LLAMA, {"speculative_num_steps": 3, "speculative_eagle_topk": 1}, (3, 1, 4, "flags:topk1")),
    (LLAMA, {"speculative_num_steps": 2, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3},
     (2, 1, 3, "flags")),
    (LLAMA, {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 37},
     (3, 4, 37, "flags")),                                         # 1 + 4 + 2 * 16: every candidate
    (LLAMA, {"speculative_algorithm": "NGRAM"}, (1, 10, 12, "ngram")),
])
def test_shape_follows_sglang(model, flags, want):
    """Defaults from the target architecture, chains derived, trees as given (sglang's speculative_hook.py)."""
    args = AttentionArgs(**{"speculative_algorithm": "EAGLE", **flags})
    s = decide_speculative(args, model)
    assert (s.num_steps, s.topk, s.num_draft_tokens, s.source) == want
    assert s.is_tree == (want[1] > 1)


@pytest.mark.parametrize("flags,named,remedy", [
    ({"speculative_eagle_topk": 4}, "speculative_num_steps",
     "set speculative_num_steps=5 and speculative_num_draft_tokens=8 or drop speculative_eagle_topk"),
    ({"speculative_num_steps": 3}, "speculative_eagle_topk", "set speculative_eagle_topk=1"),
    ({"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 8},
     "speculative_num_draft_tokens", "set speculative_num_draft_tokens=4 or drop speculative_num_draft_tokens"),
    ({"speculative_num_steps": 3, "speculative_eagle_topk": 4}, "speculative_num_draft_tokens",
     "set speculative_num_draft_tokens=8"),
    ({"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 38},
     "speculative_num_draft_tokens", "set speculative_num_draft_tokens=37 or set speculative_num_steps=4"),
])
def test_shape_refusals_name_flags_and_a_remedy_that_resolves(flags, named, remedy):
    """What sglang asserts on, rewrites silently or fails on later is refused by name; each alternative of the
    remedy then settles."""
    args = AttentionArgs(speculative_algorithm="EAGLE", **flags)
    with pytest.raises(ConflictingOptions) as e:
        decide_speculative(args, LLAMA)
    assert named in [f.name for f in e.value.info.flags] and e.value.info.remedy == remedy
    for fix in e.value.fixes:
        assert decide_speculative(msgspec.structs.replace(args, **fix), LLAMA) is not None


def test_ngram_refuses_a_topk_it_would_replace():
    with pytest.raises(ConflictingOptions, match="has no effect with speculative_algorithm NGRAM"):
        decide_speculative(AttentionArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=4), LLAMA)


def test_max_draft_tokens_counts_every_candidate():
    assert max_draft_tokens(3, 1) == 4 and max_draft_tokens(1, 4) == 5 and max_draft_tokens(5, 4) == 1 + 4 + 4 * 16


def test_draft_worker_takes_topk_from_the_target_model():
    """sglang#36554: the draft worker chose its backend before top-k was filled in. Here the draft worker of a Llama
    target (top-k 4 by default) is checked against that tree: an MLA draft model cannot get triton (no MLA tree
    mask); with the draft's own architecture (not Llama) the default would have been a chain that triton serves."""
    draft = load_model_spec(CONFIGS / "deepseek-v2-lite.json")
    args = AttentionArgs(speculative_algorithm="EAGLE", attention_backend="triton")
    h200 = PROFILES["h200"]
    with pytest.raises(CapabilityMismatch, match="tree verification"):
        resolve.decide(args, draft, h200, is_draft_worker=True, installed=ALL, target=LLAMA)
    res = resolve.decide(args, draft, h200, is_draft_worker=True, installed=ALL, target=draft)
    assert res.speculative.topk == 1 and res.pair.prefill == "triton"


def test_resolution_records_the_shape_and_h200_resolves_trees():
    """The issue's plan: EAGLE top-k 4, 8 draft tokens, 3 steps on an H200 -> flashinfer, triton when asked."""
    args = AttentionArgs(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=4,
                         speculative_num_draft_tokens=8)
    h200 = PROFILES["h200"]
    res = resolve.decide(args, LLAMA, h200, is_draft_worker=False, installed=ALL)
    assert res.pair.prefill == res.pair.decode == "flashinfer" and res.speculative == spec_of(3, 4, 8)
    res = resolve.decide(msgspec.structs.replace(args, attention_backend="triton"), LLAMA, h200,
                         is_draft_worker=False, installed=ALL)
    assert res.pair.prefill == "triton"


def test_a_backend_without_paged_trees_is_refused_with_page_size_above_one(monkeypatch):
    """sglang's rule (top-k > 1 with page_size > 1 only where the backend supports it) holds for any record: a
    registered record claiming trees but not speculative_tree_paged is refused at page 16 with the fix page_size=1."""
    from pipeline.backends import registry
    from states.capability_check import reasons_with_flags

    cap = msgspec.structs.replace(registry.get("triton").capability,
                                  features=[f for f in registry.get("triton").capability.features
                                            if f != "speculative_tree_paged"])
    args = AttentionArgs(speculative_algorithm="EAGLE", page_size=16)
    why = reasons_with_flags(cap, args=args, model=LLAMA, device=PROFILES["h200"], installed=ALL,
                             is_draft_worker=False, spec=spec_of(3, 4, 8))
    assert [r.fix for r in why] == [(("page_size", 1),)] and "page_size 16" in why[0].text


def test_tbo_needs_attention_dp_or_an_ep_all_to_all():
    """sglang's check_two_batch_overlap: refused without either (conflicting_options, the three fields named); passes
    with --attn-dp-size > 1 (a divisor of world_size) or --moe-a2a-backend."""
    h200 = PROFILES["h200"]
    with pytest.raises(ConflictingOptions) as e:
        resolve.decide(AttentionArgs(enable_two_batch_overlap=True), LLAMA, h200, is_draft_worker=False,
                       installed=ALL)
    assert [f.name for f in e.value.info.flags] == ["enable_two_batch_overlap", "attn_dp_size", "moe_a2a_backend"]
    assert "drop enable_two_batch_overlap" in e.value.info.remedy
    for extra in ({"attn_dp_size": 2}, {"moe_a2a_backend": "deepep"}):
        resolve.decide(AttentionArgs(enable_two_batch_overlap=True, **extra), LLAMA, h200, is_draft_worker=False,
                       installed=ALL)


# ---------------------------------------------------------------- trees

def test_parents_must_be_a_tree_in_sglangs_order():
    assert check_parents([-1, 0, 0, 1]) == [-1, 0, 0, 1]
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], []):
        with pytest.raises(BuildError) as e:
            check_parents(bad)
        assert e.value.info.code == "forward_input_invalid"


@pytest.mark.parametrize("seed", range(6))
def test_tree_mask_is_each_tokens_path_to_the_root(seed):
    """The backends' mask builder against paths walked to the root (random trees of varying depth and width)."""
    gen = torch.Generator().manual_seed(seed)
    topk = 1 + seed % 4
    steps = 1 + seed % 5
    n = min(max_draft_tokens(steps, topk), 2 + seed * 3)
    parents = random_tree(n, topk, steps, gen)
    mask = tree_mask(parents)
    for i in range(n):
        assert set(torch.nonzero(mask[i]).view(-1).tolist()) == set(path_to(parents, i))
    full = full_mask_rows(SpecInfo(parents=[parents]), [5]).view(n, 5 + n)
    assert full[:, :5].all() and torch.equal(full[:, 5:], mask)


# ---------------------------------------------------------------- torch_native, the reference backend

KINDS = {
    "gqa": LayerKind(kind="full", layer_ids=[0], num_heads=4, num_kv_heads=2, head_dim_qk=32, head_dim_v=32,
                     scaling=32 ** -0.5),
    "window": LayerKind(kind="sliding", layer_ids=[0], num_heads=4, num_kv_heads=1, head_dim_qk=32, head_dim_v=32,
                        scaling=32 ** -0.5, sliding_window=5),
    "softcap-sinks": LayerKind(kind="full", layer_ids=[0], num_heads=4, num_kv_heads=4, head_dim_qk=32, head_dim_v=32,
                               scaling=32 ** -0.5, logit_softcap=4.0, has_sinks=True),
    "chunk": LayerKind(kind="chunked", layer_ids=[0], num_heads=4, num_kv_heads=2, head_dim_qk=32, head_dim_v=32,
                       scaling=32 ** -0.5, attention_chunk_size=6),
    "mla": LayerKind(kind="full", layer_ids=[0], num_heads=8, num_kv_heads=1, head_dim_qk=96, head_dim_v=64,
                     scaling=48 ** -0.5, is_mla=True),
}
SHAPES = [spec_of(3, 1, 4), spec_of(2, 2, 5), spec_of(3, 4, 8), spec_of(5, 3, 16)]


def _verify(backend, kind: LayerKind, page_size: int, spec: SpeculativeParams, draft: bool, dtype="bfloat16",
            seed: int = 0):
    r2t = ReqToTokenPool(8, 160, "cpu")
    kv = KVPool(128 * page_size, page_size, [(kind.num_kv_heads, kind.head_dim_qk, kind.head_dim_v)],
                getattr(torch, dtype), "cpu", mla_layers=[0] if kind.is_mla else ())
    return verify_backend(backend, role="primary", name=getattr(backend, "name", "x"), model=None,
                          layer_kinds=[kind], req_to_token_pool=r2t, kv_pool=kv, torch_device="cpu", dtype=dtype,
                          spec=spec, draft=draft, decode_steps=2, seed=seed)


def _rotated(i: int, n: int = 2) -> list[SpeculativeParams]:
    """``n`` of :data:`SHAPES`, starting at ``i``: each parameter set takes other shapes, all of them are covered."""
    return [SHAPES[(i + j) % len(SHAPES)] for j in range(n)]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_torch_native_verifies_trees_against_float64(kind, page_size):
    """Random trees (chains, 2-4 wide, up to 5 deep; two shapes per case, every shape over the cases), mixed with a
    one-token tree (a decode), each token against float64 with its ancestors mask, then decodes from the accepted
    paths — every layer kind, pages 1, 3 and 16 (float32: the reference backend's own error is tiny)."""
    for i, spec in enumerate(_rotated(sorted(KINDS).index(kind) + page_size)):
        r = _verify(TorchNativeBackend(), KINDS[kind], page_size, spec, draft=False, dtype="float32", seed=i)
        assert r.passed and r.max_rel_err < 1e-4, r.detail
        assert "target-verify" in r.detail


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_torch_native_draft_decode_against_float64(kind):
    """A draft extend and a round of draft-decode steps of top-k branches, branches continuing each other's paths."""
    spec = SHAPES[1 + sorted(KINDS).index(kind) % 3]
    r = _verify(TorchNativeBackend(), KINDS[kind], 4, spec, draft=True, dtype="float32")
    assert r.passed and r.max_rel_err < 1e-4, r.detail
    assert f"draft-decode#{spec.num_steps - 1}" in r.detail


def test_the_check_fails_a_backend_that_ignores_the_tree(monkeypatch):
    """The verification can fail: torch_native with its tree mask dropped (causal by position only) or a draft
    branch reading one token short is far outside the tolerance."""
    units = tn.batch_units
    monkeypatch.setattr(tn, "batch_units", lambda fb, lay: [u._replace(allowed=None) for u in units(fb, lay)])
    r = _verify(TorchNativeBackend(), KINDS["gqa"], 1, spec_of(3, 4, 8), draft=False)
    assert not r.passed and r.max_rel_err > 0.1 and "target-verify" in r.detail
    monkeypatch.setattr(tn, "batch_units", lambda fb, lay: [u._replace(slots=u.slots[:-1], k_pos=u.k_pos[:-1])
                                                           if fb.is_draft_decode() else u for u in units(fb, lay)])
    r = _verify(TorchNativeBackend(), KINDS["gqa"], 1, spec_of(3, 4, 8), draft=True)
    assert not r.passed and "draft-decode" in r.detail


def test_a_verify_batch_rejects_a_tree_of_the_wrong_size():
    r2t = ReqToTokenPool(4, 64, "cpu")
    kv = KVPool(256, 1, [(2, 32, 32)], torch.float32, "cpu")
    alloc = PageAllocator(r2t, 256, 1)
    with pytest.raises(BuildError, match="tree sizes"):
        make_forward_batch(ForwardMode.TARGET_VERIFY, [0, 1], [3, 2], alloc, kv,
                           spec_info=SpecInfo(parents=[[-1, 0, 0], [-1, 0, 0]]))


# ---------------------------------------------------------------- FlashInfer's glue (its CPU stand-in)

@pytest.fixture
def fib(monkeypatch):
    """The FlashInfer backend module with the CPU stand-in installed and JIT checks stubbed out."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(fake_flashinfer, "JIT_MODULES", {})
    from pipeline.backends.flashinfer import backend as mod

    monkeypatch.setattr(mod, "ensure_compiled", lambda v, **kw: {"variant": v.name, "status": "cached", "seconds": 0})
    return mod


FI_TREE_KINDS = [make_kind(4, 2, 16, layer_ids=(0,)), make_kind(4, 1, 16, softcap=2.0, layer_ids=(1,))]
FI_ALL_KINDS = FI_TREE_KINDS + [make_kind(4, 2, 16, window=5, layer_ids=(2,)),
                                make_kind(4, 4, 16, sinks=True, layer_ids=(3,))]


def _fi_scenario(kinds, page_size):
    return Scenario(kinds, device="cpu", dtype=torch.float32, page_size=page_size, max_reqs=8, max_context_len=256,
                    ws_bytes=1 << 20, name="flashinfer", sm_count=4, facts_type="cuda")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_flashinfer_glue_trees_and_draft_branches(fib, page_size):
    """Target verify through the paged prefill wrapper with the packed custom mask (unpacked by the stand-in as the
    kernel reads it; two shapes per page size, every shape over them) and draft decode over the page-size-1 view,
    against float64."""
    for i, spec in enumerate(_rotated(page_size)):
        sc = _fi_scenario(FI_TREE_KINDS, page_size)
        r = verify_backend(fib.create(sc.ctx), role="p", name="flashinfer", model=None, layer_kinds=FI_TREE_KINDS,
                           req_to_token_pool=sc.req_pool, kv_pool=sc.kv, torch_device="cpu", dtype="float32",
                           spec=spec, draft=False, seed=i)
        assert r.passed and r.max_rel_err < 1e-5, r.detail
    sc = _fi_scenario(FI_ALL_KINDS, page_size)  # draft decode: every kind (a branch is a chain of positions)
    r = verify_backend(fib.create(sc.ctx), role="p", name="flashinfer", model=None, layer_kinds=FI_ALL_KINDS,
                       req_to_token_pool=sc.req_pool, kv_pool=sc.kv, torch_device="cpu", dtype="float32",
                       spec=spec_of(3, 4, 8), draft=True)
    assert r.passed and r.max_rel_err < 1e-5, r.detail


def test_flashinfer_refuses_a_tree_over_a_window_layer(fib):
    """FlashInfer's window counts KV indices, not tree positions: a tree over a sliding-window layer is refused at
    plan time naming the kind (resolve refuses it before, from the record's tree_features)."""
    sc = _fi_scenario(FI_ALL_KINDS, 4)
    with pytest.raises(CapabilityMismatch, match="sliding-window layers"):
        verify_backend(fib.create(sc.ctx), role="p", name="flashinfer", model=None, layer_kinds=FI_ALL_KINDS,
                       req_to_token_pool=sc.req_pool, kv_pool=sc.kv, torch_device="cpu", dtype="float32",
                       spec=spec_of(3, 4, 8), draft=False)


# ---------------------------------------------------------------- run --device cpu

def _run_json(capsys, *flags):
    code = main(["run", "--device", "cpu", "--json", "--num-layers", "1", "--decode-steps", "1", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_run_verifies_a_target_verify_step(capsys, tmp_path):
    """The issue's flags on CPU: the resolution carries the shape, the instance check and the stack's steps name the
    target-verify step and its mode, all within tolerance."""
    code, out = _run_json(capsys, "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4",
                          "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3",
                          "--log-file", str(tmp_path / "r.jsonl"))
    assert code == 0 and out["ok"], out.get("error")
    assert out["resolved"]["speculative"] == {"algorithm": "EAGLE", "num_steps": 3, "topk": 4,
                                              "num_draft_tokens": 8, "source": "flags"}
    assert "target-verify" in out["verified"][0]["detail"] and out["verified"][0]["passed"]
    steps = {s["step"]: s for s in out["model_steps"]}
    assert steps["target-verify"]["mode"] == "target_verify" and steps["target-verify"]["passed"]
    assert all(s["passed"] for s in out["model_steps"])


def test_run_draft_worker_verifies_draft_decode_steps(capsys, tmp_path):
    code, out = _run_json(capsys, "--draft-worker", "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk",
                          "4", "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3", "--page-size",
                          "4", "--log-file", str(tmp_path / "r.jsonl"))
    assert code == 0 and out["ok"], out.get("error")
    modes = [s["mode"] for s in out["model_steps"]]
    assert modes.count("draft_decode") == 3 and "draft_extend" in modes
    assert all(s["passed"] for s in out["model_steps"])


# ---------------------------------------------------------------- CUDA graphs, emulated (tests/graph_emulation.py)

def _fi_stack_and_backend(fib, page_size):
    from pipeline.runtime.model import AttentionStack
    from pipeline.core.contracts import ModelSpec

    spec = ModelSpec(model_type="probe", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, v_head_dim=16, scaling=16 ** -0.5, layer_types=["full"],
                     dtype="float32", source="probe")
    stack = AttentionStack(spec, dtype=torch.float32, device="cpu", seed=0)
    sc = Scenario(spec.layer_kinds(), device="cpu", dtype=torch.float32, page_size=page_size, max_reqs=6,
                  max_context_len=96, ws_bytes=1 << 20, name="flashinfer", sm_count=4, facts_type="cuda")
    return stack, sc, fib.create(sc.ctx), TorchNativeBackend()


@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE])
@pytest.mark.parametrize("page_size", [1, 4])
def test_flashinfer_graph_replay_of_new_trees_and_branches(fib, monkeypatch, mode, page_size):
    """FlashInfer's graph wrappers (verify: custom_mask_buf / mask_indptr_buf; draft decode: the token-level
    buffers) re-planned before each replay of new trees or branches give the eager torch_native answer; the buffers
    made are the ones the graph-memory estimate counts (its made-once part)."""
    from graph_emulation import emulate_graphs, replays_match_eager
    from pipeline.backends.flashinfer import rules
    from pipeline.runtime.cuda_graphs import DecodeGraphRunner

    emulate_graphs(monkeypatch)
    stack, sc, be, ref = _fi_stack_and_backend(fib, page_size)
    spec, gen = spec_of(3, 3, 6), torch.Generator().manual_seed(0)
    runner = DecodeGraphRunner(stack, be, sc.req_pool, sc.kv, [1, 2, 4], mode=mode, spec=spec)
    runner.capture()
    errs = replays_match_eager(runner, stack, ref, sc.alloc, sc.kv, gen, torch.float32)
    assert max(errs) < 1e-5, (mode, errs)
    made = [t.numel() * t.element_size() for t in be.graph.buffers()]
    est = rules.graph_state_allocs(stack.spec.layer_kinds(), [1, 2, 4], max_context_len=96, page_size=page_size,
                                   num_sms=4, mode=mode.value, tokens_per_req=runner.tokens_per_req)
    assert made == [b for bs, b in est if bs == 0]


def test_graph_memory_estimate_counts_the_speculative_step():
    """A target worker's graphs hold bs x num_draft_tokens rows, a draft worker's bs x topk: the estimate grows with
    the rows (the same model and sizes as decode graphs) and names the mode."""
    from pipeline.memory.graphs import estimate_graph_memory

    kw = dict(dtype="bfloat16", kv_dtype="bfloat16", batch_sizes=[1, 2, 4, 8], arch="sm90", max_context_len=1024,
              page_size=16, num_sms=132)
    spec = msgspec.structs.replace(LLAMA, num_hidden_layers=2, layer_types=["full", "full"])
    for backend in ("flashinfer", "triton"):
        dec = estimate_graph_memory(spec, decode_backend=backend, **kw)
        ver = estimate_graph_memory(spec, decode_backend=backend, mode="target_verify", tokens_per_req=8, **kw)
        dra = estimate_graph_memory(spec, decode_backend=backend, mode="draft_decode", tokens_per_req=4, **kw)
        assert ver.mode == "target_verify" and ver.tokens_per_req == 8 and dra.mode == "draft_decode"
        assert ver.pool_bytes > dra.pool_bytes > dec.pool_bytes and ver.state_bytes >= dec.state_bytes
        assert ver.total_bytes > dra.total_bytes > dec.total_bytes
