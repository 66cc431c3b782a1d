"""The verification harness passes correct backends and fails broken ones."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
import torch

from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.core.contracts import LayerKind, MLADims, ModelSpec
from pipeline.core.errors import BuildError
from pipeline.backends.memory import KVPool, ReqToTokenPool
from pipeline.runtime.verify import VERIFY_CHUNK, VERIFY_WINDOW, VerifyResult, verification_model, verify_all, verify_backend


def spec(**kw) -> ModelSpec:
    base = dict(model_type="test", hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, v_head_dim=64, scaling=0.125, layer_types=["full", "full"])
    base.update(kw)
    return ModelSpec(**base)


def kind(kind="full", h=8, hkv=2, d=64, dv=64, lid=0, **kw) -> LayerKind:
    return LayerKind(kind=kind, num_heads=h, num_kv_heads=hkv, head_dim_qk=d, head_dim_v=dv, scaling=d ** -0.5,
                     layer_ids=[lid], **kw)


# the kinds verification builds for (verification_model caps windows at VERIFY_WINDOW so that they bite)
GEMMA = [kind("sliding", h=4, hkv=2, d=128, dv=128, lid=0, sliding_window=VERIFY_WINDOW, logit_softcap=50.0),
         kind("full", h=4, hkv=2, d=128, dv=128, lid=1, logit_softcap=50.0)]
GPT_OSS = [kind("sliding", h=16, hkv=2, lid=0, sliding_window=VERIFY_WINDOW, has_sinks=True),
           kind("full", h=16, hkv=2, lid=1, has_sinks=True)]
MLA = [kind("full", h=4, hkv=1, d=576, dv=512, lid=0, is_mla=True)]
LLAMA4 = [kind("chunked", h=4, hkv=2, d=64, dv=64, lid=0, attention_chunk_size=VERIFY_CHUNK),
          kind("full", h=4, hkv=2, d=64, dv=64, lid=1)]
LLAMA = [kind("full", h=32, hkv=8, d=128, dv=128)]


def pools(kinds, page_size=16, kv_dtype=torch.bfloat16, max_reqs=8):
    r2t = ReqToTokenPool(max_reqs, 128, "cpu")
    return r2t, KVPool.for_layer_kinds(kinds, 2, 4096, page_size, kv_dtype, "cpu")


def run(backend, kinds, dtype="bfloat16", **kw):
    r2t, kv = pools(kinds, **kw)
    return verify_backend(backend, role="primary", name="torch_native", model=None, req_to_token_pool=r2t,
                          kv_pool=kv, torch_device="cpu", dtype=dtype, layer_kinds=kinds)


@pytest.mark.parametrize("kinds", [LLAMA, GEMMA, GPT_OSS, MLA, LLAMA4], ids=["llama", "gemma2", "gpt-oss", "mla",
                                                                         "llama4"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype,kv_dtype,tol", [("float32", torch.float32, 1e-4), ("bfloat16", torch.bfloat16, 1e-2),
                                                ("bfloat16", torch.float8_e4m3fn, 1e-2)])
def test_torch_native_passes(kinds, page_size, dtype, kv_dtype, tol):
    """torch_native passes for each model shape, page size and dtype, with a nonzero error."""
    res = run(TorchNativeBackend(), kinds, dtype=dtype, page_size=page_size, kv_dtype=kv_dtype)
    assert res.passed and res.tol == tol and 0 < res.max_rel_err <= tol, res


def test_detail_states_softcap_scaling_and_callers_notes():
    """Softcapped q is scaled and the caller's notes (e.g. the shrunk window) are in the detail."""
    res = verify_backend(TorchNativeBackend(), role="primary", name="torch_native", model=None,
                         req_to_token_pool=pools(GEMMA)[0], kv_pool=pools(GEMMA)[1], torch_device="cpu",
                         dtype="bfloat16", layer_kinds=GEMMA, notes=["sliding window 4096->7"])
    assert res.passed and "sliding window 4096->7" in res.detail and "softcap 50.0: q x" in res.detail


@pytest.mark.parametrize("window,want", [(4096, VERIFY_WINDOW), (128, VERIFY_WINDOW), (VERIFY_WINDOW, VERIFY_WINDOW),
                                         (3, 3), (None, None)])
def test_verification_model_caps_only_the_window(window, want):
    """verification_model caps the window at VERIFY_WINDOW, keeps every other field, and says so."""
    types = ["sliding", "full"] if window else ["full", "full"]
    model = spec(layer_types=types, sliding_window=window, logit_softcap=30.0, has_attention_sinks=True)
    vm, notes = verification_model(model)
    assert vm.sliding_window == want
    assert msgspec.structs.replace(vm, sliding_window=window) == model
    if want == window:
        assert vm is model and notes == []
    else:
        assert notes == [f"sliding window {window}->{VERIFY_WINDOW}: instances built for verification from that spec"]
        assert [k.sliding_window for k in vm.layer_kinds()] == [VERIFY_WINDOW, None]


class Broken(TorchNativeBackend):
    """torch_native with one layer parameter overridden (``change`` is a dict for dataclasses.replace)."""

    def __init__(self, **change) -> None:
        super().__init__()
        self.change = change

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_extend(q, k, v, replace(layer, **self.change), fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_decode(q, k, v, replace(layer, **self.change), fb, save_kv_cache)


@pytest.mark.parametrize("kinds,change", [
    (GEMMA, dict(logit_softcap=None)),
    (GPT_OSS, dict(sinks=None)),
    (GPT_OSS, dict(sliding_window=None)),
    (LLAMA, dict(scaling=1.0 / 12)),
    (LLAMA4, dict(attention_chunk_size=None)),
], ids=["drops-softcap", "drops-sinks", "ignores-window", "wrong-scale", "ignores-chunk"])
def test_broken_backend_fails(kinds, change):
    """A backend that drops a feature is caught: error far above tolerance, passed=False."""
    res = run(Broken(**change), kinds)
    assert not res.passed and res.max_rel_err > 5 * res.tol, res


class WrongGqa(TorchNativeBackend):
    """Maps q head h to kv head h % Hkv instead of h // (H/Hkv)."""

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        h, hkv = layer.num_heads, layer.num_kv_heads
        perm = torch.arange(h).view(hkv, h // hkv).t().reshape(-1)   # head order 0, g, 2g, … , 1, g+1, …
        q3 = q.reshape(q.shape[0], h, -1)[:, perm]
        out = super().forward_decode(q3, k, v, layer, fb, save_kv_cache).view(q.shape[0], h, -1)
        return out[:, torch.argsort(perm)].reshape(q.shape[0], -1)


class Nan(TorchNativeBackend):
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        out = super().forward_decode(q, k, v, layer, fb, save_kv_cache)
        out[0, 0] = float("nan")
        return out


def test_wrong_gqa_mapping_and_nan_fail():
    """Wrong GQA head mapping in decode fails; NaN output reports inf and fails."""
    bad = run(WrongGqa(), LLAMA)
    assert not bad.passed and "decode" in bad.detail
    nan = run(Nan(), LLAMA)
    assert nan.max_rel_err == float("inf") and not nan.passed


def test_verify_all_roles_and_model_layer_kinds():
    """verify_all verifies each (role, name, backend); layer kinds come from the ModelSpec."""
    model = verification_model(spec(model_type="mistral", layer_types=["sliding", "sliding"], sliding_window=4096))[0]
    kinds = model.layer_kinds()
    r2t, kv = pools(kinds)
    out = verify_all([("tbo_child_0", "torch_native", TorchNativeBackend()), ("decode", "x", Broken(sinks=None)),
                      ("p", "y", Broken(sliding_window=None))],
                     model=model, req_to_token_pool=r2t, kv_pool=kv, torch_device="cpu", dtype="bfloat16")
    assert [(r.role, r.backend, r.passed) for r in out] == [("tbo_child_0", "torch_native", True),
                                                             ("decode", "x", True), ("p", "y", False)]
    assert msgspec.json.decode(msgspec.json.encode(out[0]), type=VerifyResult) == out[0]


def test_mla_model_spec_kinds():
    """A DeepSeek-V2-Lite-shaped ModelSpec verifies in absorbed form (576/512, one kv head)."""
    model = spec(model_type="deepseek_v2", num_attention_heads=16, num_key_value_heads=16, head_dim=192,
                 v_head_dim=128, scaling=192 ** -0.5,
                 mla=MLADims(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128))
    kinds = model.layer_kinds()
    r2t, kv = pools(kinds)
    res = verify_backend(TorchNativeBackend(), role="primary", name="torch_native", model=model,
                         req_to_token_pool=r2t, kv_pool=kv, torch_device="cpu", dtype="bfloat16")
    assert res.passed and kv.k_buffer[0].shape[1:] == (1, 576)


def test_rows_cleared_and_pool_mismatch_refused():
    """req_to_token rows are zeroed afterwards; a pool built for other dims raises BuildError."""
    r2t, kv = pools(LLAMA, max_reqs=3)
    res = verify_backend(TorchNativeBackend(), role="primary", name="torch_native", model=None,
                         req_to_token_pool=r2t, kv_pool=kv, torch_device="cpu", dtype="float32",
                         layer_kinds=LLAMA)
    assert res.passed and "3 reqs" in res.detail and not r2t.req_to_token.any()
    with pytest.raises(BuildError) as ei:
        verify_backend(TorchNativeBackend(), role="p", name="t", model=None, req_to_token_pool=r2t, kv_pool=kv,
                       torch_device="cpu", dtype="float32", layer_kinds=GEMMA)
    assert ei.value.info.code == "verify_pool_mismatch"


@pytest.mark.parametrize("chunk,want", [(8192, VERIFY_CHUNK), (VERIFY_CHUNK, VERIFY_CHUNK), (3, 3)])
def test_verification_model_caps_the_attention_chunk(chunk, want):
    """verification_model caps Llama-4's attention chunk at VERIFY_CHUNK, keeps every other field, and says so."""
    model = spec(layer_types=["chunked", "full"], attention_chunk_size=chunk)
    vm, notes = verification_model(model)
    assert vm.attention_chunk_size == want
    assert msgspec.structs.replace(vm, attention_chunk_size=chunk) == model
    assert (notes == []) is (want == chunk)
    if want != chunk:
        assert notes == [f"attention chunk {chunk}->{VERIFY_CHUNK}: instances built for verification from that spec"]
        assert [k.attention_chunk_size for k in vm.layer_kinds()] == [VERIFY_CHUNK, None]
