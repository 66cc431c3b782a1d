"""EAGLE trees and draft branches on the H200: flashinfer and triton against float64, eager and CUDA-graph replay.

Each case runs one speculative step through the backend (:mod:`pipeline.runtime.spec_check`): a target verify of
random trees of the shape's size over ragged cached prefixes, or one draft-decode step of top-k branches; the graph
case captures the step with sglang's hooks and replays a *new* batch (new trees / branches, new q/k/v) after the
replay metadata. bf16, tolerance 1e-2 (``max|out - ref| / max|ref|`` per request). Then ``attn-setup run`` on the GPU
with the issue's flags: the target-verify step of the model steps replays from its graph. Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pipeline.core.contracts import LayerKind, SpeculativeParams  # noqa: E402
from pipeline.runtime.spec_check import check_draft, check_verify  # noqa: E402

TOL = 1e-2
SHAPES = {"chain-3": (3, 1, 4), "sglang-llama": (5, 4, 8), "wide": (3, 8, 32), "deep": (6, 2, 16)}
PREFIXES = [37, 1000, 4096, 0 + 1, 777, 2500, 64, 300]


def spec_of(steps: int, topk: int, draft: int) -> SpeculativeParams:
    return SpeculativeParams(algorithm="EAGLE", num_steps=steps, topk=topk, num_draft_tokens=draft, source="flags")


def _kind(**kw) -> LayerKind:
    base = dict(kind="full", layer_ids=[0], num_heads=32, num_kv_heads=8, head_dim_qk=128, head_dim_v=128,
                scaling=128 ** -0.5)
    return LayerKind(**{**base, **kw})


def _run(name, kind, page_size, fn, **kw):
    """``fn`` (check_verify / check_draft) through ``name``'s backend built over the check's pools."""
    from pipeline.runtime.spec_check import backend_over, draft_scratch, make_pools

    extra = kw["spec"].num_draft_tokens if "spec" in kw else 0
    scratch = draft_scratch(kw["topk"], kw["step"]) if "topk" in kw else 0
    pools = make_pools(kind, PREFIXES, extra, page_size, torch.bfloat16, "cuda", scratch=scratch)
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    return fn(backend_over(name, kind, pools), kind, page_size=page_size, pools=pools, **kw)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ["flashinfer", "triton"])
def test_target_verify_trees(name, shape, page_size, graph):
    """Random trees of the shape over 8 ragged prefixes (1 to 4096 tokens): every tree token within 1e-2."""
    r = _run(name, _kind(), page_size, check_verify, prefix_lens=PREFIXES, spec=spec_of(*SHAPES[shape]), graph=graph)
    assert r.max_rel_err <= TOL, r


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("feature", [{"sliding_window": 512}, {"logit_softcap": 30.0}, {"has_sinks": True},
                                     {"attention_chunk_size": 1024}], ids=["window", "softcap", "sinks", "chunk"])
def test_triton_trees_with_layer_features(feature, graph):
    """Triton's tree mask with windows and chunks counted on positions prefix + depth, softcaps and sinks."""
    r = _run("triton", _kind(**feature), 16, check_verify, prefix_lens=PREFIXES, spec=spec_of(5, 4, 8), graph=graph)
    assert r.max_rel_err <= TOL, r


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("topk,step", [(1, 2), (4, 0), (4, 4), (8, 2)])
@pytest.mark.parametrize("name", ["flashinfer", "triton"])
def test_draft_decode_branches(name, topk, step, page_size, graph):
    """One draft-decode step of top-k branches (step + 1 draft tokens each) over the same prefixes."""
    r = _run(name, _kind(), page_size, check_draft, prefix_lens=PREFIXES, topk=topk, step=step, graph=graph)
    assert r.max_rel_err <= TOL, r


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_run_replays_the_target_verify_graph(backend, tmp_path, capsys):
    """``attn-setup run --device cuda`` with the issue's flags: target-verify graphs captured, the model steps'
    target-verify step replayed from one (graph=True) within tolerance, the instance check passed."""
    from pipeline.cli import main

    code = main(["run", "--device", "cuda", "--json", "--attention-backend", backend, "--page-size", "16",
                 "--num-layers", "2", "--cuda-graph-bs", "1", "2", "4", "--speculative-algorithm", "EAGLE",
                 "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3",
                 "--log-file", str(tmp_path / "r.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"], out.get("error")
    steps = {s["step"]: s for s in out["model_steps"]}
    assert steps["target-verify"]["graph"] and steps["target-verify"]["mode"] == "target_verify"
    assert all(s["passed"] for s in out["model_steps"]) and all(v["passed"] for v in out["verified"])


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_run_draft_worker_replays_draft_decode_graphs(backend, tmp_path, capsys):
    from pipeline.cli import main

    code = main(["run", "--device", "cuda", "--json", "--draft-worker", "--attention-backend", backend,
                 "--page-size", "16", "--num-layers", "2", "--cuda-graph-bs", "1", "2", "4",
                 "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4",
                 "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3",
                 "--log-file", str(tmp_path / "r.jsonl")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"], out.get("error")
    drafts = [s for s in out["model_steps"] if s["mode"] == "draft_decode"]
    assert len(drafts) == 3 and all(s["graph"] and s["passed"] for s in drafts)
