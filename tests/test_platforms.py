"""musa / npu / xpu platforms against FAKE vendor modules injected into sys.modules (untested on hardware).

Each fake records every call in order, so the tests check what the platform calls, in which order
and with which arguments: BLAS warm-up on musa only, device facts from ``get_device_properties``,
and NPU zbal lazy memory through ``torch_npu`` with rank, world size and the CPU group.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pipeline.core.contracts import AttentionArgs, PoolFacts, SetupRequest
from pipeline.core.errors import BuildError, ConfigError
from pipeline.platforms import platform_for
from pipeline.platforms.musa import MusaPlatform
from pipeline.platforms.npu import NpuPlatform
from pipeline.platforms.xpu import XpuPlatform


class FakeDeviceModule(types.SimpleNamespace):
    """What a vendor plugin registers at ``torch.<type>``: records (name, args) per call."""

    def __init__(self, count=2, total=64 << 30, name="Fake Accel"):
        super().__init__(calls=[], count=count, total=total, name=name, current=0)

    def _rec(self, *call):
        self.calls.append(call)

    def is_available(self):
        self._rec("is_available")
        return self.count > 0

    def device_count(self):
        self._rec("device_count")
        return self.count

    def set_device(self, i):
        self._rec("set_device", i)
        self.current = i

    def current_device(self):
        return self.current

    def get_device_properties(self, i):
        self._rec("get_device_properties", i)
        return types.SimpleNamespace(name=f"{self.name} #{i}", total_memory=self.total, multi_processor_count=24,
                                     gpu_subslice_count=56)

    def memory_allocated(self, i):
        self._rec("memory_allocated", i)
        return 1234


@pytest.fixture
def vendor(monkeypatch):
    """Install a fake plugin module and a fake ``torch.<type>`` device module for one device type."""
    def install(dev_type, plugin, **kw):
        dev = FakeDeviceModule(**kw)
        monkeypatch.setattr(torch, dev_type, dev, raising=False)
        mod = types.ModuleType(plugin) if plugin else None
        if plugin:
            monkeypatch.setitem(sys.modules, plugin, mod)
        return dev, mod
    return install


@pytest.mark.parametrize("device,cls", [("musa:1", MusaPlatform), ("npu", NpuPlatform), ("xpu:0", XpuPlatform)])
def test_platform_for_vendor_devices(device, cls):
    assert type(platform_for(device)) is cls


def test_missing_plugin_is_a_typed_refusal(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ImportError
    with pytest.raises(ConfigError) as e:
        NpuPlatform().device_facts(0)
    assert e.value.info.code == "device_unavailable" and "torch_npu" in e.value.info.message
    assert "torch_npu" in e.value.info.remedy


def test_musa_facts_and_blas_order(vendor):
    dev, _ = vendor("musa", "torch_musa")
    p = MusaPlatform()
    gemms = []
    p.warm_gemm = lambda d: gemms.append(d)
    facts = p.device_facts(1)
    assert (facts.type, facts.index, facts.name, facts.vendor) == ("musa", 1, "Fake Accel #1", "mthreads")
    assert (facts.total_memory_bytes, facts.sm_count, facts.device_str) == (64 << 30, 24, "musa:1")
    assert p.init_blas() is True and gemms == ["musa:1"]
    assert dev.calls[:4] == [("is_available",), ("device_count",), ("set_device", 1), ("get_device_properties", 1)]
    assert p.memory_allocated(1) == 1234 and dev.calls[-1] == ("memory_allocated", 1)


@pytest.mark.parametrize("cls,dev_type,plugin", [(NpuPlatform, "npu", "torch_npu"), (XpuPlatform, "xpu", None)])
def test_no_blas_init_off_cuda_and_musa(vendor, cls, dev_type, plugin):
    dev, _ = vendor(dev_type, plugin)
    assert cls().init_blas() is False and dev.calls == []


def test_xpu_facts_use_subslices(vendor):
    dev, _ = vendor("xpu", None)
    f = XpuPlatform().device_facts(0)
    assert (f.type, f.vendor, f.sm_count) == ("xpu", "intel", 24)


def test_bad_index_names_the_devices(vendor):
    vendor("npu", "torch_npu", count=2)
    with pytest.raises(ConfigError) as e:
        NpuPlatform().device_facts(5)
    assert e.value.info.allowed == ["npu:0", "npu:1"]


def test_no_device_is_refused(vendor):
    vendor("musa", "torch_musa", count=0)
    with pytest.raises(ConfigError, match="reports no device"):
        MusaPlatform().device_facts(0)


def test_npu_zbal_calls_torch_npu_with_rank_world_and_group(vendor):
    _, mod = vendor("npu", "torch_npu")
    seen = []
    mod.npu = types.SimpleNamespace(init_zbal_lazy_mem=lambda n, **kw: seen.append((n, kw)))
    group = object()
    NpuPlatform().init_lazy_device_memory(4096, 3, 8, group)
    assert seen == [(4096, {"rank": 3, "world_size": 8, "group": group})]


def test_npu_zbal_missing_entry_point_is_a_typed_error(vendor):
    vendor("npu", "torch_npu")
    with pytest.raises(BuildError) as e:
        NpuPlatform().init_lazy_device_memory(4096, 0, 1, None)
    assert e.value.info.code == "npu_lazy_mem_unavailable" and "SGLANG_ZBAL_LOCAL_MEM_SIZE=0" in e.value.info.remedy


def test_lazy_memory_refused_off_npu(vendor):
    vendor("musa", "torch_musa")
    with pytest.raises(NotImplementedError):
        MusaPlatform().init_lazy_device_memory(1, 0, 1, None)


class NpuOnCpu(NpuPlatform):
    """The real NPU platform (fake torch_npu underneath) whose tensors live on the CPU."""

    def torch_device(self, index=0):
        return "cpu"


@pytest.mark.parametrize("draft,size,called", [(False, 8192, True), (True, 8192, False), (False, 0, False)])
def test_pipeline_on_npu_platform_calls_zbal_once(vendor, llama, draft, size, called):
    """Through the whole pipeline: zbal via torch_npu exactly when npu, size > 0 and not a draft worker."""
    dev, mod = vendor("npu", "torch_npu")
    order = []
    mod.npu = types.SimpleNamespace(init_zbal_lazy_mem=lambda n, **kw: order.append(("zbal", n, kw["rank"],
                                                                                     kw["world_size"], kw["group"])))
    from pipeline.setup.build import build_attention_backends

    group = object()
    req = SetupRequest(args=AttentionArgs(zbal_local_mem_size=size), model=llama, device="npu:1", rank=1,
                       world_size=2, is_draft_worker=draft,
                       pool=PoolFacts(max_reqs=2, max_context_len=32, num_token_slots=64))
    with build_attention_backends(req, platform=NpuOnCpu(), cpu_group=group) as out:
        assert out.attn_backend is not None
    assert order == ([("zbal", size, 1, 2, group)] if called else [])
    assert ("get_device_properties", 1) in dev.calls
