"""``run``'s preflight on a GPU with an absurd decode-graph top: the graphs' estimate is taken from its closed-form
lower bound when that alone is beyond the device (as ``plan`` does), so the refusal comes at once instead of
after estimating ~268M batch sizes (left this open: ``pool_steps.graph_estimate`` built the full series).
A fake H200 (no GPU needed): the estimate the pool check sees is the bound, which is above 90 % of the device.
(A top of 2**31 - 1 needs as many rows, whose req_to_token the setup refuses first.)"""

from __future__ import annotations

import time
import tracemalloc
from types import SimpleNamespace

import msgspec

from conftest import cuda_facts

from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.memory.pools import POOL_MEMORY_SHARE
from pipeline.core.spec import truncate_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.runtime import table
from pipeline.runtime.runner import RunnerConfig

TOP = 2 ** 30   # req_to_token at 26 tokens (run's shortest) is 111 GB: the pools fit, the graphs decide


def _runner(llama, top: int, max_reqs: int, ctx: int = 26) -> SimpleNamespace:
    facts = cuda_facts()
    req = SetupRequest(model=llama, args=AttentionArgs(attention_backend="triton", cuda_graph_max_bs=top, page_size=16),
                       pool=PoolFacts(max_reqs=max_reqs, max_context_len=ctx, num_token_slots=4096, page_size=16),
                       device="cuda:0")
    cfg = RunnerConfig(request=req, num_layers=2, min_token_slots=72, min_context_len=26)
    return SimpleNamespace(config=cfg, platform=FakePlatform(facts, free_bytes=facts.total_memory_bytes),
                           index=0, installed={"torch": True, "triton": True, "flashinfer-python": False},
                           rank_group=None)


def test_an_absurd_top_is_estimated_by_its_bound_at_once(llama):
    r = _runner(llama, TOP, TOP)
    spec = truncate_spec(llama, 2)
    tracemalloc.start()
    t = time.monotonic()
    est = table.graph_estimate(r, spec)
    took, (_, peak) = time.monotonic() - t, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert table.setup_decided(r, spec)[1].refused is None   # the setup accepted: the graphs are what decide
    assert est is not None and est.total_bytes > cuda_facts().total_memory_bytes * POOL_MEMORY_SHARE
    assert took < 20 and peak < 200 << 20, (took, peak)


def test_a_top_that_fits_gets_the_full_estimate(llama):
    """Below the device, nothing changes: the estimate is the full one (one entry per size), not the bound."""
    from pipeline.memory.graphs import estimate_for_decided

    r = _runner(llama, 64, 64)
    spec = truncate_spec(llama, 2)
    est = table.graph_estimate(r, spec)
    req, decided = table.setup_decided(r, spec)
    full = estimate_for_decided(req, decided)
    assert est is not None and msgspec.to_builtins(est) == msgspec.to_builtins(full)
