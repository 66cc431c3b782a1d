"""The vendor platforms whose torch support ships as a plugin module: MUSA, Ascend NPU and Intel XPU
(docs/internals.md)."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from pipeline.core.contracts import DeviceFacts
from pipeline.core.errors import BuildError, ConfigError


class VendorPlatform:
    """Base of the plugin-backed platforms: ``device_type``, ``plugin`` (import name; None = built into torch),
    ``vendor``."""

    device_type = "?"
    plugin: Optional[str] = None
    vendor = ""

    def __init__(self) -> None:
        self._plugin_mod: Any = None

    def _unavailable(self, why: str, device: str = "") -> ConfigError:
        """``device_unavailable`` naming ``why`` and what this machine can use instead
        (:func:`pipeline.platforms.device_unavailable`)."""
        from pipeline.platforms import device_unavailable

        return device_unavailable(device or self.device_type, why, install=self.plugin or self.device_type)

    def vendor_module(self, device: str = "") -> Any:
        """The imported plugin module (imported once; raises ConfigError when it is not installed)."""
        if self._plugin_mod is None and self.plugin is not None:
            try:
                self._plugin_mod = importlib.import_module(self.plugin)
            except ImportError as e:
                raise self._unavailable(f"{self.plugin} cannot be imported ({e})", device) from e
        return self._plugin_mod

    def device_module(self, device: str = "") -> Any:
        """``torch.<device_type>`` after the plugin registered it; ConfigError (naming ``device``, default the
        bare type) when absent or no device."""
        self.vendor_module(device)
        import torch

        mod = getattr(torch, self.device_type, None)
        if mod is None or not mod.is_available():
            raise self._unavailable(f"torch.{self.device_type} reports no device", device)
        return mod

    def init_blas(self) -> bool:
        """No BLAS handle to warm (sglang initialises BLAS on cuda and musa only)."""
        return False

    def device_facts(self, index: int = 0) -> DeviceFacts:
        """Facts of device ``index`` from the device module's ``get_device_properties``."""
        mod = self.device_module(f"{self.device_type}:{index}")
        count = int(mod.device_count())
        if not 0 <= index < count:
            raise ConfigError(f"{self.device_type}:{index} does not exist (this machine has {count})",
                              code="device_unavailable", flags=[("device", f"{self.device_type}:{index}")],
                              allowed=[f"{self.device_type}:{i}" for i in range(count)],
                              remedy="pick an existing device index (LOCAL_RANK under torchrun)")
        mod.set_device(index)
        p = mod.get_device_properties(index)
        return DeviceFacts(type=self.device_type, index=index, name=str(getattr(p, "name", "")), vendor=self.vendor,
                           sm_count=int(getattr(p, "multi_processor_count", 0) or 0),
                           total_memory_bytes=int(getattr(p, "total_memory", 0) or 0),
                           source=f"torch.{self.device_type}")

    def torch_device(self, index: int = 0) -> str:
        return f"{self.device_type}:{index}"

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None:
        raise NotImplementedError("lazy device memory (zbal) exists on NPU only")

    def memory_allocated(self, index: int = 0) -> int:
        return int(self.device_module().memory_allocated(index))


class MusaPlatform(VendorPlatform):
    """Platform for ``device=musa[:N]``."""

    device_type = "musa"
    plugin = "torch_musa"
    vendor = "mthreads"

    def init_blas(self) -> bool:
        """Create the muBLAS handle with a 16x16 fp16 GEMM on the current MUSA device; returns True."""
        mod = self.device_module()
        self.warm_gemm(f"musa:{int(mod.current_device())}")
        return True

    def warm_gemm(self, device: str) -> None:
        """One tiny GEMM on ``device`` (the first GEMM creates the BLAS handle)."""
        import torch

        a = torch.ones((16, 16), dtype=torch.float16, device=device)
        (a @ a).sum().item()


LAZY_MEM_ENTRY = "npu.init_zbal_lazy_mem"


class NpuPlatform(VendorPlatform):
    """Platform for ``device=npu[:N]``; ``lazy_mem_entry`` is the dotted attribute path under ``torch_npu``."""

    device_type = "npu"
    plugin = "torch_npu"
    vendor = "huawei"

    def __init__(self, lazy_mem_entry: str = LAZY_MEM_ENTRY) -> None:
        super().__init__()
        self.lazy_mem_entry = lazy_mem_entry

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None:
        """``torch_npu.<lazy_mem_entry>(nbytes, rank=, world_size=, group=cpu_group)``, ``nbytes`` > 0. Raises
        :class:`BuildError` (``npu_lazy_mem_unavailable``) without that entry point."""
        fn: Any = self.vendor_module()
        for part in self.lazy_mem_entry.split("."):
            fn = getattr(fn, part, None)
            if fn is None:
                raise BuildError(f"torch_npu has no {self.lazy_mem_entry} (zbal lazy memory)",
                                 code="npu_lazy_mem_unavailable", flags=[("zbal_local_mem_size", nbytes)],
                                 remedy="upgrade torch_npu, or set SGLANG_ZBAL_LOCAL_MEM_SIZE=0 to skip zbal")
        fn(int(nbytes), rank=int(rank), world_size=int(world_size), group=cpu_group)


class XpuPlatform(VendorPlatform):
    """Platform for ``device=xpu[:N]``; ``sm_count`` is ``gpu_subslice_count`` when reported."""

    device_type = "xpu"
    plugin = None
    vendor = "intel"

    def device_facts(self, index: int = 0):
        facts = super().device_facts(index)
        props = self.device_module().get_device_properties(index)
        subslices = int(getattr(props, "gpu_subslice_count", 0) or 0)
        if subslices and not facts.sm_count:
            import msgspec

            facts = msgspec.structs.replace(facts, sm_count=subslices)
        return facts

