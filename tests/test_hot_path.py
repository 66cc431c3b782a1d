"""Nothing instruments the per-layer path, shown on CPU.

The batch's device tensors (``req_pool_indices``, ``seq_lens``, ``out_cache_loc``, ``positions``,
``extend_*_lens``) are wrapped in :class:`NoHostRead`, a tensor subclass that — once armed — fails on
every host read (``tolist``, ``item``, ``cpu``, ``numpy``, ``int()``/``bool()``/``float()``, ``.to("cpu")``).
Planning (``init_forward_metadata``) runs unarmed; every layer call runs armed. On a GPU each such read
would be a device→host sync per layer (tests/gpu/test_hot_path_gpu.py checks the same under
``torch.cuda.set_sync_debug_mode("error")``). The wrappers also keep no state that grows with calls.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import fake_flashinfer
from fi_reference import Scenario, make_kind, make_layer
from pipeline.backends import registry
from pipeline.backends.hybrid import HybridAttnBackend
from pipeline.backends.tbo import TboAttnBackend
from pipeline.core.contracts import ForwardMode
from spies import spy_tbo

KINDS = [make_kind(8, 2, 16, layer_ids=(0,)), make_kind(8, 2, 16, window=5, softcap=3.0, layer_ids=(1,)),
         make_kind(8, 2, 16, sinks=True, layer_ids=(2,))]
_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
          torch.Tensor.__index__, torch.Tensor.__bool__, torch.Tensor.__float__}
_FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_prefix_lens", "extend_seq_lens")


class NoHostRead(torch.Tensor):
    """A tensor that refuses host reads while :attr:`armed` (a device→host sync on a GPU)."""

    armed = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if cls.armed and (func in _READS or (func is torch.Tensor.to and "cpu" in repr((args[1:], kwargs)))):
            raise AssertionError(f"host read {getattr(func, '__name__', func)} of a batch tensor in the per-layer path")
        return super().__torch_function__(func, types, args, kwargs)


def guarded(fb):
    return dataclasses.replace(fb, **{f: getattr(fb, f).as_subclass(NoHostRead) for f in _FIELDS
                                      if getattr(fb, f) is not None})


@pytest.fixture
def fib(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    from pipeline.backends.flashinfer import backend as mod

    monkeypatch.setattr(mod, "ensure_compiled", lambda v, **kw: {"variant": v.name, "status": "cached", "seconds": 0})
    return mod


def make(name: str, request, roles):
    """Scenario plus one instance per role, each made by the registry factory for KINDS."""
    fi = name in ("flashinfer", "fa3")
    if fi:
        request.getfixturevalue("fib")
    dtype = torch.float32 if name == "torch_native" else torch.bfloat16
    if name == "triton" and torch.cuda.is_available():
        pytest.skip("CUDA present: triton runs compiled there (tests/gpu/test_hot_path_gpu.py)")
    sc = Scenario(KINDS, device="cpu", dtype=dtype, page_size=4, max_reqs=8,
                  max_context_len=64, ws_bytes=1 << 20, name=name, sm_count=4, facts_type="cuda" if fi else "cpu")
    factory = registry.get(name).load_factory()
    return sc, [factory(dataclasses.replace(sc.ctx, role=r)) for r in roles]


def steps(sc, backend, n_decode=2):
    """Extend with prefixes, then decode steps, every layer, layer calls armed; returns the outputs."""
    layers = [make_layer(k, k.layer_ids[0], torch.linspace(-1, 1, 8) if k.has_sinks else None) for k in KINDS]
    sc.fill_prefix([0, 2], [5, 9])
    plan = [(ForwardMode.EXTEND, [0, 1, 2], [3, 6, 2])] + [(ForwardMode.DECODE, [0, 1, 2], [1, 1, 1])] * n_decode
    outs = []
    for mode, reqs, new in plan:
        fb = guarded(sc.batch(mode, reqs, new))
        backend.init_forward_metadata(fb)
        t = sum(new)
        NoHostRead.armed = True
        try:
            for layer in layers:
                outs.append(backend.forward(sc.randn(t, 8, 16), sc.randn(t, 2, 16), sc.randn(t, 2, 16), layer, fb))
        finally:
            NoHostRead.armed = False
    return outs


@pytest.mark.parametrize("name", ["torch_native", "flashinfer"])
def test_tbo_layers_read_nothing_from_the_batch_tensors(name, request):
    """TBO over three instances: every layer call of extend and decode steps, no host read, finite outputs."""
    sc, (p, c0, c1) = make(name, request, ["tbo.primary", "tbo.child0", "tbo.child1"])
    outs = steps(sc, TboAttnBackend(p, [c0, c1]))
    assert outs and all(torch.isfinite(o.float()).all() for o in outs)


@pytest.mark.parametrize("prefill,decode", [("torch_native", "torch_native"), ("flashinfer", "torch_native")])
def test_hybrid_layers_read_nothing_from_the_batch_tensors(prefill, decode, request):
    """A hybrid routes extend and decode layers without reading the batch on the host."""
    sc, (pre,) = make(prefill, request, ["primary.prefill"])
    dec = registry.get(decode).load_factory()(dataclasses.replace(sc.ctx, name=decode, role="primary.decode"))
    outs = steps(sc, HybridAttnBackend(pre, dec))
    assert outs and all(torch.isfinite(o.float()).all() for o in outs)


def test_the_detector_catches_a_per_layer_read(request):
    """Control: an inner backend that reads the rows per layer (the old call log did) is caught."""
    sc, (p, c0, c1) = make("torch_native", request, ["tbo.primary", "tbo.child0", "tbo.child1"])
    tbo = TboAttnBackend(p, [c0, c1])
    spy_tbo(tbo)  # the test spy reads req_pool_indices.tolist() on every call
    with pytest.raises(AssertionError, match="host read tolist"):
        steps(sc, tbo)


def test_wrapper_state_does_not_grow_with_steps(request):
    """TBO and hybrid hold the same attributes, each of the same size, after 1 and after 5 decode steps."""
    def sizes(obj):
        return {k: len(v) if hasattr(v, "__len__") else None for k, v in vars(obj).items()}

    for wrap in ("tbo", "hybrid"):
        seen = []
        for n in (1, 5):
            sc, (a, b, c) = make("torch_native", request, ["x", "y", "z"])
            w = TboAttnBackend(a, [b, c]) if wrap == "tbo" else HybridAttnBackend(a, b)
            steps(sc, w, n_decode=n)
            seen.append(sizes(w))
        assert seen[0] == seen[1], (wrap, seen)


def test_unplanned_batch_is_planned_once_not_per_layer(request, monkeypatch):
    """torch_native called without init_forward_metadata reads the batch layout once for all its layers."""
    from pipeline.backends import torch_native

    calls = []
    orig = torch_native.batch_layout
    monkeypatch.setattr(torch_native, "batch_layout", lambda fb: (calls.append(fb), orig(fb))[1])
    sc, (be,) = make("torch_native", request, ["primary"])
    fb = sc.batch(ForwardMode.EXTEND, [0, 1], [4, 2])
    for k in KINDS:
        layer = make_layer(k, k.layer_ids[0], torch.linspace(-1, 1, 8) if k.has_sinks else None)
        be.forward(sc.randn(6, 8, 16), sc.randn(6, 2, 16), sc.randn(6, 2, 16), layer, fb)
    assert calls == [fb]


def test_triton_unplanned_extend_is_planned_once_and_never_stale(request, monkeypatch):
    """After a planned extend batch, an unplanned one gets its own metadata (once, for all layers), not the old one."""
    from pipeline.backends.torch_native import TorchNativeBackend
    from pipeline.backends.triton.backend import TritonAttnBackend
    from pipeline.runtime.reference import rel_err

    sc, (be,) = make("triton", request, ["primary"])
    metas = []
    orig = TritonAttnBackend._extend_meta
    monkeypatch.setattr(TritonAttnBackend, "_extend_meta", lambda self, fb: (metas.append(fb), orig(self, fb))[1])
    layers = [make_layer(k, k.layer_ids[0], torch.linspace(-1, 1, 8) if k.has_sinks else None) for k in KINDS]
    be.init_forward_metadata(sc.batch(ForwardMode.EXTEND, [0, 1], [5, 3]))
    fb = sc.batch(ForwardMode.EXTEND, [2, 0, 3], [4, 2, 7])  # new lengths, not planned
    ref = TorchNativeBackend()
    for layer in layers:
        q, k, v = sc.randn(13, 8, 16), sc.randn(13, 2, 16), sc.randn(13, 2, 16)
        out = be.forward(q, k, v, layer, fb)
        assert rel_err(out, ref.forward(q, None, None, layer, fb, save_kv_cache=False)) <= 1e-2
    assert len(metas) == 2 and metas[1] is fb
