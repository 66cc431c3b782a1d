"""Backends compute only with the layers they were built for, checked once per layer.

Every backend available on CPU — torch_native, triton under ``TRITON_INTERPRET=1``, flashinfer and fa3
through tests/fake_flashinfer.py — is built by its registry factory for a set of layer kinds and
called with a layer that differs in one field of :data:`pipeline.backends.base.LAYER_FIELDS`: each
raises ``LayerMismatch`` naming the layer id, the field, the call's and the built value, before any
K/V is written. A spy on :func:`pipeline.backends.base.check_layer` shows the comparison runs once per
layer object, not per call.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import fake_flashinfer
from fi_reference import Scenario, make_kind, make_layer
from pipeline.backends import base, registry
from pipeline.backends.base import LAYER_FIELDS, PlannedLayers
from pipeline.core.contracts import ForwardMode
from pipeline.core.errors import LayerMismatch

ON_GPU = torch.cuda.is_available()
# layer 0 full, layer 1 sliding window 5 with softcap 3, layer 2 full with sinks; D = Dv = 16, GQA 4
KINDS = [make_kind(8, 2, 16, layer_ids=(0,)), make_kind(8, 2, 16, window=5, softcap=3.0, layer_ids=(1,)),
         make_kind(8, 2, 16, sinks=True, layer_ids=(2,))]
SINKS = torch.linspace(-1.0, 1.0, 8)

# (case id, layer id, field changed, change) — every row of LAYER_FIELDS, in both directions where it has two
MUTATIONS = [
    ("num_heads", 0, "num_heads", dict(num_heads=16)),
    ("num_kv_heads", 0, "num_kv_heads", dict(num_kv_heads=4)),
    ("head_dim", 0, "head_dim", dict(head_dim=32)),
    ("v_head_dim", 0, "v_head_dim", dict(v_head_dim=32)),
    ("is_mla", 0, "is_mla", dict(is_mla=True)),
    ("scaling", 0, "scaling", dict(scaling=0.5)),
    ("window-added", 0, "sliding_window", dict(sliding_window=5)),
    ("window-changed", 1, "sliding_window", dict(sliding_window=7)),
    ("window-dropped", 1, "sliding_window", dict(sliding_window=None)),
    ("softcap-added", 0, "logit_softcap", dict(logit_softcap=3.0)),
    ("softcap-dropped", 1, "logit_softcap", dict(logit_softcap=None)),
    ("sinks-added", 0, "sinks", dict(sinks=SINKS)),
    ("sinks-dropped", 2, "sinks", dict(sinks=None)),
    ("chunk-added", 0, "attention_chunk_size", dict(attention_chunk_size=8)),
]


def test_mutations_cover_every_compared_field():
    """The table above changes every field the check compares."""
    assert {m[2] for m in MUTATIONS} == {f.name for f in LAYER_FIELDS}


@pytest.fixture
def fib(monkeypatch):
    """The flashinfer backend module over the fake FlashInfer API, JIT checks stubbed out."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    from pipeline.backends.flashinfer import backend as mod

    monkeypatch.setattr(mod, "ensure_compiled", lambda v, **kw: {"variant": v.name, "status": "cached", "seconds": 0})
    return mod


BACKENDS = registry.names()


def build(name: str, request, kinds=KINDS, built_for=None):
    """(scenario, backend) — the backend made by its registry factory for ``built_for`` (default ``kinds``)."""
    if name == "triton" and ON_GPU:
        pytest.skip("CUDA present: triton runs compiled there (tests/gpu/test_layer_match_gpu.py)")
    if name in ("flashinfer", "fa3"):
        request.getfixturevalue("fib")
    dtype = torch.float32 if name == "torch_native" else torch.bfloat16
    sc = Scenario(kinds, device="cpu", dtype=dtype, page_size=4, max_reqs=8, max_context_len=64, ws_bytes=1 << 20,
                  name=name, sm_count=4, facts_type="cuda" if name in ("flashinfer", "fa3") else "cpu")
    ctx = sc.ctx if built_for is None else dataclasses.replace(sc.ctx, layer_kinds=list(built_for))
    return sc, registry.get(name).load_factory()(ctx)


def layer_of(kind, lid):
    return make_layer(kind, lid, SINKS if kind.has_sinks else None)


def call(sc, be, layer, mode=ForwardMode.EXTEND, reqs=(0, 1), new=(3, 2)):
    """Plan one batch and call ``layer`` with q/k/v shaped for it (so only the layer check can refuse)."""
    fb = sc.batch(mode, list(reqs), list(new))
    be.init_forward_metadata(fb)
    t = sum(new)
    q = sc.randn(t, layer.num_heads, layer.head_dim)
    k, v = sc.randn(t, layer.num_kv_heads, layer.head_dim), sc.randn(t, layer.num_kv_heads, layer.v_head_dim)
    return be.forward(q, k, v, layer, fb)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case,lid,field,change", MUTATIONS, ids=[m[0] for m in MUTATIONS])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_mismatched_layer_is_refused_before_any_write(name, case, lid, field, change, mode, request):
    """A layer differing in one field raises LayerMismatch naming id, field, call and built value; K/V untouched."""
    sc, be = build(name, request)
    kind = KINDS[lid]
    good = layer_of(kind, lid)
    if mode is ForwardMode.DECODE:
        call(sc, be, good, ForwardMode.EXTEND, (0, 1), (3, 2))
    before = [t.clone() for t in sc.kv.k_buffer + sc.kv.v_buffer]
    bad = dataclasses.replace(good, **change)
    new = (1, 1) if mode is ForwardMode.DECODE else (3, 2)
    with pytest.raises(LayerMismatch) as ei:
        call(sc, be, bad, mode, (0, 1), new)
    info = ei.value.info
    want = dict(num_heads=8, num_kv_heads=2, head_dim=16, v_head_dim=16, is_mla=False, scaling=kind.scaling,
                sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=kind.has_sinks,
                attention_chunk_size=kind.attention_chunk_size)[field]
    got = getattr(bad, field) if field != "sinks" else bad.sinks is not None
    assert info.code == "layer_mismatch" and info.state == "forward"
    assert [(f.name, f.value) for f in info.flags] == [("layer_id", lid), (f"layer.{field}", got)]
    assert info.allowed == [repr(want)]
    assert f"layer {lid}: {field}={got!r}" in info.message and f"built for {field}={want!r}" in info.message
    assert name in info.message and "ModelSpec" in info.remedy
    assert all(torch.equal(a, b) for a, b in zip(before, sc.kv.k_buffer + sc.kv.v_buffer))


@pytest.mark.parametrize("name", BACKENDS)
def test_layer_id_not_built_for_is_refused(name, request):
    """A layer id outside the kinds the backend was built for is a LayerMismatch naming the ids it has."""
    sc, be = build(name, request, built_for=KINDS[:2])
    with pytest.raises(LayerMismatch) as ei:
        call(sc, be, layer_of(KINDS[2], 2))
    info = ei.value.info
    assert info.flags[0].name == "layer_id" and info.flags[0].value == 2 and info.allowed == ["0-1"]
    assert "built for layers 0-1 only" in info.message


@pytest.mark.parametrize("name", BACKENDS)
def test_check_runs_once_per_layer_object(name, request, monkeypatch):
    """Over extend + decode steps the comparison runs once per layer; a new equal object is checked once more."""
    seen: list[int] = []
    orig = base.check_layer
    monkeypatch.setattr(base, "check_layer", lambda planned, layer: (seen.append(layer.layer_id), orig(planned, layer))[1])
    sc, be = build(name, request)
    layers = [layer_of(k, k.layer_ids[0]) for k in KINDS]
    for mode, new in ((ForwardMode.EXTEND, (3, 2)), (ForwardMode.DECODE, (1, 1))):
        fb = sc.batch(mode, [0, 1], list(new))
        be.init_forward_metadata(fb)
        for layer in layers:
            t = sum(new)
            be.forward(sc.randn(t, 8, 16), sc.randn(t, 2, 16), sc.randn(t, 2, 16), layer, fb)
    assert sorted(seen) == [0, 1, 2]
    call(sc, be, dataclasses.replace(layers[1]), ForwardMode.DECODE, (0, 1), (1, 1))
    assert sorted(seen) == [0, 1, 1, 2]


def test_float32_scale_from_an_engine_matches():
    """A scale computed in float32 (1e-8 relative off the float64 plan) is the same scale; 1e-5 off is not."""
    kind = make_kind(8, 2, 128)
    planned = PlannedLayers([kind], backend="x", role="primary")
    f32 = float(torch.tensor(128 ** -0.5, dtype=torch.float32))
    assert f32 != kind.scaling
    planned.check(dataclasses.replace(make_layer(kind, 0), scaling=f32))
    with pytest.raises(LayerMismatch):
        planned.check(dataclasses.replace(make_layer(kind, 0), scaling=kind.scaling * (1 + 1e-5)))


def test_layers_are_frozen():
    """A checked layer cannot be changed in place (the check is cached per object)."""
    layer = make_layer(KINDS[1], 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.sliding_window = 4096  # type: ignore[misc]


def test_unbound_reference_computes_with_the_call():
    """torch_native made directly without layer_kinds is a plain reference: it takes each call's layer."""
    from pipeline.backends.torch_native import TorchNativeBackend

    sc = Scenario(KINDS, device="cpu", dtype=torch.float32, page_size=4, max_reqs=8, max_context_len=64)
    be = TorchNativeBackend()
    assert be.planned is None
    call(sc, be, dataclasses.replace(layer_of(KINDS[1], 1), sliding_window=2))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["extend", "decode"])
def test_q_in_another_dtype_is_refused_before_any_write(name, mode, request):
    """q in a dtype other than the one the backend was built for (the model's) is a LayerMismatch naming the layer,
    q's dtype and the built one, before any K/V is written — never a result silently computed in q's dtype; a later
    call in the built dtype goes through."""
    sc, be = build(name, request)
    layer = layer_of(KINDS[0], 0)
    if mode is ForwardMode.DECODE:
        call(sc, be, layer, ForwardMode.EXTEND, (0, 1), (3, 2))
    built = str(sc.ctx.dtype)
    other = torch.float16
    new = (1, 1) if mode is ForwardMode.DECODE else (3, 2)
    fb = sc.batch(mode, [0, 1], list(new))
    be.init_forward_metadata(fb)
    t = sum(new)
    before = [x.clone() for x in sc.kv.k_buffer + sc.kv.v_buffer]
    q, k, v = sc.randn(t, 8, 16), sc.randn(t, 2, 16), sc.randn(t, 2, 16)
    with pytest.raises(LayerMismatch) as ei:
        be.forward(q.to(other), k, v, layer, fb)
    info = ei.value.info
    assert [(f.name, f.value) for f in info.flags] == [("layer_id", 0), ("q.dtype", "float16")]
    assert info.allowed == [built] and f"q is float16 in the call" in info.message and built in info.remedy
    assert all(torch.equal(a, b) for a, b in zip(before, sc.kv.k_buffer + sc.kv.v_buffer))
    assert be.forward(q, k, v, layer, fb).dtype == q.dtype
