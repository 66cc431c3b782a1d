"""Ascend NPU platform (``torch_npu`` registers ``torch.npu``). Untested on hardware.

zbal lazy device memory: sglang initialises it on NPU, when ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` > 0 and
not on a draft worker, with the world group's rank, world size and CPU process group, before any
graph capture (the decision lives in :mod:`states.npu_lazy_mem`; this is the effect). The vendor
entry point is looked up by name on the imported ``torch_npu`` module — :data:`LAZY_MEM_ENTRY`,
overridable per instance — because its exact name was not verifiable without the hardware.
"""

from __future__ import annotations

from typing import Any, Optional

from pipeline.core.errors import BuildError
from pipeline.platforms.vendor import VendorPlatform

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
        """Call ``torch_npu.<lazy_mem_entry>(nbytes, rank=, world_size=, group=cpu_group)``.

        ``nbytes`` > 0 bytes of zbal local memory per device. Raises :class:`BuildError`
        (``npu_lazy_mem_unavailable``) when the installed ``torch_npu`` has no such entry point.
        """
        fn: Any = self.vendor_module()
        for part in self.lazy_mem_entry.split("."):
            fn = getattr(fn, part, None)
            if fn is None:
                raise BuildError(f"torch_npu has no {self.lazy_mem_entry} (zbal lazy memory)",
                                 code="npu_lazy_mem_unavailable", flags=[("zbal_local_mem_size", nbytes)],
                                 remedy="upgrade torch_npu, or set SGLANG_ZBAL_LOCAL_MEM_SIZE=0 to skip zbal")
        fn(int(nbytes), rank=int(rank), world_size=int(world_size), group=cpu_group)
