"""npu-lazy-mem with a fake NPU platform, and the field > env var > default precedence."""

from __future__ import annotations

import pytest

from conftest import npu_facts
from pipeline.core import events as ev
from pipeline.setup.build import build_attention_backends
from pipeline.core.contracts import AttentionArgs, SetupRequest
from pipeline.platforms.fake import FakePlatform
from pipeline.backends.flashinfer import rules
from pipeline.core import settings
from states import npu_lazy_mem

INSTALLED = {"torch": True, "triton": False, "flashinfer-python": False}
GIB = 1 << 30


def _run(llama, pool, monkeypatch, env=None, draft=False, rank=1, world=4, **args):
    monkeypatch.delenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", raising=False)
    if env is not None:
        monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", str(env))
    plat = FakePlatform(npu_facts())
    extra = dict(speculative_algorithm="EAGLE") if draft else {}
    req = SetupRequest(args=AttentionArgs(**args, **extra), model=llama, pool=pool, device="npu:0", rank=rank,
                       world_size=world, is_draft_worker=draft)
    out = build_attention_backends(req, platform=plat, installed=INSTALLED, cpu_group="cpu-group-handle")
    out.close()
    return plat, out


def test_zbal_initialised_once_with_world_facts(llama, small_pool, monkeypatch):
    """NPU, size > 0, target worker: lazy memory init called once with bytes, rank, world size, CPU group."""
    plat, out = _run(llama, small_pool, monkeypatch, zbal_local_mem_size=2 * GIB)
    assert plat.called("init_lazy_device_memory") == [(2 * GIB, 1, 4, "cpu-group-handle")]
    inits = [r for r in out.events if isinstance(r, ev.LazyMemInitialized)]
    assert len(inits) == 1 and inits[0].bytes == 2 * GIB and inits[0].state == "npu-lazy-mem"


def test_zbal_before_annotate_and_after_build(llama, small_pool, monkeypatch):
    """The init happens inside npu-lazy-mem: after every backend is built, before annotate."""
    _, out = _run(llama, small_pool, monkeypatch, zbal_local_mem_size=GIB)
    names = [type(r).__name__ for r in out.events]
    assert names.index("LazyMemInitialized") > max(i for i, n in enumerate(names) if n == "BackendBuilt")
    assert names.index("LazyMemInitialized") < names.index("BackendsAnnotated")


def test_draft_worker_skips_zbal(llama, small_pool, monkeypatch):
    """A draft worker never initialises zbal memory; the skip carries the reason."""
    plat, out = _run(llama, small_pool, monkeypatch, draft=True, zbal_local_mem_size=GIB)
    assert plat.called("init_lazy_device_memory") == []
    skip = [r for r in out.events if isinstance(r, ev.StepSkipped) and r.what == "npu_lazy_mem"]
    assert "draft worker" in skip[0].reason


def test_size_zero_skips_zbal(llama, small_pool, monkeypatch):
    """Size 0 (the default) skips with a reason naming the source of the 0."""
    plat, out = _run(llama, small_pool, monkeypatch)
    assert plat.called("init_lazy_device_memory") == []
    skip = [r for r in out.events if isinstance(r, ev.StepSkipped) and r.what == "npu_lazy_mem"]
    assert "0" in skip[0].reason and "default" in skip[0].reason


def test_env_var_used_when_field_unset(llama, small_pool, monkeypatch):
    """SGLANG_ZBAL_LOCAL_MEM_SIZE applies when the field is unset, and the log says env won."""
    plat, out = _run(llama, small_pool, monkeypatch, env=3 * GIB)
    assert plat.called("init_lazy_device_memory")[0][0] == 3 * GIB
    src = [r for r in out.events if isinstance(r, ev.SettingResolved) and r.field == "zbal_local_mem_size"]
    assert src[0].source == "env" and src[0].value == 3 * GIB


def test_field_beats_env_var(llama, small_pool, monkeypatch):
    """An explicit field wins over the env var (explicit > env > default), and the log says so."""
    plat, out = _run(llama, small_pool, monkeypatch, env=3 * GIB, zbal_local_mem_size=GIB)
    assert plat.called("init_lazy_device_memory")[0][0] == GIB
    src = [r for r in out.events if isinstance(r, ev.SettingResolved) and r.field == "zbal_local_mem_size"]
    assert src[0].source == "field"


def test_explicit_zero_field_beats_env(monkeypatch):
    """zbal_local_mem_size=0 given explicitly turns zbal off even when the env var is set."""
    monkeypatch.setenv("SGLANG_ZBAL_LOCAL_MEM_SIZE", "123")
    assert settings.zbal_local_mem_size(AttentionArgs(zbal_local_mem_size=0)) == (0, "field")


def test_bad_env_value_is_a_typed_error(monkeypatch):
    """A non-integer env value is refused naming the variable."""
    from pipeline.core.errors import ConfigError

    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", "lots")
    with pytest.raises(ConfigError) as ei:
        rules.flashinfer_workspace_size(AttentionArgs(), None)
    assert ei.value.info.flags[0].name == "SGLANG_FLASHINFER_WORKSPACE_SIZE"


def test_flashinfer_workspace_defaults(llama, monkeypatch):
    """384 MiB by default, 512 MiB for Qwen3ForCausalLM (sglang's architecture rule), env and field override."""
    from pipeline.core.model_spec import load_model_spec
    from conftest import CONFIGS

    monkeypatch.delenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", raising=False)
    qwen = load_model_spec(CONFIGS / "qwen3-8b.json")
    assert rules.flashinfer_workspace_size(AttentionArgs(), llama) == (384 << 20, "default")
    assert rules.flashinfer_workspace_size(AttentionArgs(), qwen) == (512 << 20, "default")
    monkeypatch.setenv("SGLANG_FLASHINFER_WORKSPACE_SIZE", str(1 << 30))
    assert rules.flashinfer_workspace_size(AttentionArgs(), llama) == (1 << 30, "env")
    assert rules.flashinfer_workspace_size(AttentionArgs(flashinfer_workspace_size=5), llama) == (5, "field")


@pytest.mark.parametrize("device,draft,size,run", [("npu", False, 1, True), ("npu", True, 1, False),
                                                   ("npu", False, 0, False), ("cuda", False, 1, False),
                                                   ("cpu", False, 1, False)])
def test_decision_table(device, draft, size, run):
    """The pure decision: only npu, target worker, size > 0 runs."""
    d = npu_lazy_mem.decide(device, size, "field", draft)
    assert d.run is run and (run or d.reason)
