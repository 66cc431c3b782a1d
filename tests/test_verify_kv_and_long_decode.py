"""Model-step verification over narrow KV caches and long decodes (adversarial trial, items 1 and 2).

The reference attends over the K/V the pool holds, so fp32 compute over a bf16/fp16 cache keeps fp32's 1e-4
and a right backend passes at every decode length and page size, while a backend off by more than the compute
dtype's error, or one that writes K/V to the wrong place, still fails."""

from __future__ import annotations

import pytest
import torch

from pipeline.backends.torch_native import TorchNativeBackend
from pipeline.core.contracts import AttentionArgs, DeviceFacts, PoolFacts, SetupRequest
from pipeline.platforms.fake import FakePlatform
from pipeline.memory.pools import check_needs
from pipeline.runtime.model_steps import verify_model_steps
from pipeline.runtime.runner import Runner, RunnerConfig
from test_verify_steps import TINY, tiny  # noqa: F401 (fixture)


def _checks(spec, *, dtype="auto", kv="auto", steps=3, page_size=1, decode_off=None):
    pool = PoolFacts(max_reqs=4, max_context_len=16 + steps, page_size=page_size,
                     num_token_slots=check_needs(4, page_size, steps).steps_slots + 2 * page_size)
    req = SetupRequest(args=AttentionArgs(dtype=dtype, kv_cache_dtype=kv, page_size=page_size), model=spec,
                       device="cpu", pool=pool)
    facts = DeviceFacts(type="cpu", name="fake cpu", total_memory_bytes=8 << 30, sm_count=2, source="test")
    with Runner(RunnerConfig(request=req, num_layers=2), platform=FakePlatform(facts)) as r:
        r.initialize()
        if decode_off is not None:
            good = r.backend_for
            r.backend_for = lambda decode: decode_off if decode else good(decode)
        return verify_model_steps(r, decode_steps=steps)


class Scaled(TorchNativeBackend):
    """Decode output times (1 + eps): a wrong backend by a chosen relative amount."""

    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        return super().forward_decode(q, k, v, layer, fb, save_kv_cache) * (1 + self.eps)


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_fp32_compute_over_a_narrow_kv_cache_passes_at_fp32_tolerance(tiny, kv):
    """A reported exit 1 (2.35e-4 > 1e-4): now far below 1e-4, and a 1e-3 error — under fp16's own step — fails."""
    ok = _checks(tiny, dtype="float32", kv=kv)
    assert all(c.passed and c.tol == 1e-4 for c in ok) and max(c.max_rel_err for c in ok) < 1e-5, ok
    bad = [c for c in _checks(tiny, dtype="float32", kv=kv, decode_off=Scaled(1e-3)) if c.mode == "decode"]
    assert bad and not any(c.passed for c in bad), bad


def test_fp8_kv_keeps_the_compute_tolerance_and_catches_a_wrong_decode(tiny):
    """fp8 K/V are the reference's input: bf16's 1e-2 holds, and a 3e-2 error fails."""
    ok = _checks(tiny, kv="fp8_e4m3")
    assert all(c.passed and c.tol == 1e-2 for c in ok), ok
    bad = [c for c in _checks(tiny, kv="fp8_e4m3", decode_off=Scaled(3e-2)) if c.mode == "decode"]
    assert not any(c.passed for c in bad), bad


class WrongSlot(TorchNativeBackend):
    """Writes each decode token's K/V one slot off (into the reserved page) but attends consistently."""

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, torch.zeros_like(fb.out_cache_loc), k, v)
        return super().forward_decode(q, k, v, layer, fb, save_kv_cache=False)


def test_a_wrong_kv_write_fails_although_the_reference_reads_the_pool(tiny):
    """Reading the pool's K/V must not hide a write bug: the kv-cache-write check fails."""
    checks = _checks(tiny, decode_off=WrongSlot())
    assert any(c.step == "kv-cache-write" and not c.passed for c in checks), checks


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("steps", [1, 31, 129, 256])
def test_right_backend_passes_at_every_decode_length_and_page_size(tiny, steps, page_size):
    """torch_native in bf16 stays under 1e-2 up to 256 decode steps (past 128 and across pages)."""
    checks = _checks(tiny, steps=steps, page_size=page_size)
    assert len(checks) == steps + 2 and all(c.passed for c in checks), [c for c in checks if not c.passed]
