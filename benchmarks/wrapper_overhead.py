"""Decode step through the TBO and hybrid wrappers vs the same backend alone, eager and CUDA graph.

Issue 13, section 8: the wrappers no longer record a call (nor read ``req_pool_indices`` on the host)
per layer. This measures what a wrapper still costs. 32 attention layers of Llama-3.1-8B dims (32 q /
8 kv heads, head dim 128, bf16), every layer with its own K/V, contexts of ``--ctx`` tokens, page 16,
decode batches of ``--bs`` requests. One pool set is shared by every build (``pools=``):

- ``alone``: ``--attention-backend B``; ``tbo``: the same with ``--enable-two-batch-overlap`` (eager:
  two children, each on its half of the batch, per layer; graph: the primary, planned for the full
  batch, as sglang captures it); ``hybrid``: prefill = the other backend, decode = B;
- ``eager``: ``init_forward_metadata`` + 32 ``forward`` calls (q/k/v precomputed); ``graph``: the 32
  layer calls captured once per batch size through the backend's graph hooks, then per step the
  replay hook (re-plan outside the graph) + ``CUDAGraph.replay()``;
- median µs per step, timed in interleaved turns (``decode_step_overhead.interleaved``); the ratio
  column is wrapper / alone.

GPU only. Usage: ``python3 benchmarks/wrapper_overhead.py [--backends flashinfer,triton] [--bs 1,8,32]
[--ctx 4096] [--out DIR]`` (writes ``DIR/wrapper_overhead.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline.backends.base import AttentionLayer  # noqa: E402
from pipeline.setup.build import build_attention_backends  # noqa: E402
from pipeline.cli.flags import default_model_path  # noqa: E402
from pipeline.core.contracts import AttentionArgs, ForwardMode, PoolFacts, SetupRequest  # noqa: E402
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch, torch_dtype  # noqa: E402
from pipeline.core.spec import truncate_spec  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402

L, PAGE = 32, 16
OTHER = {"flashinfer": "triton", "triton": "flashinfer", "fa3": "triton"}


def variants(backend: str) -> dict[str, dict]:
    return {"alone": dict(attention_backend=backend),
            "tbo": dict(attention_backend=backend, enable_two_batch_overlap=True, moe_a2a_backend="deepep"),
            "hybrid": dict(prefill_attention_backend=OTHER[backend], decode_attention_backend=backend)}


class GraphStep:
    """The 32 layer calls of one decode batch captured through ``backend``'s graph hooks (attention only)."""

    def __init__(self, backend, fb, q, k, v, layers, max_bs: int) -> None:
        self.backend, self.fb, self.args = backend, fb, (q, k, v)
        self.layers, bs = layers, fb.batch_size
        backend.init_cuda_graph_state(max_bs, max_bs)
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices, fb.seq_lens, None,
                                                         ForwardMode.DECODE, None)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._layers()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._layers()
        self.seq_cpu = torch.tensor(fb.seq_lens_cpu, dtype=torch.int32)

    def _layers(self) -> None:
        q, k, v = self.args
        for layer in self.layers:
            self.backend.forward(q, k, v, layer, self.fb)

    def step(self) -> None:
        fb = self.fb
        self.backend.init_forward_metadata_replay_cuda_graph(fb.batch_size, fb.req_pool_indices, fb.seq_lens,
                                                             sum(fb.seq_lens_cpu), None, ForwardMode.DECODE, None,
                                                             self.seq_cpu)
        self.graph.replay()


def main() -> int:
    import logging

    import structlog
    from decode_step_overhead import interleaved

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # only the table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="flashinfer,triton")
    p.add_argument("--bs", default="1,8,32")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    if not torch.cuda.is_available():
        print("GPU only: torch sees no CUDA device", file=sys.stderr)
        return 1
    bss, ctx = [int(b) for b in ns.bs.split(",")], ns.ctx
    spec = truncate_spec(load_model_spec(default_model_path()), L)
    layers = [AttentionLayer(layer_id=i, num_heads=k.num_heads, num_kv_heads=k.num_kv_heads, head_dim=k.head_dim_qk,
                             v_head_dim=k.head_dim_v, scaling=k.scaling, sliding_window=k.sliding_window,
                             logit_softcap=k.logit_softcap) for k in spec.layer_kinds() for i in k.layer_ids]
    slots = (max(bss) * (-(-ctx // PAGE) + 2) + 1) * PAGE
    pool = PoolFacts(max_reqs=max(bss), max_context_len=ctx + PAGE, num_token_slots=slots, page_size=PAGE)
    pools = {"req_to_token_pool": ReqToTokenPool(pool.max_reqs, pool.max_context_len, "cuda"),
             "kv_pool": KVPool.for_layer_kinds(spec.layer_kinds(), L, slots, PAGE, torch_dtype("bfloat16"), "cuda")}
    for t in pools["kv_pool"].k_buffer + pools["kv_pool"].v_buffer:
        t.normal_()
    alloc = PageAllocator(pools["req_to_token_pool"], slots, PAGE, seed=0)
    for row in range(max(bss)):
        alloc.extend(row, ctx - 1)
    rows = []
    for backend in ns.backends.split(","):
        builds = {}
        for name, kw in variants(backend).items():
            req = SetupRequest(args=AttentionArgs(page_size=PAGE, cuda_graph_bs=bss, **kw), model=spec,
                               device="cuda:0", pool=pool)
            builds[name] = build_attention_backends(req, pools=pools)
        for bs in bss:
            fb = make_forward_batch(ForwardMode.DECODE, list(range(bs)), [1] * bs, alloc, pools["kv_pool"])
            q = torch.randn(bs, 32 * 128, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(bs, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            eager, graph = {}, {}
            for name, out in builds.items():
                top = out.attn_backend

                def step(top=top):
                    top.init_forward_metadata(fb)
                    for layer in layers:
                        top.forward(q, k, v, layer, fb)

                eager[name] = step
                graph[name] = GraphStep(top, fb, q, k, v, layers, max(bss)).step
            e_us, g_us = interleaved(eager), interleaved(graph)
            for name in builds:
                rows.append({"backend": backend, "variant": name, "bs": bs, "ctx": ctx, "layers": L,
                             "eager_us": e_us[name], "graph_us": g_us[name],
                             "eager_ratio": e_us[name] / e_us["alone"], "graph_ratio": g_us[name] / g_us["alone"]})
            for row in range(bs):  # back to ctx-1 cached tokens
                alloc.req_lens[row] -= 1
        for out in builds.values():
            out.close()
    print(f"{L}-layer attention-only decode step (Llama-3.1-8B dims, bf16, ctx {ctx}, page {PAGE}); "
          "µs per step, median of interleaved turns; ratio = variant / alone")
    print(f"{'backend':<11} {'variant':<7} {'bs':>3} {'eager µs':>10} {'ratio':>6} {'graph µs':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['backend']:<11} {r['variant']:<7} {r['bs']:>3} {r['eager_us']:>10.1f} {r['eager_ratio']:>6.3f} "
              f"{r['graph_us']:>10.1f} {r['graph_ratio']:>6.3f}")
    if ns.out:
        os.makedirs(ns.out, exist_ok=True)
        Path(ns.out, "wrapper_overhead.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
