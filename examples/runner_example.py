"""The runner used from code: initialize() a 2-layer Llama attention stack, then one extend + one decode.

Runs on CPU (graph capture is skipped with its reason) and on a GPU (decode replayed from a graph).
    python examples/runner_example.py [cpu|cuda]
"""
import logging
import sys

import structlog
import torch

from pipeline import AttentionArgs, SetupRequest, load_model_spec
from pipeline.core.contracts import ForwardMode, PoolFacts
from pipeline.backends.memory import PageAllocator, make_forward_batch
from pipeline.runtime.model import reference_forward
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG
from pipeline.runtime.runner import Runner, RunnerConfig

# the application decides what the library's events print: errors only here (the trace file keeps every event)
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
request = SetupRequest(args=AttentionArgs(cuda_graph_bs=[1, 2]), model=load_model_spec(DEFAULT_MODEL_CONFIG),
                       device=device, pool=PoolFacts(max_reqs=4, max_context_len=128, num_token_slots=512))
with Runner(RunnerConfig(request=request, num_layers=2), log_file="attn-setup-logs/runner_example.jsonl") as runner:
    runner.initialize()                                   # init-distributed … capture-cuda-graphs → ready
    print("backends:", runner.backends.prefill_attention_backend_str, "/", runner.backends.decode_attention_backend_str,
          "| skipped:", "; ".join(f"{s.what} ({s.reason})" for s in runner.backends.skips) or "nothing")
    pools, stack = runner.pools, runner.stack
    alloc = PageAllocator(pools["req_to_token_pool"], pools["kv_pool"].size, 1)
    xs = torch.randn(7, stack.hidden).to(pools["kv_pool"].device, stack.dtype)
    ys = []
    for mode, x in ((ForwardMode.EXTEND, xs[:6]), (ForwardMode.DECODE, xs[6:])):   # one request (row 0)
        fb = make_forward_batch(mode, [0], [x.shape[0]], alloc, pools["kv_pool"])
        y, _, graphed = runner.forward(x, fb)
        ys.append(y)
        print(f"{mode.value}: {x.shape[0]} token(s), replayed from a CUDA graph: {graphed}")
    ref, _ = reference_forward(stack, xs)
    d_out, d_ref = torch.cat(ys).double().cpu() - xs.double().cpu(), ref - xs.double().cpu()
    print(f"max|out-ref|/max|ref| of the layers' update: {float((d_out - d_ref).abs().max() / d_ref.abs().max()):.2e}")
    print("runner state:", runner.state.value, "| log:", runner.log.path)
