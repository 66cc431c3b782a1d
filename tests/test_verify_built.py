"""Verification tests what runs: the instances it checks are built for its windows.

:func:`pipeline.runtime.verify.verify_built` rebuilds the plan (same backends, roles, mode, wrappers) from the
verification spec whose sliding windows are capped at ``VERIFY_WINDOW``, so the windows bite within
its short requests on every backend — FlashInfer included, whose wrappers bake the window in. Checked
on CPU for the bundled windowed configs (Gemma-2: window + softcap, head dim 256; gpt-oss: window 128
+ sinks; Mistral: window 4096) with torch_native and with the flashinfer/fa3 backends over
tests/fake_flashinfer.py, in every build mode; a backend that ignores the window fails, as it would
not have with the served windows.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import msgspec
import pytest
import torch

import fake_flashinfer
from conftest import CONFIGS
from pipeline.setup import instances as build_mod
from pipeline.backends import registry
from pipeline.backends.base import AttentionBackend, PlannedLayers
from pipeline.backends.records import TORCH_NATIVE
from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
from pipeline.core.spec import truncate_spec
from pipeline.core.model_spec import load_model_spec
from pipeline.platforms.fake import FakePlatform
from pipeline.memory.pools import check_needs
from pipeline.runtime.verify import VERIFY_WINDOW, verification_model, verify_backend, verify_built

WINDOWED = {"gemma-2-9b.json": 4096, "gpt-oss-20b.json": 128, "mistral-7b-v0.1.json": 4096}
PAGE = 4
POOL = PoolFacts(max_reqs=8, max_context_len=64, num_token_slots=check_needs(8, PAGE).verify_slots + 8 * PAGE, page_size=PAGE)
FI_INSTALLED = {"torch": True, "triton": True, "flashinfer-python": True}
# a small fake GPU: 4 SMs keep FlashInfer's workspace bound (and the CPU buffer) small
FAKE_GPU = DeviceFacts(type="cuda", index=0, name="fake sm90", vendor="nvidia", compute_capability=(9, 0), sm_count=4,
                       total_memory_bytes=80 << 30, cuda_version="12.8", source="test")


def model(config: str, head_div: int = 1):
    """The bundled config, first two layers (one sliding and one full for Gemma-2 / gpt-oss); with
    ``head_div`` its q and kv head counts divided by it (same GQA ratio, head dims, window, softcap, sinks)."""
    m = truncate_spec(load_model_spec(CONFIGS / config), 2)
    return msgspec.structs.replace(m, num_attention_heads=m.num_attention_heads // head_div,
                                   num_key_value_heads=max(m.num_key_value_heads // head_div, 1))


def built(config: str, *, platform=None, installed=None, head_div: int = 1, **args):
    req = SetupRequest(args=AttentionArgs(page_size=PAGE, **args), model=model(config, head_div), pool=POOL,
                       device="cuda" if platform else "cpu")
    return req, build_attention_backends(req, platform=platform, installed=installed)


@pytest.fixture
def spy_build_like(monkeypatch):
    """Records every Built that build_like returns (to inspect the instances verification made)."""
    made = []
    orig = build_mod.build_like

    def spy(*a, **kw):
        made.append(orig(*a, **kw))
        return made[-1]

    monkeypatch.setattr(build_mod, "build_like", spy)
    return made


def windows(backend) -> set:
    return {k.sliding_window for k in backend.planned.kinds}


# (Gemma-2 in TBO mode, gpt-oss and Mistral in normal mode also run through `attn-setup run` in test_cli_run)
TN_CASES = [("gemma-2-9b.json", {}), ("gpt-oss-20b.json", {"enable_two_batch_overlap": True, "moe_a2a_backend": "deepep"}),
            ("mistral-7b-v0.1.json", {})]


@pytest.mark.parametrize("config,mode", TN_CASES, ids=[f"{c}-{'tbo' if m else 'normal'}" for c, m in TN_CASES])
def test_torch_native_verifies_with_windows_that_bite(config, mode, spy_build_like):
    """Every instance and the wrapper pass, verified on instances rebuilt for window 7 (then closed)."""
    req, out = built(config, **mode)
    with out:
        results = verify_built(out, req, decode_steps=2)
        roles = [i.role for i in out.plan.instances] + (["tbo.wrapper"] if mode else [])
        assert [r.role for r in results] == roles
        note = f"sliding window {WINDOWED[config]}->{VERIFY_WINDOW}"
        assert all(r.passed and 0 < r.max_rel_err <= r.tol and note in r.detail for r in results), results
        if config.startswith("gemma"):  # a float32 checkpoint that --dtype auto runs in bfloat16 (sglang's rule)
            assert results[0].tol == 1e-2 and "kv bfloat16" in results[0].detail
        (vb,) = spy_build_like
        assert sorted(vb.instances) == sorted(out.instances)
        for role, inst in out.instances.items():
            assert windows(inst) == {WINDOWED[config], None} - ({None} if config.startswith("mistral") else set())
            assert windows(vb.instances[role]) == {VERIFY_WINDOW} | ({None} if not config.startswith("mistral") else set())
            assert vb.instances[role] is not inst and vb.instances[role].closed and not inst.closed


def test_unwindowed_model_verifies_its_own_instances(llama, spy_build_like):
    """Without a window to cap, the built instances themselves are verified (nothing rebuilt)."""
    req, out = built("llama-3.1-8b.json")
    with out:
        (res,) = verify_built(out, req, decode_steps=1)
        assert res.passed and "sliding window" not in res.detail and spy_build_like == []


class IgnoresWindow(AttentionBackend):
    """Built and checked like any backend, but attends over the whole context (a window bug)."""

    name = "ignores_window"

    def __init__(self, ctx) -> None:
        self.role = ctx.role
        self.planned = PlannedLayers(ctx.layer_kinds, backend=self.name, role=ctx.role)
        self.inner = TorchNativeBackend(torch_device=ctx.torch_device, role=ctx.role)

    def init_forward_metadata(self, forward_batch) -> None:
        self.inner.init_forward_metadata(forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.planned.check(layer)
        return self.inner.forward_extend(q, k, v, replace(layer, sliding_window=None), forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.planned.check(layer)
        return self.inner.forward_decode(q, k, v, replace(layer, sliding_window=None), forward_batch, save_kv_cache)


def create_ignores_window(ctx) -> IgnoresWindow:
    return IgnoresWindow(ctx)


@pytest.mark.parametrize("config", ["gpt-oss-20b.json", "mistral-7b-v0.1.json"])
def test_a_backend_ignoring_the_window_fails_verification(config, monkeypatch):
    """The window bug is caught at the verification window, and would pass unseen at the served window."""
    monkeypatch.setitem(registry._REGISTRY, "ignores_window", registry.BackendEntry(
        "ignores_window", TORCH_NATIVE, "test_verify_built:create_ignores_window"))
    req, out = built(config, attention_backend="ignores_window")
    with out:
        (res,) = verify_built(out, req, decode_steps=2)
        assert not res.passed and res.max_rel_err > 10 * res.tol and "worst at sliding/" in res.detail, res
        served = verify_backend(out.attn_backend, role="primary", name="ignores_window", model=req.served_model,
                                req_to_token_pool=out.pools["req_to_token_pool"], kv_pool=out.pools["kv_pool"],
                                torch_device="cpu", dtype="bfloat16", decode_steps=2)
        assert served.passed


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    from pipeline.backends.flashinfer import backend as mod

    monkeypatch.setattr(mod, "ensure_compiled", lambda v, **kw: {"variant": v.name, "status": "cached", "seconds": 0})
    return mod


# (fa3's record claims neither windows nor head dim 256 / 64: resolve refuses it for these models)
FI_MODES = {
    "normal": dict(attention_backend="flashinfer"),
    "tbo": dict(attention_backend="flashinfer", enable_two_batch_overlap=True, moe_a2a_backend="deepep"),
    "pdmux": dict(attention_backend="flashinfer", enable_pdmux=True, sm_group_num=2),
    "hybrid": dict(prefill_attention_backend="flashinfer", decode_attention_backend="torch_native"),
}


# every mode once, each config in two (the fake kernels are slow Python loops; CI is a 2-core machine)
HEAD_DIV = {"gemma-2-9b.json": 4, "gpt-oss-20b.json": 8}  # 4 q / 2 kv heads; 8 q / 1 kv head
FI_CASES = [("gemma-2-9b.json", "normal"), ("gemma-2-9b.json", "pdmux"), ("gemma-2-9b.json", "hybrid"),
            ("gpt-oss-20b.json", "normal"), ("gpt-oss-20b.json", "tbo")]


@pytest.mark.parametrize("config,mode", FI_CASES)
def test_flashinfer_verifies_with_windows_that_bite(config, mode, fake_fi, spy_build_like):
    """FlashInfer (fake kernels) in every mode: rebuilt for window 7, every role passes; the originals would refuse.

    Fewer heads (the fake's Python loops are slow; same GQA ratio); head dims, window, softcap and sinks as bundled."""
    from pipeline.core.errors import LayerMismatch

    req, out = built(config, platform=FakePlatform(FAKE_GPU), installed=FI_INSTALLED, dtype="bfloat16",
                     flashinfer_workspace_size=64 << 20, head_div=HEAD_DIV[config], **FI_MODES[mode])
    with out:
        results = verify_built(out, req, decode_steps=1)
        want = [i.role for i in out.plan.instances]
        assert [r.role for r in results][: len(want)] == want
        assert all(r.passed and 0 < r.max_rel_err <= r.tol for r in results), results
        assert all(f"sliding window {WINDOWED[config]}->{VERIFY_WINDOW}" in r.detail for r in results)
        (vb,) = spy_build_like
        for role, inst in out.instances.items():
            assert open_class(vb.instances[role]) is type(inst) and vb.instances[role].name == inst.name
            assert windows(vb.instances[role]) == {VERIFY_WINDOW, None}
            if inst.name in ("flashinfer", "fa3"):  # the window is baked into the planned wrappers
                assert {kw.window_left for kw in inst.kinds} == {WINDOWED[config] - 1, -1}
        # the served instances refuse the verification layers instead of computing with their own window
        with pytest.raises(LayerMismatch):
            verify_backend(out.instances[want[0]], role=want[0], name="x", model=verification_spec(req),
                           req_to_token_pool=out.pools["req_to_token_pool"], kv_pool=out.pools["kv_pool"],
                           torch_device="cpu", dtype="bfloat16", decode_steps=1)


def verification_spec(req):
    return verification_model(req.served_model)[0]


def test_build_like_refusal_closes_what_it_built(monkeypatch):
    """A factory failing half-way through build_like closes the instances made before it."""
    req, out = built("gemma-2-9b.json", enable_two_batch_overlap=True, moe_a2a_backend="deepep")
    made = []
    real = registry.get("torch_native").load_factory()

    def flaky(ctx):
        if len(made) == 2:
            raise RuntimeError("factory failed")
        made.append(real(ctx))
        return made[-1]

    monkeypatch.setattr(registry.BackendEntry, "load_factory", lambda self: flaky)
    with out, pytest.raises(RuntimeError):
        build_mod.build_like(out, req, verification_spec(req))
    assert len(made) == 2 and all(b.closed for b in made)
    assert not any(b.closed for b in out.instances.values()) or out.closed


def test_runner_model_steps_use_layers_every_instance_was_built_for():
    """The runner's model steps call its TBO instances with the stack's layers: each matches every plan.

    (test_cli_run runs those steps for Gemma-2 in TBO mode through `attn-setup run`.)"""
    from pipeline.runtime.runner import Runner, RunnerConfig

    req = SetupRequest(args=AttentionArgs(page_size=PAGE, enable_two_batch_overlap=True, moe_a2a_backend="deepep"), pool=POOL, device="cpu",
                       model=load_model_spec(CONFIGS / "gemma-2-9b.json"))
    with Runner(RunnerConfig(request=req, num_layers=2)) as r:
        r.initialize()
        for inst in r.backends.instances.values():
            assert sorted(inst.planned.by_id) == [layer.layer_id for layer in r.stack.layers]
            for layer in r.stack.layers:
                inst.planned.check(layer)
        assert [layer.sliding_window for layer in r.stack.layers] == [4096, None]


def open_class(backend):
    """The backend's class before close() moved it to its closed view (pipeline.backends.base.mark_closed)."""
    cls = type(backend)
    return cls.__mro__[1] if getattr(cls, "_closed_view", False) else cls
