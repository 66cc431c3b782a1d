"""Eager TBO and hybrid steps make no device→host sync, on a CUDA GPU.

A 2-layer Llama-3.1-8B attention model (one layer with a 64-key window) is built through the
pipeline in TBO mode (flashinfer, triton) and as a hybrid (flashinfer prefill + triton decode, and
the reverse). Extend and decode batches are made first (their H2D copies are the engine's), then the
whole step — ``init_forward_metadata`` and every layer call — runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing torch call
(``.item()``, ``.tolist()``, ``.cpu()``, a blocking copy). Outputs are then checked against float64.

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_hot_path_gpu.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pipeline.backends.base import AttentionLayer  # noqa: E402
from pipeline.setup.build import build_attention_backends  # noqa: E402
from pipeline.cli.flags import default_model_path  # noqa: E402
from pipeline.core.contracts import AttentionArgs, ForwardMode, PoolFacts, SetupRequest  # noqa: E402
from pipeline.backends.memory import PageAllocator, make_forward_batch  # noqa: E402
from pipeline.core.spec import truncate_spec  # noqa: E402
from pipeline.core.model_spec import load_model_spec  # noqa: E402
from pipeline.runtime.reference import reference_attention, rel_err  # noqa: E402

PAGE, DEV = 16, "cuda"
MODES = {
    "tbo-flashinfer": dict(attention_backend="flashinfer", enable_two_batch_overlap=True, moe_a2a_backend="deepep"),
    "tbo-triton": dict(attention_backend="triton", enable_two_batch_overlap=True, moe_a2a_backend="deepep"),
    "hybrid-flashinfer-triton": dict(prefill_attention_backend="flashinfer", decode_attention_backend="triton"),
    "hybrid-triton-flashinfer": dict(prefill_attention_backend="triton", decode_attention_backend="flashinfer"),
}


def spec():
    """Llama-3.1-8B's first two layers, the second made a 64-key sliding layer (windows on the path too)."""
    import msgspec

    m = truncate_spec(load_model_spec(default_model_path()), 2)
    return msgspec.structs.replace(m, layer_types=["full", "sliding"], sliding_window=64)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_eager_steps_make_no_host_sync(mode):
    """Extend (with prefixes) and two decode steps: no synchronizing call in planning or in any layer; outputs match."""
    for mod in ("flashinfer", "triton"):
        if importlib.util.find_spec(mod) is None:
            pytest.fail(f"{mod} must be installed on the GPU machine for this test")
    model = spec()
    req = SetupRequest(args=AttentionArgs(page_size=PAGE, disable_cuda_graph=True, **MODES[mode]), model=model,
                       device="cuda:0", pool=PoolFacts(max_reqs=8, max_context_len=512, num_token_slots=4096,
                                                        page_size=PAGE))
    with build_attention_backends(req) as out:
        top, kv = out.attn_backend, out.pools["kv_pool"]
        layers = [AttentionLayer(layer_id=i, num_heads=k.num_heads, num_kv_heads=k.num_kv_heads, head_dim=k.head_dim_qk,
                                 v_head_dim=k.head_dim_v, scaling=k.scaling, sliding_window=k.sliding_window)
                  for k in model.layer_kinds() for i in k.layer_ids]
        alloc = PageAllocator(out.pools["req_to_token_pool"], kv.size, PAGE, seed=0)
        gen = torch.Generator(device=DEV).manual_seed(0)
        hist: dict = {}
        rows = [0, 1, 2, 3, 4]
        plan = [(ForwardMode.EXTEND, rows[:3], [100, 7, 70]), (ForwardMode.EXTEND, rows, [5, 9, 2, 120, 1]),
                (ForwardMode.DECODE, rows, [1] * 5), (ForwardMode.DECODE, rows, [1] * 5)]
        for step, (fmode, srows, new) in enumerate(plan):
            fb = make_forward_batch(fmode, srows, new, alloc, kv)
            t = sum(new)
            qkv = [(torch.randn(t, L.num_heads, L.head_dim, generator=gen, device=DEV, dtype=torch.bfloat16),
                    torch.randn(t, L.num_kv_heads, L.head_dim, generator=gen, device=DEV, dtype=torch.bfloat16),
                    torch.randn(t, L.num_kv_heads, L.v_head_dim, generator=gen, device=DEV, dtype=torch.bfloat16))
                   for L in layers]
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                top.init_forward_metadata(fb)
                outs = [top.forward(q, k, v, L, fb) for L, (q, k, v) in zip(layers, qkv)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for L, (q, k, v), o in zip(layers, qkv, outs):
                o = o.view(t, L.num_heads, L.v_head_dim)
                off = 0
                for r, n in zip(srows, new):
                    ks, vs = hist.setdefault((L.layer_id, r), ([], []))
                    ks.append(k[off:off + n].double())
                    vs.append(v[off:off + n].double())
                    kk, vv = torch.cat(ks), torch.cat(vs)
                    ref = reference_attention(q[off:off + n], kk, vv, q_positions=torch.arange(len(kk) - n, len(kk)),
                                              scale=L.scaling, window=L.sliding_window)
                    assert rel_err(o[off:off + n], ref) <= 1e-2, (mode, step, L.layer_id, r)
                    off += n
