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
from pipeline.platforms.vendor import MusaPlatform, NpuPlatform, XpuPlatform


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


# --- device_unavailable: what this machine can use, and why not the rest (item 12) ------------------
@pytest.fixture
def bare_host(monkeypatch):
    """A host with no accelerator: no CUDA device, no vendor plugin, ``torch.xpu`` with no device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for plugin in ("torch_npu", "torch_musa"):
        monkeypatch.setitem(sys.modules, plugin, None)  # import raises ImportError
    monkeypatch.setattr(torch, "xpu", FakeDeviceModule(count=0), raising=False)


@pytest.mark.parametrize("device", ["npu", "musa:0", "xpu", "cuda", "cuda:1", "mps"])
def test_unavailable_device_lists_only_what_this_host_can_use(bare_host, device):
    """``--device npu`` on a host without accelerators allows ``cpu`` only (never ``cuda[:N]``), and the message
    says why every other device type is not usable here."""
    from pipeline.platforms import parse_device

    with pytest.raises(ConfigError) as e:
        platform_for(device).device_facts(parse_device(device)[1])
    info = e.value.info
    assert info.code == "device_unavailable" and info.allowed == ["cpu"], info
    assert info.remedy.startswith("pass device='cpu', or ")
    kind = device.partition(":")[0]
    others = {"cuda": "torch sees no CUDA device", "musa": "its torch plugin torch_musa is not installed",
              "npu": "its torch plugin torch_npu is not installed", "xpu": "torch.xpu reports no device",
              "mps": "Apple MPS has no attn-setup platform"}
    for k, why in others.items():
        if k != kind:
            assert f"{k} ({why}" in info.message, (k, info.message)
    assert info.flags[0].name == "device" and info.flags[0].value.partition(":")[0] == kind


def test_unavailable_device_lists_the_devices_that_are_here(bare_host, monkeypatch, vendor):
    """With two CUDA GPUs and a MUSA plugin with one device, ``--device npu`` allows exactly those, and the
    remedy names the first accelerator."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    vendor("musa", "torch_musa", count=1)
    with pytest.raises(ConfigError) as e:
        platform_for("npu").device_facts(0)
    assert e.value.info.allowed == ["cpu", "cuda:0", "cuda:1", "musa:0"]
    assert e.value.info.remedy.startswith("pass device='cuda:0'")
    assert "npu" not in e.value.info.message.split("Not usable here:")[1].split("(")[0]


def test_backend_records_and_platforms_agree():
    """Every device type a backend record claims has a platform (``backends`` never lists a device ``--device``
    refuses for want of one), and every device type that parses is served by a platform or says why not."""
    from pipeline.backends import registry
    from pipeline.core.validation import DEVICE_TYPES
    from pipeline.platforms import _VENDOR, NO_PLATFORM

    served = {"cpu", "cuda", *_VENDOR}
    claimed = {d for n in registry.names() for d in registry.get(n).capability.devices}
    assert claimed <= served, claimed - served
    assert not claimed & set(NO_PLATFORM)
    assert set(DEVICE_TYPES) - {"auto"} == served | set(NO_PLATFORM)
