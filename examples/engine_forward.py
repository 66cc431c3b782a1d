"""An engine's forward call: build the backends, take a layer from the ModelSpec, run one extend and one decode step.

    python examples/engine_forward.py            # torch_native on this CPU
    python examples/engine_forward.py hybrid     # a hybrid pair on this CPU: Triton prefill + torch_native decode,
                                                 # planned for an H200 (the h200 profile), Triton interpreted on CPU

Prints the max relative error of each step against a float64 reference computed here (plain softmax attention).
"""
import os
import sys

if len(sys.argv) > 1 and sys.argv[1] == "hybrid":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on CPU tensors

import msgspec
import torch

from pipeline import AttentionArgs, SetupRequest, build_attention_backends, load_model_spec
from pipeline.backends.base import attention_layers
from pipeline.backends.memory import PageAllocator, make_forward_batch
from pipeline.core.contracts import ForwardMode, PoolFacts
from pipeline.core.model_spec import DEFAULT_MODEL_CONFIG


def reference(q, k, v, layer, causal_from):
    """float64 attention of q [T, H, D] over k/v [S, Hkv, D]; query i sees keys 0..causal_from + i (GQA shared)."""
    g = layer.num_heads // layer.num_kv_heads
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("thd,shd->hts", q.double(), k) * layer.scaling
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > causal_from + torch.arange(q.shape[0])[:, None], -torch.inf)
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def main(hybrid: bool = False) -> dict[str, float]:
    spec = load_model_spec(DEFAULT_MODEL_CONFIG)
    args = (AttentionArgs(prefill_attention_backend="triton", decode_attention_backend="torch_native") if hybrid
            else AttentionArgs())
    request = SetupRequest(args=args, model=spec, device="cuda:0" if hybrid else "cpu",
                           pool=PoolFacts(max_reqs=2, max_context_len=64, num_token_slots=128))
    platform = None
    if hybrid:  # decide for an H200, build on this CPU (what the tests' matrix does for the Triton cells)
        from pipeline.platforms.profiles import PROFILES
        from pipeline.testing import FakePlatform

        platform = FakePlatform(msgspec.structs.replace(PROFILES["h200"], sm_count=4), "cpu")
    errs = {}
    with build_attention_backends(request, platform=platform) as out:
        backend, kv = out.attn_backend, out.pools["kv_pool"]  # pools built from request.pool (or pass your own)
        layer = attention_layers(spec)[0]  # AttentionLayer.from_kind for every layer of spec.layer_kinds()
        alloc = PageAllocator(out.pools["req_to_token_pool"], kv.size, request.args.page_size)
        hist = {0: [], 1: []}  # each request's K/V so far, for the reference
        torch.manual_seed(0)
        for mode, new in ((ForwardMode.EXTEND, [5, 3]), (ForwardMode.DECODE, [1, 1])):
            fb = make_forward_batch(mode, [0, 1], new, alloc, kv)  # slots allocated, req_to_token filled
            t = fb.num_tokens
            q = torch.randn(t, layer.num_heads * layer.head_dim, dtype=kv.dtype)  # the model dtype (bfloat16)
            k = torch.randn(t, layer.num_kv_heads, layer.head_dim, dtype=kv.dtype)
            v = torch.randn(t, layer.num_kv_heads, layer.v_head_dim, dtype=kv.dtype)
            backend.init_forward_metadata(fb)  # once per batch, before the layers
            o = backend.forward(q, k, v, layer, fb)  # writes K/V at fb.out_cache_loc, returns [T, H*Dv]
            refs, start = [], 0
            for r, n in zip((0, 1), new):
                hist[r].append((k[start:start + n], v[start:start + n]))
                ks, vs = torch.cat([x for x, _ in hist[r]]), torch.cat([y for _, y in hist[r]])
                qr = q[start:start + n].view(n, layer.num_heads, layer.head_dim)
                refs.append(reference(qr, ks, vs, layer, ks.shape[0] - n))
                start += n
            ref = torch.cat(refs).reshape(t, -1)
            errs[mode.value] = float((o.double() - ref).abs().max() / ref.abs().max())
        print(f"backends: prefill={out.prefill_attention_backend_str} decode={out.decode_attention_backend_str}")
    for step, err in errs.items():
        print(f"{step}: max|out-ref|/max|ref| = {err:.2e}")
    return errs


if __name__ == "__main__":
    main(hybrid=len(sys.argv) > 1 and sys.argv[1] == "hybrid")
