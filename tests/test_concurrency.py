"""Workers initialising in parallel threads of one process: independent machines, logs and buffers.

A target worker and a speculative draft worker (and PD-mux groups on a fake GPU platform) start
at the same moment from a barrier. Each must get its own run id, its own machine walking all six
states, its own workspaces — and the draft must never change what the target resolved or was
asked for (both snapshotted before and after, and compared with the target run alone).
"""

from __future__ import annotations

import json
import threading

import msgspec
import pytest

from conftest import CONFIGS, cuda_facts
from pipeline.core import events as ev
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.fake import FakePlatform

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}
SIX = ["device-init", "resolve", "build-mode", "npu-lazy-mem", "annotate", "done"]
POOL = PoolFacts(max_reqs=4, max_context_len=64, num_token_slots=64, page_size=1)


def _spec(name: str, layers: int):
    cfg = json.loads((CONFIGS / name).read_text())
    cfg["num_hidden_layers"] = layers
    return load_model_spec(cfg)


@pytest.fixture(scope="module")
def models():
    return _spec("llama-3.1-8b.json", 2), _spec("qwen2.5-7b.json", 1)


def _parallel(jobs):
    """Run every job on its own thread, all released by one barrier; returns results or raises the first error."""
    barrier = threading.Barrier(len(jobs))
    out: list = [None] * len(jobs)

    def work(i, job):
        barrier.wait()
        try:
            out[i] = job()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            out[i] = e

    threads = [threading.Thread(target=work, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def _snapshot(req, result):
    return (msgspec.json.encode(req), msgspec.json.encode(result.resolution), msgspec.json.encode(result.plan),
            result.prefill_attention_backend_str, result.decode_attention_backend_str)


def _states(result):
    t = [r for r in result.events if isinstance(r, ev.StateTransition)]
    return [r.from_state for r in t] + [t[-1].to]


def test_target_and_draft_in_parallel_are_independent(models):
    target_model, draft_model = models
    target = SetupRequest(args=AttentionArgs(enable_two_batch_overlap=True, moe_a2a_backend="deepep", speculative_algorithm="EAGLE",
                                             speculative_draft_attention_backend="torch_native"),
                          model=target_model, pool=POOL, device="cpu")
    draft = SetupRequest(args=target.args, model=target_model, draft_model=draft_model, is_draft_worker=True,
                         pool=POOL, device="cpu")
    before = msgspec.json.encode(target)
    with build_attention_backends(target, installed=INSTALLED) as alone:
        solo = _snapshot(target, alone)
    for _ in range(3):
        t_out, d_out = _parallel([lambda: build_attention_backends(target, installed=INSTALLED),
                                  lambda: build_attention_backends(draft, installed=INSTALLED)])
        try:
            assert _snapshot(target, t_out) == solo and msgspec.json.encode(target) == before
            assert t_out.plan.mode.value == "tbo" and d_out.plan.mode.value == "normal"  # draft: TBO downgraded
            assert d_out.resolution.pair.is_draft_override and not t_out.resolution.pair.is_draft_override
            assert t_out.run_id != d_out.run_id
            for out in (t_out, d_out):
                assert _states(out) == SIX and {r.run_id for r in out.events} == {out.run_id}
            assert t_out.pools["kv_pool"] is not d_out.pools["kv_pool"]
            assert len(d_out.pools["kv_pool"].k_buffer) == 1 and len(t_out.pools["kv_pool"].k_buffer) == 2
        finally:
            t_out.close()
            d_out.close()


def test_pdmux_groups_on_a_fake_gpu_in_parallel(models):
    """Three PD-mux starts (2, 3, 4 decode groups) at once: each its own shared workspace, plan and run id."""
    model = models[0]
    reqs = [SetupRequest(args=AttentionArgs(enable_pdmux=True, sm_group_num=n), model=model, pool=POOL,
                         device="cuda:0") for n in (2, 3, 4)]
    alone = []
    for r in reqs:
        with build_attention_backends(r, platform=FakePlatform(cuda_facts()), installed=INSTALLED) as out:
            alone.append(_snapshot(r, out))
    outs = _parallel([lambda r=r: build_attention_backends(r, platform=FakePlatform(cuda_facts()), installed=INSTALLED)
                      for r in reqs])
    try:
        assert [_snapshot(r, o) for r, o in zip(reqs, outs)] == alone
        assert len({o.run_id for o in outs}) == 3
        shared = [o.workspace_pool.get("ws-shared") for o in outs]
        assert len({id(w) for w in shared}) == 3 and len({id(w.buffer) for w in shared}) == 3
        for n, o in zip((2, 3, 4), outs):
            assert _states(o) == SIX and len(o.decode_attn_backend_group) == n
            assert o.decode_attn_backend is o.decode_attn_backend_group[0]
            assert {r.run_id for r in o.events} == {o.run_id}
    finally:
        for o in outs:
            o.close()
