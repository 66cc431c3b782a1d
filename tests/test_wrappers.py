"""TBO and hybrid wrappers: routing/splitting observed per inner backend (spies), outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from pipeline.backends.base import AttentionLayer
from pipeline.backends.hybrid import HybridAttnBackend
from pipeline.backends.tbo import TboAttnBackend, split_batch
from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.core.contracts import ForwardMode, LayerKind
from pipeline.core.errors import BackendClosed, BuildError
from pipeline.backends.memory import KVPool, PageAllocator, ReqToTokenPool, make_forward_batch
from pipeline.runtime.reference import rel_err
from pipeline.runtime.verify import verify_backend
from spies import spy_hybrid, spy_tbo

LAYER = AttentionLayer(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=32, v_head_dim=32, scaling=32 ** -0.5,
                       sliding_window=6, logit_softcap=None, sinks=torch.linspace(-1, 2, 8))


class Recording(TorchNativeBackend):
    """torch_native that remembers every call it served (method, mode, rows) and its closes."""

    def __init__(self, role: str) -> None:
        super().__init__(role=role)
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []
        self.closes = 0
        self.buffer = torch.zeros(4, dtype=torch.uint8)

    def _note(self, method, fb):
        self.calls.append((method, fb.forward_mode.value, tuple(fb.req_pool_indices.tolist())))

    def init_forward_metadata(self, forward_batch):
        self._note("init", forward_batch)
        super().init_forward_metadata(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._note("extend", forward_batch)
        return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._note("decode", forward_batch)
        return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

    def owned_buffers(self):
        return [self.buffer]

    def close(self):
        self.closes += 1
        super().close()


def drive(backend, rows, prefix, new, decode_steps=2, seed=0):
    """Same batches and inputs for any backend on a fresh pool; returns the outputs of every step."""
    r2t = ReqToTokenPool(8, 128, "cpu")
    kv = KVPool(2048, 16, [(2, 32, 32)], torch.float32, "cpu")
    alloc = PageAllocator(r2t, 2048, 16, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    pre = [(r, p) for r, p in zip(rows, prefix) if p]
    steps = ([(ForwardMode.EXTEND, [r for r, _ in pre], [p for _, p in pre])] if pre else [])
    steps += [(ForwardMode.EXTEND, list(rows), list(new))] + [(ForwardMode.DECODE, list(rows), [1] * len(rows))] * decode_steps
    outs = []
    for mode, srows, n in steps:
        fb = make_forward_batch(mode, srows, n, alloc, kv)
        backend.init_forward_metadata(fb)
        t = sum(n)
        q, k, v = (torch.randn(t, 8, 32, generator=gen), torch.randn(t, 2, 32, generator=gen),
                   torch.randn(t, 2, 32, generator=gen))
        outs.append(backend.forward(q, k, v, LAYER, fb))
    return outs


def make_tbo():
    return TboAttnBackend(Recording("primary"), [Recording("tbo_child_0"), Recording("tbo_child_1")])


def test_tbo_output_equals_plain_and_each_child_serves_its_half():
    """B=5: child 0 serves rows 0-2, child 1 rows 3-4, in every extend and decode call."""
    rows, prefix, new = [0, 1, 2, 3, 4], [0, 3, 21, 0, 10], [9, 4, 2, 6, 1]
    tbo = make_tbo()
    journal = spy_tbo(tbo)
    got, want = drive(tbo, rows, prefix, new), drive(TorchNativeBackend(), rows, prefix, new)
    assert all(rel_err(g, w) <= 1e-6 for g, w in zip(got, want))
    c0, c1 = (s.inner for s in tbo.children)
    assert [c for c in c0.calls if c[0] != "init"] == [
        ("extend", "extend", (1, 2)), ("extend", "extend", (0, 1, 2)), ("decode", "decode", (0, 1, 2)),
        ("decode", "decode", (0, 1, 2))]
    assert [c for c in c1.calls if c[0] != "init"] == [
        ("extend", "extend", (4,)), ("extend", "extend", (3, 4)), ("decode", "decode", (3, 4)),
        ("decode", "decode", (3, 4))]
    assert not [c for c in tbo.primary.inner.calls if c[0] != "init"]        # the primary only plans
    fwd = [(c.role, c.forward_mode, c.rows) for c in journal if c.method == "forward"]
    assert fwd[-2:] == [("tbo_child_0", "decode", (0, 1, 2)), ("tbo_child_1", "decode", (3, 4))]
    assert {c.role for c in journal} == {"primary", "tbo_child_0", "tbo_child_1"}


def test_tbo_single_request_goes_to_child_0_only():
    """B=1 → child 0 serves everything, child 1 is never called."""
    tbo = make_tbo()
    journal = spy_tbo(tbo)
    drive(tbo, [5], [4], [3])
    assert tbo.children[0].inner.calls and not tbo.children[1].inner.calls
    assert {c.role for c in journal} == {"primary", "tbo_child_0"}


def test_split_batch_slices_tokens_and_lengths():
    """The sub-batches partition out_cache_loc/positions and carry their own lengths."""
    r2t = ReqToTokenPool(8, 64, "cpu")
    kv = KVPool(512, 4, [(2, 32, 32)], torch.float32, "cpu")
    alloc = PageAllocator(r2t, 512, 4)
    make_forward_batch(ForwardMode.EXTEND, [1], [5], alloc, kv)
    fb = make_forward_batch(ForwardMode.EXTEND, [0, 1, 2], [2, 3, 4], alloc, kv)
    (a, a0, a1), (b, b0, b1) = split_batch(fb)
    assert (a0, a1, b0, b1) == (0, 5, 5, 9)
    assert a.batch_size == 2 and b.batch_size == 1
    assert torch.equal(torch.cat([a.out_cache_loc, b.out_cache_loc]), fb.out_cache_loc)
    assert a.positions.tolist() == [0, 1, 5, 6, 7] and b.positions.tolist() == [0, 1, 2, 3]
    assert a.seq_lens.tolist() == [2, 8] and a.extend_prefix_lens_cpu == [0, 5] and b.extend_seq_lens_cpu == [4]


def test_tbo_buffers_close_and_graph_hooks():
    """owned_buffers/close cover all three instances; graph hooks go to the primary (which refuses);
    after close every member and the wrapper raise BackendClosed."""
    tbo = make_tbo()
    members = [tbo.primary, *tbo.children]
    assert [id(b) for b in tbo.owned_buffers()] == [id(m.buffer) for m in members]
    with pytest.raises(NotImplementedError):
        tbo.init_cuda_graph_state(4, 4)
    tbo.close()
    assert [m.closes for m in members] == [1, 1, 1]
    for b in [tbo, *members]:
        with pytest.raises(BackendClosed) as e:
            b.init_cuda_graph_state(4, 4)
        assert e.value.info.code == "backend_closed" and e.value.exit_code == 1
    with pytest.raises(BuildError):
        TboAttnBackend(Recording("p"), [Recording("c0")])


def test_tbo_passes_verification():
    """The whole TBO wrapper verifies against the float64 reference."""
    kind = LayerKind(kind="sliding", num_heads=8, num_kv_heads=2, head_dim_qk=32, head_dim_v=32,
                     scaling=32 ** -0.5, sliding_window=100, has_sinks=True, layer_ids=[0])
    r2t, kv = ReqToTokenPool(8, 128, "cpu"), KVPool(2048, 16, [(2, 32, 32)], torch.bfloat16, "cpu")
    res = verify_backend(make_tbo(), role="primary", name="torch_native", model=None, req_to_token_pool=r2t,
                         kv_pool=kv, torch_device="cpu", dtype="bfloat16", layer_kinds=[kind])
    assert res.passed and 0 < res.max_rel_err < 1e-2


def test_hybrid_routes_extend_to_prefill_and_decode_to_decode():
    """Two distinct torch_native instances: each gets only its phase; output equals a plain backend."""
    pre, dec = Recording("prefill"), Recording("decode")
    hyb = HybridAttnBackend(pre, dec)
    journal = spy_hybrid(hyb)
    got = drive(hyb, [0, 1, 2], [0, 5, 17], [4, 2, 3])
    want = drive(TorchNativeBackend(), [0, 1, 2], [0, 5, 17], [4, 2, 3])
    assert all(rel_err(g, w) <= 1e-6 for g, w in zip(got, want))
    assert {(m, mode) for m, mode, _ in pre.calls} == {("init", "extend"), ("extend", "extend")}
    assert {(m, mode) for m, mode, _ in dec.calls} == {("init", "decode"), ("decode", "decode")}
    assert [c.role for c in journal if c.method == "forward"] == ["prefill", "prefill", "decode", "decode"]


def test_hybrid_close_once_each_even_if_same_object():
    """close() closes each distinct backend once; buffers counted once for a shared object."""
    a, b = Recording("prefill"), Recording("decode")
    HybridAttnBackend(a, b).close()
    assert (a.closes, b.closes) == (1, 1)
    same = Recording("both")
    hyb = HybridAttnBackend(same, same)
    assert len(hyb.owned_buffers()) == 1
    with pytest.raises(NotImplementedError):
        hyb.init_cuda_graph_state(4, 4)
    hyb.close()
    assert same.closes == 1
    with pytest.raises(BackendClosed):
        hyb.init_cuda_graph_state(4, 4)
