"""Decode step of a 32-layer attention-only stack (Llama-3.1-8B dims, bf16), ctx 4096: CUDA graph vs eager.

The runner builds the stack (QKV projection, RoPE, paged attention through the backend, output
projection, per layer), sizes the pools for bs 64 x 4096 tokens and captures decode graphs for
bs 1/8/64. Each batch size is timed (CUDA events, median of --iters after --warmup) two ways:

- eager: ``init_forward_metadata`` (plan) + the 32 layers launched from Python;
- graph: ``DecodeGraphRunner.replay`` (copy inputs into the graph buffers, the backend's replay
  hook re-plans outside the graph, one ``CUDAGraph.replay()``, output copy).

GPU only. Usage: python3 benchmarks/cuda_graph_decode.py [--backend flashinfer|fa3|triton] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.cli.flags import default_model_path  # noqa: E402
from pipeline.core.contracts import AttentionArgs, ForwardMode, PoolFacts, SetupRequest  # noqa: E402
from pipeline.backends.memory import PageAllocator, make_forward_batch  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402
from pipeline.runtime.runner import Runner, RunnerConfig  # noqa: E402

CTX, BS, PAGE = 4096, [1, 8, 64], 16


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="flashinfer")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if not torch.cuda.is_available():
        print("GPU only: torch sees no CUDA device", file=sys.stderr)
        return 1
    slots = (max(BS) * (CTX // PAGE + 2) + 1) * PAGE
    args = AttentionArgs(attention_backend=ns.backend, page_size=PAGE, cuda_graph_bs=BS)
    req = SetupRequest(args=args, model=load_model_spec(default_model_path()), device="cuda:0",
                       pool=PoolFacts(max_reqs=max(BS), max_context_len=CTX + PAGE, num_token_slots=slots, page_size=PAGE))
    rows = []
    with Runner(RunnerConfig(request=req, num_layers=32), log_file="attn-setup-logs/cuda_graph_decode.jsonl") as r:
        r.initialize()
        kv, stack, backend = r.pools["kv_pool"], r.stack, r.backends.attn_backend
        for t in kv.k_buffer + kv.v_buffer:
            t.normal_()
        alloc = PageAllocator(r.pools["req_to_token_pool"], kv.size, PAGE, seed=0)
        for row in range(max(BS)):
            alloc.extend(row, CTX - 1)
        for bs in BS:
            fb = make_forward_batch(ForwardMode.DECODE, list(range(bs)), [1] * bs, alloc, kv)
            x = torch.randn(bs, stack.hidden, device=kv.device, dtype=stack.dtype)

            def eager():
                backend.init_forward_metadata(fb)
                stack.forward(x, fb, backend)

            e_ms = timed(eager, ns.warmup, ns.iters)
            g_ms = timed(lambda: r.graphs.replay(x, fb), ns.warmup, ns.iters)
            rows.append({"backend": ns.backend, "bs": bs, "ctx": CTX, "layers": 32, "eager_ms": e_ms, "graph_ms": g_ms,
                         "speedup": e_ms / g_ms, "capture_ms": r.graphs.capture_ms[bs]})
            for row in range(bs):   # back to ctx-1 cached tokens for the next batch size
                alloc.req_lens[row] -= 1
    print(f"32-layer attention-only decode step, Llama-3.1-8B dims, bf16, ctx {CTX}, page {PAGE}, {ns.backend}")
    print(f"{'bs':>4} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'capture ms':>11}")
    for x in rows:
        print(f"{x['bs']:>4} {x['eager_ms']:>9.3f} {x['graph_ms']:>9.3f} {x['speedup']:>7.2f}x {x['capture_ms']:>11.1f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
