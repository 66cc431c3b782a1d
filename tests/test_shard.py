"""A rank's tensor/pipeline-parallel shard: sglang's rank layout, head split, kv replication, PP partition, the
refusals, ``plan``'s shard report, and that pools, workspaces and the graph estimate are the shard's."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from conftest import CONFIGS, run_main
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import ConfigError
from pipeline.core.model_spec import load_model_spec
from pipeline.core.shard import check_tp, plan_layout, pp_partition, rank_coords

DATA = Path(__file__).resolve().parent / "data" / "configs"
L70 = str(DATA / "llama-3.1-70b.json")
V3 = str(CONFIGS / "deepseek-v3.json")


def sglang_pp_indices(n: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """sglang ``get_pp_indices`` (python/sglang/srt/distributed/utils.py) as written there, without the env var."""
    base, rem = divmod(n, pp_size)
    if pp_rank >= pp_size - rem:
        start = pp_rank * (base + 1) - (pp_size - rem)
        return start, start + base + 1
    return pp_rank * base, pp_rank * base + base


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 200), pp=st.integers(1, 16))
def test_partition_is_sglangs_get_pp_indices(n, pp):
    if pp > n:
        with pytest.raises(ConfigError) as ei:
            pp_partition(n, pp, {})
        assert ei.value.info.code == "pp_size_invalid"
        return
    parts = pp_partition(n, pp, {})
    assert [(sum(parts[:r]), sum(parts[:r + 1])) for r in range(pp)] == [sglang_pp_indices(n, r, pp) for r in range(pp)]


def test_partition_env_overrides_and_bad_ones_are_refused():
    assert pp_partition(32, 2, {"SGLANG_PP_LAYER_PARTITION": "20,12"}) == [20, 12]
    for bad in ("20,13", "32", "a,b", "32,0"):
        with pytest.raises(ConfigError) as ei:
            pp_partition(32, 2, {"SGLANG_PP_LAYER_PARTITION": bad})
        assert ei.value.info.code == "invalid_value" and "16,16" in ei.value.info.remedy


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (1, 2), (2, 2), (8, 3)])
def test_rank_layout_is_sglangs(tp, pp):
    """sglang's ModelRunner: rank = tp_size * pp_rank + tp_rank; every (tp_rank, pp_rank) exactly once."""
    seen = [rank_coords(r, tp) for r in range(tp * pp)]
    assert sorted(seen) == sorted((t, p) for t in range(tp) for p in range(pp))
    assert all(tp * p + t == r for r, (t, p) in enumerate(seen))


def _model(heads: int, kv: int, layers: int = 4):
    return load_model_spec({"model_type": "llama", "hidden_size": heads * 64, "num_attention_heads": heads,
                            "num_key_value_heads": kv, "num_hidden_layers": layers, "head_dim": 64})


@settings(max_examples=150, deadline=None)
@given(kv_exp=st.integers(0, 4), group_exp=st.integers(0, 3), tp_exp=st.integers(0, 5))
def test_every_query_head_lands_once_with_its_own_kv_head(kv_exp, group_exp, tp_exp):
    """Over the TP ranks each query head is served once, next to the kv head GQA pairs it with in the whole model
    (query head j reads kv head j // group): divided kv heads and replicated ones alike."""
    kv, heads, tp = 2 ** kv_exp, 2 ** (kv_exp + group_exp), 2 ** tp_exp
    m = _model(heads, kv)
    if heads % tp:
        with pytest.raises(ConfigError):
            plan_layout(m, tp_size=tp, pp_size=1, rank=0)
        return
    served = []
    for r in range(tp):
        lay = plan_layout(m, tp_size=tp, pp_size=1, rank=r)
        assert lay.num_kv_heads == max(1, kv // tp) and lay.kv_replicated == (kv < tp)
        local_group = lay.num_heads // lay.num_kv_heads
        for i in range(lay.num_heads):
            j = lay.head_start + i
            assert lay.kv_head_start + i // local_group == j // (heads // kv)
            served.append(j)
    assert sorted(served) == list(range(heads))


@pytest.mark.parametrize("heads,kv,tp,ok", [(32, 8, 3, False), (32, 8, 16, True), (32, 8, 32, True),
                                            (28, 4, 7, False), (28, 4, 2, True), (40, 8, 16, False),
                                            (12, 3, 6, True), (12, 3, 4, False)])
def test_tp_rule(heads, kv, tp, ok):
    if ok:
        check_tp(heads, kv, tp)
        return
    with pytest.raises(ConfigError) as ei:
        check_tp(heads, kv, tp)
    info = ei.value.info
    assert info.code == "tp_size_invalid" and ("tp_size", tp) in [(f.name, f.value) for f in info.flags]
    fix = int(info.remedy.rsplit(" ", 1)[1])
    check_tp(heads, kv, fix)  # the remedy works


def _plan(*args: str) -> tuple[int, dict]:
    proc = run_main("plan", "--json", *args)
    return proc.returncode, json.loads(proc.stdout)


def test_plan_tp8_llama70b_and_deepseek_v3():
    """Done when: --tp-size 8 shows per-rank heads for a 70B-class GQA config and for DeepSeek-V3 (MLA)."""
    rc, out = _plan("--tp-size", "8", "--model", L70)
    assert rc == 0 and out["shard"] == {"tp_size": 8, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "num_heads": 8,
                                        "num_kv_heads": 1, "layer_range": [0, 80],
                                        "kinds": [{"kind": "full", "num_heads": 8, "num_kv_heads": 1}]}
    rc, out = _plan("--tp-size", "8", "--model", V3, "--rank", "5")
    assert rc == 0
    assert {k: out["shard"][k] for k in ("tp_rank", "num_heads", "num_kv_heads", "layer_range")} == {
        "tp_rank": 5, "num_heads": 16, "num_kv_heads": 1, "layer_range": [0, 61]}  # one latent head per rank


def test_plan_tp16_on_8_kv_heads_shows_replication():
    rc, out = _plan("--tp-size", "16", "--model", L70, "--rank", "3")
    assert rc == 0 and out["shard"]["num_heads"] == 4 and out["shard"]["num_kv_heads"] == 1
    text = " ".join(run_main("plan", "--tp-size", "16", "--model", L70).stdout.split())
    assert "shard: tp_size 16 tp_rank 0, pp_size 1 pp_rank 0: 4 of 64 heads, 1 of 8 kv heads (replicated: 2 ranks " \
           "share each), layers 0-79 of 80" in text


def test_plan_tp3_on_32_heads_is_refused_exit_3():
    rc, out = _plan("--tp-size", "3")
    assert rc == 3 and out["error"]["code"] == "tp_size_invalid"
    assert "32" in out["error"]["message"] and "--tp-size 2" in out["error"]["remedy"]


def test_plan_rank_of_a_tp2_pp2_grid():
    rc, out = _plan("--tp-size", "2", "--pp-size", "2", "--rank", "3")
    assert rc == 0 and out["shard"] == {"tp_size": 2, "tp_rank": 1, "pp_size": 2, "pp_rank": 1, "num_heads": 16,
                                        "num_kv_heads": 4, "layer_range": [16, 32],
                                        "kinds": [{"kind": "full", "num_heads": 16, "num_kv_heads": 4}]}


@pytest.mark.parametrize("args,code", [(("--pp-size", "33"), "pp_size_invalid"),
                                       (("--tp-size", "2", "--world-size", "4"), "conflicting_options"),
                                       (("--tp-size", "4", "--attn-dp-size", "3", "--world-size", "12",
                                         "--pp-size", "3"), "conflicting_options"),
                                       (("--pp-size", "16", "--model", str(CONFIGS / "qwen3-next-80b-a3b-instruct.json")),
                                        "pp_size_invalid")])
def test_refusals_name_the_numbers_and_a_value_that_works(args, code):
    rc, out = _plan(*args)
    assert rc == 3 and out["error"]["code"] == code and out["error"]["remedy"], out
    import re

    fix = dict(re.findall(r"(--[\w-]+) (\d+)", out["error"]["remedy"].split(", or")[0]))
    assert fix, out["error"]["remedy"]
    flags = {**dict(zip(args[::2], args[1::2])), **fix}
    if "--tp-size" in fix or "--pp-size" in fix:
        flags.pop("--world-size", None)  # the launch follows the sizes named
    assert _plan(*[x for kv in flags.items() for x in kv])[0] == 0, (flags, out["error"])


def test_unset_tp_size_is_the_launch_over_the_stages():
    m = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    r = SetupRequest(model=m, rank=1, world_size=4, args=AttentionArgs(pp_size=2))
    assert r.served_model.shard.tp_size == 2 and r.served_model.num_attention_heads == 16
    assert r.served_model is r.served_model  # one view per request: per-spec caches hold
    assert SetupRequest(model=m, world_size=1).served_model is m


def _report(request, device):
    from pipeline.cli.plan import plan_report

    rep = plan_report(request, device, {"torch": True, "triton": True, "flashinfer-python": True})
    return {k: rep[k] for k in ("plan", "cuda_graph_bytes_estimate", "cuda_graphs", "resolved")}


@pytest.mark.parametrize("tp,pp,rank", [(8, 1, 3), (16, 1, 0), (2, 2, 3)])
def test_a_shard_is_planned_as_the_model_of_its_heads_and_layers(tp, pp, rank):
    """Workspaces, capture sizes, the graph estimate and the resolved pair of rank ``rank`` equal those of a
    one-rank model written with that rank's heads and layers by hand — and differ from the whole model's."""
    from pipeline.platforms.profiles import get

    h200 = get("h200")
    whole = load_model_spec(L70)
    pool = PoolFacts(max_reqs=32, max_context_len=1024, num_token_slots=4096)
    kw = dict(device=h200.device_str, pool=pool)
    sharded = SetupRequest(model=whole, rank=rank, world_size=tp * pp, args=AttentionArgs(
        tp_size=tp, pp_size=pp, attention_backend="flashinfer", cuda_graph_bs=[1, 2, 4, 8]), **kw)
    t, p = rank % tp, rank // tp
    s, e = sglang_pp_indices(80, p, pp)
    by_hand = msgspec.structs.replace(whole, num_attention_heads=64 // tp, num_key_value_heads=max(1, 8 // tp),
                                      num_hidden_layers=e - s, layer_types=whole.layer_types[s:e])
    one = AttentionArgs(attention_backend="flashinfer", cuda_graph_bs=[1, 2, 4, 8])  # the default top follows tp
    alone = SetupRequest(model=by_hand, args=one, **kw)
    got, want = _report(sharded, h200), _report(alone, h200)
    assert got == want
    full = _report(SetupRequest(model=whole, args=one, **kw), h200)
    assert full["cuda_graph_bytes_estimate"] != got["cuda_graph_bytes_estimate"]


def test_given_pools_hold_exactly_the_stages_layers():
    """Under pp 2 the engine's pools= holds the stage's 16 layers (ids from 0); the whole model's 32 are refused."""
    import torch

    from pipeline.backends.memory import KVPool, ReqToTokenPool
    from pipeline.setup.build import build_attention_backends

    m = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    pool = PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=128)
    req = SetupRequest(model=m, rank=1, world_size=2, device="cpu", pool=pool, args=AttentionArgs(pp_size=2))
    stage = req.served_model

    def pools(spec):
        return {"req_to_token_pool": ReqToTokenPool(4, 64, "cpu"),
                "kv_pool": KVPool.for_layer_kinds(spec.layer_kinds(), spec.num_hidden_layers, 128, 1, torch.bfloat16,
                                                  "cpu")}

    inst = {"torch": True, "triton": False, "flashinfer-python": False}
    with build_attention_backends(req, installed=inst, pools=pools(stage)) as out:
        assert out.plan is not None
    with pytest.raises(ConfigError) as ei:
        build_attention_backends(req, installed=inst, pools=pools(m))
    assert ei.value.info.code == "pools_mismatch"
    assert "a list of 16 per-layer buffers (pipeline stage 1: layers 16-31, indexed from 0)" in ei.value.info.allowed[0]


def test_capability_is_decided_for_the_stage(tmp_path):
    """Qwen2 with sliding layers from max_window_layers on (HF Qwen2Config): under pp 2, fa3 (no windows) serves stage
    0 (all full) and refuses stage 1 (all sliding), naming that stage's layers by their ids in the whole model."""
    cfg = json.loads((CONFIGS / "qwen2.5-7b.json").read_text())
    cfg.update(use_sliding_window=True, max_window_layers=14, sliding_window=4096)
    path = tmp_path / "qwen2-sliding.json"
    path.write_text(json.dumps(cfg))
    base = ["--device-profile", "h200", "--installed", "torch,triton,flashinfer", "--attention-backend", "fa3",
            "--pp-size", "2", "--model", str(path)]
    rc, out = _plan(*base, "--rank", "0")
    assert rc == 0 and out["shard"]["layer_range"] == [0, 14] and out["resolved"]["prefill"] == "fa3"
    rc, out = _plan(*base, "--rank", "1")
    assert rc == 3 and out["error"]["code"] == "capability_mismatch"
    assert "sliding layers (layers 14..27 (14) of pipeline stage 1)" in out["error"]["message"]
    assert _plan(*base[:-4], "--model", str(path))[0] == 3  # the whole model is refused too


def test_attention_dp_splits_heads_over_the_attention_tp_ranks():
    """sglang compute_dp_attention_world_info: attn_tp_size = tp / dp, attn_tp_rank = tp_rank % attn_tp_size."""
    m = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    lays = [plan_layout(m, tp_size=4, pp_size=1, rank=r, attn_dp_size=2) for r in range(4)]
    assert [(x.attn_tp_size, x.attn_tp_rank, x.num_heads, x.head_start, x.num_kv_heads) for x in lays] == [
        (2, 0, 16, 0, 4), (2, 1, 16, 16, 4), (2, 0, 16, 0, 4), (2, 1, 16, 16, 4)]
    req = SetupRequest(model=m, rank=1, world_size=2, args=AttentionArgs(attn_dp_size=2))
    assert req.served_model.num_attention_heads == 32  # tp 2 = dp 2: each rank holds every head


@pytest.mark.parametrize("tp,pp,world,ok", [(None, 1, 4, True), (None, 3, 4, False), (2, 2, 4, True),
                                            (4, 2, 4, False), (None, 2, 4, True)])
def test_the_launch_is_tp_times_pp(tp, pp, world, ok):
    m = load_model_spec(CONFIGS / "llama-3.1-8b.json")
    make = lambda: SetupRequest(model=m, world_size=world, args=AttentionArgs(tp_size=tp, pp_size=pp))  # noqa: E731
    if ok:
        assert make().tp_size * pp == world
        return
    with pytest.raises(ConfigError) as ei:
        make()
    assert ei.value.info.code == "conflicting_options" and ("world_size", world) in [
        (f.name, f.value) for f in ei.value.info.flags]


def test_a_misspelt_partition_variable_is_named():
    from pipeline.core.settings import env_lookalikes

    assert env_lookalikes({"SGLANG_PP_LAYER_PARTITON": "16,16"}) == [("SGLANG_PP_LAYER_PARTITON",
                                                                      "SGLANG_PP_LAYER_PARTITION")]
    assert env_lookalikes({"SGLANG_PP_LAYER_PARTITION": "16,16"}) == []


def test_a_stage_names_its_layers_by_their_ids_in_the_whole_model():
    """plan's CUDA-graph line and run's model line of pipeline stage 1 (layers 16-31 of Llama-3.1-8B)."""
    plan = " ".join(run_main("plan", "--device-profile", "h200", "--installed", "torch,triton,flashinfer",
                             "--pp-size", "2", "--rank", "1").stdout.split())
    assert "over 2 attention layers (layers 16-17 of pipeline stage 1)" in plan
    run = run_main("run", "--device", "cpu", "--pp-size", "2", "--rank", "1")
    text = " ".join(run.stdout.split())
    assert run.returncode == 0, run.stderr
    assert "2 attention layers built (layers 16-17 of pipeline stage 1) of 32" in text
    assert "shard: tp_size 1 tp_rank 0, pp_size 2 pp_rank 1: 32 of 32 heads, 8 of 8 kv heads, layers 16-31 of 32" in text
