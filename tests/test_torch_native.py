"""torch_native over the paged KV cache vs the float64 reference; the reference vs hand math."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pipeline.backends.base import AttentionLayer
from pipeline.backends.torch_native import TorchNativeBackend, create
from pipeline.core.contracts import ForwardMode
from pipeline.core.errors import BuildError
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.runtime.reference import reference_attention, rel_err

PREFIX = (0, 5, 19, 0)
NEW = (7, 3, 2, 1)


def run_steps(backend, layer: AttentionLayer, *, page_size=16, kv_dtype=torch.float32, q_dtype=torch.float32,
              decode_steps=2, seed=0, device="cpu", q_gain=1.0):
    """Prefix extend, extend, decode steps through ``backend``; returns every per-request rel. error."""
    rows = list(range(len(PREFIX)))
    r2t = ReqToTokenPool(8, 160, device)
    kv = KVPool(64 * 64, page_size, [(layer.num_kv_heads, layer.head_dim, layer.v_head_dim)], kv_dtype, device)
    alloc = PageAllocator(r2t, 64 * 64, page_size, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    hist = {r: ([], []) for r in rows}
    pre = [(r, p) for r, p in zip(rows, PREFIX) if p]
    steps = [(ForwardMode.EXTEND, [r for r, _ in pre], [p for _, p in pre]), (ForwardMode.EXTEND, rows, list(NEW))]
    steps += [(ForwardMode.DECODE, rows, [1] * len(rows))] * decode_steps
    errs = []
    for mode, srows, new in steps:
        fb = make_forward_batch(mode, srows, new, alloc, kv)
        backend.init_forward_metadata(fb)
        t = sum(new)
        q = (torch.randn(t, layer.num_heads, layer.head_dim, generator=gen) * q_gain).to(q_dtype).to(device)
        k = torch.randn(t, layer.num_kv_heads, layer.head_dim, generator=gen).to(q_dtype).to(device)
        v = (k[..., : layer.v_head_dim].clone() if layer.is_mla else
             torch.randn(t, layer.num_kv_heads, layer.v_head_dim, generator=gen).to(q_dtype).to(device))
        out = backend.forward(q, k, v, layer, fb).reshape(t, layer.num_heads, layer.v_head_dim)
        assert out.dtype == q_dtype
        start = 0
        for r, n in zip(srows, new):
            sl = slice(start, start + n)
            hist[r][0].append(k[sl].to(kv_dtype).double().cpu())
            hist[r][1].append(v[sl].to(kv_dtype).double().cpu())
            kk, vv = torch.cat(hist[r][0]), torch.cat(hist[r][1])
            ref = reference_attention(q[sl].cpu(), kk, vv, q_positions=torch.arange(len(kk) - n, len(kk)),
                                      scale=layer.scaling, window=layer.sliding_window, softcap=layer.logit_softcap,
                                      sinks=None if layer.sinks is None else layer.sinks.cpu(),
                                      chunk=layer.attention_chunk_size)
            errs.append(rel_err(out[sl].cpu(), ref))
            start += n
    return errs


def mk_layer(h=8, hkv=2, d=64, dv=None, **kw) -> AttentionLayer:
    dv = d if dv is None else dv
    return AttentionLayer(layer_id=0, num_heads=h, num_kv_heads=hkv, head_dim=d, v_head_dim=dv,
                          scaling=d ** -0.5, **kw)


# ---------------------------------------------------------------- reference vs hand-written math

def test_reference_two_keys_by_hand():
    """One query, two keys, D=1: softmax([1, 2]) weights the values 10 and 20."""
    q = torch.tensor([[[1.0]]]); k = torch.tensor([[[1.0]], [[2.0]]]); v = torch.tensor([[[10.0]], [[20.0]]])
    out = reference_attention(q, k, v, q_positions=torch.tensor([1]), scale=1.0)
    want = (10 * math.e + 20 * math.e ** 2) / (math.e + math.e ** 2)
    assert out.dtype == torch.float64 and abs(out.item() - want) < 1e-12


def test_reference_sink_softcap_window_by_hand():
    """A sink adds exp(s) to the denominator; softcap tanh-squashes; window=1 sees only itself."""
    q = torch.tensor([[[1.0]]]); k = torch.tensor([[[1.0]], [[2.0]]]); v = torch.tensor([[[10.0]], [[20.0]]])
    pos = torch.tensor([1])
    sink = reference_attention(q, k, v, q_positions=pos, scale=1.0, sinks=torch.tensor([0.5]))
    assert abs(sink.item() - (10 * math.e + 20 * math.e ** 2) / (math.e + math.e ** 2 + math.exp(0.5))) < 1e-12
    cap = reference_attention(q, k, v, q_positions=pos, scale=1.0, softcap=1.0)
    a, b = math.exp(math.tanh(1.0)), math.exp(math.tanh(2.0))
    assert abs(cap.item() - (10 * a + 20 * b) / (a + b)) < 1e-12
    win = reference_attention(q, k, v, q_positions=pos, scale=1.0, window=1)
    assert win.item() == 20.0


def test_reference_gqa_head_mapping():
    """q=0 gives uniform weights: head h averages the visible values of kv head h // 2."""
    v = torch.tensor([[[1.0], [100.0]], [[3.0], [300.0]], [[5.0], [500.0]]])     # [L=3, Hkv=2, 1]
    k = torch.zeros(3, 2, 4)
    out = reference_attention(torch.zeros(1, 4, 4), k, v, q_positions=torch.tensor([1]), scale=1.0)
    assert out[0, :, 0].tolist() == [2.0, 2.0, 200.0, 200.0]


def test_reference_chunk_by_hand():
    """Chunked local attention: chunk 2 at position 1 sees keys 0 and 1, at position 2 only key 2; chunk 1
    sees only the query itself."""
    k, v = torch.zeros(3, 1, 1), torch.tensor([[[10.0]], [[20.0]], [[40.0]]])
    q = torch.zeros(2, 1, 1)  # equal scores: the output is the mean of the visible values
    out = reference_attention(q, k, v, q_positions=torch.tensor([1, 2]), scale=1.0, chunk=2)
    assert out[:, 0, 0].tolist() == [15.0, 40.0]
    one = reference_attention(q, k, v, q_positions=torch.tensor([1, 2]), scale=1.0, chunk=1)
    assert one[:, 0, 0].tolist() == [20.0, 40.0]


def naive(q, k, v, pos, scale, window, softcap, sinks, chunk=None):
    """Pure-Python loops, one (query, head) at a time."""
    tq, h, _ = q.shape
    g = h // k.shape[1]
    out = [[[0.0] * v.shape[2] for _ in range(h)] for _ in range(tq)]
    for i in range(tq):
        for hh in range(h):
            logits = {}
            for j in range(k.shape[0]):
                if 0 <= pos[i] - j and (window is None or pos[i] - j < window) and (
                        chunk is None or pos[i] // chunk == j // chunk):
                    s = sum(a * b for a, b in zip(q[i, hh].tolist(), k[j, hh // g].tolist())) * scale
                    logits[j] = softcap * math.tanh(s / softcap) if softcap else s
            m = max(logits.values())
            den = sum(math.exp(x - m) for x in logits.values()) + (math.exp(sinks[hh] - m) if sinks else 0.0)
            for j, x in logits.items():
                for c in range(v.shape[2]):
                    out[i][hh][c] += math.exp(x - m) / den * float(v[j, hh // g, c])
    return torch.tensor(out, dtype=torch.float64)


def test_reference_matches_python_loops():
    """Window + softcap + sinks + GQA against an independent loop implementation."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, 5, generator=g), torch.randn(9, 2, 5, generator=g), torch.randn(9, 2, 3, generator=g)
    pos, sinks = [6, 7, 8], [0.3, -1.0, 2.0, 0.0]
    got = reference_attention(q, k, v, q_positions=torch.tensor(pos), scale=0.7, window=4, softcap=2.0,
                              sinks=torch.tensor(sinks, dtype=torch.float64))
    assert rel_err(got, naive(q, k, v, pos, 0.7, 4, 2.0, sinks)) < 1e-12
    for window, chunk in ((None, 3), (2, 4)):   # chunk boundaries at 6 and 8 fall among the queries
        got = reference_attention(q, k, v, q_positions=torch.tensor(pos), scale=0.7, window=window, softcap=2.0,
                                  sinks=torch.tensor(sinks, dtype=torch.float64), chunk=chunk)
        assert rel_err(got, naive(q, k, v, pos, 0.7, window, 2.0, sinks, chunk)) < 1e-12


# ---------------------------------------------------------------- torch_native vs reference

@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_page_sizes_fp32(page_size, group):
    """Full attention, GQA ratios 1/4/8, page sizes 1/16/64, fp32: rel. error < 1e-5."""
    errs = run_steps(TorchNativeBackend(), mk_layer(h=2 * group, hkv=2), page_size=page_size)
    assert len(errs) == 2 + 4 + 2 * 4 and max(errs) < 1e-5


LAYERS = {
    "window": dict(sliding_window=5),
    "softcap": dict(logit_softcap=30.0),
    "sinks": dict(sinks=torch.tensor([2.0, 0.5, -1.0, 3.0, 1.0, 2.5, 0.0, 1.5])),
    "window+softcap": dict(sliding_window=4, logit_softcap=30.0),
    "window+sinks": dict(sliding_window=3, sinks=torch.full((8,), 2.0)),
    "chunked": dict(attention_chunk_size=6),
    "chunked+sinks": dict(attention_chunk_size=4, sinks=torch.full((8,), 1.0)),
    "chunked+window": dict(attention_chunk_size=8, sliding_window=5),
}


@pytest.mark.parametrize("feature", sorted(LAYERS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_features(feature, dtype, tol):
    """Window / softcap (scores scaled to reach the cap) / sinks, fp32 and bf16 KV + q."""
    gain = 30.0 if "softcap" in feature else 1.0
    errs = run_steps(TorchNativeBackend(), mk_layer(**LAYERS[feature]), page_size=16, kv_dtype=dtype, q_dtype=dtype,
                     q_gain=gain)
    assert max(errs) < tol


def test_softcap_changes_output():
    """The softcap case above would fail if the cap were ignored (guards the test's own power)."""
    layer = mk_layer(logit_softcap=30.0)
    errs = run_steps(TorchNativeBackend(), replace(layer, logit_softcap=None), q_gain=30.0)
    bad = run_steps(_NoCapInReference(), layer, q_gain=30.0)
    assert max(errs) < 1e-5 and max(bad) > 0.1


def test_chunk_changes_output():
    """The chunked case would fail if the chunk were ignored (guards the test's own power)."""
    bad = run_steps(_NoChunk(), mk_layer(attention_chunk_size=6))
    assert max(bad) > 0.1


class _NoChunk(TorchNativeBackend):
    """Computes without the chunk while the reference applies it."""

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_extend(q, k, v, replace(layer, attention_chunk_size=None), fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_decode(q, k, v, replace(layer, attention_chunk_size=None), fb, save_kv_cache)


class _NoCapInReference(TorchNativeBackend):
    """Computes without the cap while the reference applies it."""

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_extend(q, k, v, replace(layer, logit_softcap=None), fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_decode(q, k, v, replace(layer, logit_softcap=None), fb, save_kv_cache)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_mla_absorbed(page_size, dtype, tol):
    """MLA absorbed: 1 latent kv head, D=576, Dv=512 (v = first 512 dims of k)."""
    layer = AttentionLayer(layer_id=0, num_heads=4, num_kv_heads=1, head_dim=576, v_head_dim=512,
                           scaling=192 ** -0.5, is_mla=True)
    assert max(run_steps(TorchNativeBackend(), layer, page_size=page_size, kv_dtype=dtype, q_dtype=dtype)) < tol


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fp8_kv(kv_dtype, q_dtype, tol):
    """fp8 KV storage, upcast on read; reference sees the same fp8-rounded K/V."""
    errs = run_steps(TorchNativeBackend(), mk_layer(sliding_window=6), page_size=16, kv_dtype=kv_dtype,
                     q_dtype=q_dtype)
    assert max(errs) < tol


def _one_batch(layer, page_size=16):
    r2t = ReqToTokenPool(4, 64, "cpu")
    kv = KVPool(512, page_size, [(layer.num_kv_heads, layer.head_dim, layer.v_head_dim)], torch.float32, "cpu")
    fb = make_forward_batch(ForwardMode.EXTEND, [0, 1], [3, 2], PageAllocator(r2t, 512, page_size), kv)
    return fb, kv


def test_without_save_kv_cache_reads_the_cache():
    """save_kv_cache=False with K/V written earlier gives the same output as saving now."""
    layer = mk_layer()
    fb, kv = _one_batch(layer)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 8, 64, generator=g), torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g))
    a = TorchNativeBackend().forward(q, k, v, layer, fb)
    b = TorchNativeBackend().forward(q, None, None, layer, fb, save_kv_cache=False)
    assert torch.equal(a, b) and a.shape == (5, 8 * 64)


@pytest.mark.parametrize("field,mutate", [
    ("q.shape", lambda q, k, v, L: (q[:, :4], k, v, L)),
    ("k.shape", lambda q, k, v, L: (q, None, v, L)),
    ("v.shape", lambda q, k, v, L: (q, k, v[..., :32], L)),
    ("q.dtype", lambda q, k, v, L: (q.to(torch.int32), k, v, L)),
    ("layer.num_kv_heads", lambda q, k, v, L: (q, k, v, replace(L, num_kv_heads=3))),
    ("kv_pool.buffer_shape", lambda q, k, v, L: (q, k, v, replace(L, head_dim=32, v_head_dim=32))),
    ("layer.sinks.shape", lambda q, k, v, L: (q, k, v, replace(L, sinks=torch.zeros(3)))),
    ("layer.sliding_window", lambda q, k, v, L: (q, k, v, replace(L, sliding_window=0))),
    ("layer.attention_chunk_size", lambda q, k, v, L: (q, k, v, replace(L, attention_chunk_size=0))),
])
def test_bad_inputs_raise_before_writing(field, mutate):
    """Each mismatch raises BuildError naming the field, and the KV cache is left untouched."""
    layer = mk_layer()
    fb, kv = _one_batch(layer)
    q, k, v = torch.randn(5, 8, 64), torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    q, k, v, layer = mutate(q, k, v, layer)
    with pytest.raises(BuildError) as ei:
        TorchNativeBackend().forward(q, k, v, layer, fb)
    assert ei.value.info.code == "forward_input_invalid" and ei.value.info.flags[0].name == field
    assert ei.value.info.allowed and ei.value.info.remedy
    assert not kv.k_buffer[0].any()


def test_no_cuda_graphs_and_factory():
    """The registry factory builds it for the context's layer kinds; CUDA-graph hooks refuse."""
    from types import SimpleNamespace

    from pipeline.backends import registry
    from pipeline.core.contracts import LayerKind

    kinds = [LayerKind(kind="full", num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=8, scaling=0.5,
                       layer_ids=[0, 1])]
    ctx = SimpleNamespace(torch_device="cpu", role="tbo_child_1", layer_kinds=kinds)
    backend = registry.get("torch_native").load_factory()(ctx)
    assert isinstance(backend, TorchNativeBackend) and backend.role == "tbo_child_1"
    assert backend.planned.kinds == kinds and sorted(backend.planned.by_id) == [0, 1]
    assert isinstance(create(SimpleNamespace(torch_device="cpu", role="p", layer_kinds=kinds)), TorchNativeBackend)
    with pytest.raises(NotImplementedError):
        backend.init_cuda_graph_state(8, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype,q_dtype,tol", [(torch.float32, torch.float32, 1e-4),
                                                  (torch.bfloat16, torch.bfloat16, 1e-2),
                                                  (torch.float8_e4m3fn, torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("feature", ["plain", "window+softcap", "window+sinks"])
def test_cuda(kv_dtype, q_dtype, tol, feature):
    """Same checks on CUDA (SDPA path and explicit-math path)."""
    kw = {} if feature == "plain" else dict(LAYERS[feature])
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].cuda()
    errs = run_steps(TorchNativeBackend(torch_device="cuda"), mk_layer(**kw), kv_dtype=kv_dtype, q_dtype=q_dtype,
                     device="cuda", q_gain=30.0 if "softcap" in feature else 1.0)
    assert max(errs) < tol
