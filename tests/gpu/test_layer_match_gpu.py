"""Window, softcap and sinks at the bundled models' real shapes, per backend, on a CUDA GPU.

Each backend is made by its registry factory for one layer kind and driven through paged extends
(with and without a cached prefix) and decode steps whose contexts are longer than the window:

- shapes: Gemma-2 (16 q / 8 kv heads, head dim 256, scale 1/16, window 4096, softcap 50) and
  gpt-oss (64 q / 8 kv heads, head dim 64, scale 1/8, window 128, sinks);
- features: window < context, softcap, sinks, window + sinks, window + softcap, with the shape's own
  window; softcapped q is scaled so scores reach the cap (else a cap of 50 never bites);
- backends: flashinfer, fa3, triton and torch_native on cuda, each where its capability record
  accepts the case (the others are asserted to be refused by the record, with reasons); pages 1 and 16;
- outputs NaN-poisoned (the allocator's free block of the output's size filled with NaN) before
  every call; every request against :func:`pipeline.runtime.reference.reference_attention` in float64 over
  an independent copy of its K/V (first and last 64 queries of long extends), bf16 tolerance 1e-2;
- the new K/V land in the pool, and a layer with another window is refused (``LayerMismatch``).

Run on the H200: ``python3 -m pytest -q -m gpu tests/gpu/test_layer_match_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fi_reference import Scenario  # noqa: E402
from pipeline.backends import packages, registry  # noqa: E402
from pipeline.backends.base import AttentionLayer  # noqa: E402
from pipeline.core.contracts import DeviceFacts, ForwardMode, LayerKind, ModelSpec  # noqa: E402
from pipeline.core.errors import LayerMismatch  # noqa: E402
from pipeline.runtime.reference import reference_attention, rel_err  # noqa: E402
from states.capability_check import model_reasons  # noqa: E402

DEV = "cuda"
TOL = 1e-2
SHAPES = {
    "gemma2": dict(h=16, hkv=8, d=256, window=4096),
    "gptoss": dict(h=64, hkv=8, d=64, window=128),
}
FEATURES = {"window": {"window"}, "softcap": {"softcap"}, "sinks": {"sinks"}, "window+sinks": {"window", "sinks"},
            "window+softcap": {"window", "softcap"}}
SOFTCAP = 50.0
BACKENDS = registry.names()
CC = torch.cuda.get_device_capability()
FACTS = DeviceFacts(type="cuda", compute_capability=CC, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
                    source="test")


def kind_of(shape: str, feature: str) -> LayerKind:
    s, f = SHAPES[shape], FEATURES[feature]
    return LayerKind(kind="sliding" if "window" in f else "full", num_heads=s["h"], num_kv_heads=s["hkv"],
                     head_dim_qk=s["d"], head_dim_v=s["d"], scaling=s["d"] ** -0.5,
                     sliding_window=s["window"] if "window" in f else None,
                     logit_softcap=SOFTCAP if "softcap" in f else None, has_sinks="sinks" in f, layer_ids=[0])


def record_reasons(backend: str, kind: LayerKind) -> list[str]:
    """Why the backend's capability record refuses this layer kind (empty: accepted), plus device/package."""
    cap = registry.get(backend).capability
    spec = ModelSpec(model_type="probe", hidden_size=kind.num_heads * kind.head_dim_qk, num_hidden_layers=1,
                     num_attention_heads=kind.num_heads, num_key_value_heads=kind.num_kv_heads,
                     head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                     layer_types=[kind.kind], sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap,
                     has_attention_sinks=kind.has_sinks, dtype="bfloat16")
    out = model_reasons(cap, spec)
    if cap.archs is not None and FACTS.arch not in cap.archs:
        out.append(f"arch {FACTS.arch}")
    return out


CASES = [(b, s, f) for b in BACKENDS for s in SHAPES for f in FEATURES]
ACCEPTED = [c for c in CASES if not record_reasons(c[0], kind_of(c[1], c[2]))]
REFUSED = [c for c in CASES if c not in ACCEPTED]


def test_refused_cases_are_refused_by_the_record():
    """What is not run is refused by the backend's capability record, each with a reason (fa3: dims, features)."""
    assert {b for b, _, _ in ACCEPTED} >= {"flashinfer", "triton", "torch_native"}
    for b, s, f in REFUSED:
        assert record_reasons(b, kind_of(s, f)), (b, s, f)


def poison(nbytes: int) -> None:
    """Fill a free caching-allocator block of ``nbytes`` with NaN, so an output allocated next starts as NaN."""
    torch.empty(nbytes // 2 + 64, dtype=torch.bfloat16, device=DEV).fill_(float("nan"))


class Case:
    """One backend instance for one kind, with an independent K/V history per request."""

    def __init__(self, backend: str, kind: LayerKind, page: int, max_ctx: int, seed: int = 0) -> None:
        missing = [p for p, ok in packages.installed(registry.get(backend).capability.packages).items() if not ok]
        if missing:
            pytest.fail(f"{backend} needs the {', '.join(missing)} package on the GPU machine")
        self.kind, self.backend_name = kind, backend
        self.sc = Scenario([kind], device=DEV, dtype=torch.bfloat16, page_size=page, max_reqs=8,
                           max_context_len=max_ctx, ws_bytes=512 << 20, name=backend, sm_count=FACTS.sm_count,
                           arch=CC, facts_type="cuda", seed=seed)
        self.be = registry.get(backend).load_factory()(self.sc.ctx)
        g = torch.Generator().manual_seed(seed)
        sinks = (torch.randn(kind.num_heads, generator=g) + 2.0).to(DEV) if kind.has_sinks else None
        self.layer = AttentionLayer(layer_id=0, num_heads=kind.num_heads, num_kv_heads=kind.num_kv_heads,
                                    head_dim=kind.head_dim_qk, v_head_dim=kind.head_dim_v, scaling=kind.scaling,
                                    sliding_window=kind.sliding_window, logit_softcap=kind.logit_softcap, sinks=sinks)
        self.q_gain = SOFTCAP / (math.sqrt(kind.head_dim_qk) * kind.scaling) if kind.logit_softcap else 1.0
        self.hist: dict[int, tuple[list, list]] = {}

    def prefix(self, reqs, lens) -> None:
        """Cache random K/V for the requests (written by the scenario, not the backend)."""
        self.sc.fill_prefix(reqs, lens)
        for r, n in zip(reqs, lens):
            if n:
                k, v = self.sc.request_kv(0, r, n)
                self.hist[r] = ([k.double()], [v.double()])

    def step(self, mode: ForwardMode, reqs, new) -> float:
        """One batch through the layer; returns the worst per-request error (asserts finiteness and K/V writes)."""
        k0 = self.kind
        fb = self.sc.batch(mode, list(reqs), list(new))
        t = sum(new)
        q = self.sc.randn(t, k0.num_heads, k0.head_dim_qk, scale=self.q_gain)
        k = self.sc.randn(t, k0.num_kv_heads, k0.head_dim_qk)
        v = self.sc.randn(t, k0.num_kv_heads, k0.head_dim_v)
        self.be.init_forward_metadata(fb)
        poison(t * k0.num_heads * k0.head_dim_v * 2)
        out = self.be.forward(q, k, v, self.layer, fb).view(t, k0.num_heads, k0.head_dim_v)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "NaN/inf in the output (poisoned memory not overwritten?)"
        kv = self.sc.kv
        assert torch.equal(kv.k_buffer[0][fb.out_cache_loc], k) and torch.equal(kv.v_buffer[0][fb.out_cache_loc], v)
        worst, off = 0.0, 0
        for r, n in zip(reqs, new):
            ks, vs = self.hist.setdefault(r, ([], []))
            ks.append(k[off:off + n].double())
            vs.append(v[off:off + n].double())
            kk, vv = torch.cat(ks), torch.cat(vs)
            rows = torch.arange(n, device=DEV)
            if n > 128:  # long extends: the first and the last 64 queries
                rows = torch.cat([rows[:64], rows[-64:]])
            pos = kk.shape[0] - n + rows
            ref = reference_attention(q[off:off + n][rows], kk, vv, q_positions=pos, scale=k0.scaling,
                                      window=k0.sliding_window, softcap=k0.logit_softcap, sinks=self.layer.sinks)
            worst = max(worst, rel_err(out[off:off + n][rows], ref))
            off += n
        return worst


def contexts(shape: str) -> tuple[list[int], list[int]]:
    """Prefix lengths longer than the window (and one empty), and the extend lengths after them."""
    w = SHAPES[shape]["window"]
    return [w + 37, 2 * w + 5, 0], [5, 33, w + 20]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("backend,shape,feature", ACCEPTED, ids=["-".join(c) for c in ACCEPTED])
def test_extend_and_decode_match_float64(backend, shape, feature, page):
    """Ragged extend, extend over cached prefixes longer than the window, then 2 decode steps: all within 1e-2."""
    kind = kind_of(shape, feature)
    pre, new = contexts(shape)
    c = Case(backend, kind, page, max_ctx=max(pre) + max(new) + 64)
    errs = {"ragged-extend": c.step(ForwardMode.EXTEND, [3, 4], [SHAPES[shape]["window"] + 9, 7])}
    c.prefix([0, 1], pre[:2])
    errs["extend"] = c.step(ForwardMode.EXTEND, [0, 1, 2], new)
    for i in range(2):
        errs[f"decode{i}"] = c.step(ForwardMode.DECODE, [0, 1, 2, 3, 4], [1] * 5)
    assert all(e <= TOL for e in errs.values()), errs


@pytest.mark.parametrize("backend,shape,feature", [c for c in ACCEPTED if "window" in c[2]],
                         ids=["-".join(c) for c in ACCEPTED if "window" in c[2]])
def test_a_layer_with_another_window_is_refused(backend, shape, feature):
    """Called with a window other than the one it was built for, the backend raises before writing."""
    c = Case(backend, kind_of(shape, feature), 16, max_ctx=256)
    c.layer = dataclasses.replace(c.layer, sliding_window=7)
    with pytest.raises(LayerMismatch) as ei:
        c.step(ForwardMode.EXTEND, [0], [9])
    assert ei.value.info.flags[1].name == "layer.sliding_window" and ei.value.info.flags[1].value == 7
