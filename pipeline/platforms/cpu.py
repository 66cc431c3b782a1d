"""CPU platform: no BLAS handle to warm, no lazy device memory."""

from __future__ import annotations

import os
import platform as _pyplatform
from typing import Any, Optional

from pipeline.core.contracts import DeviceFacts


class CpuPlatform:
    """Platform for ``device=cpu`` (host RAM is reported as the device memory)."""

    device_type = "cpu"

    def init_blas(self) -> bool:
        return False

    def device_facts(self, index: int = 0) -> DeviceFacts:
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            mem = 0
        return DeviceFacts(type="cpu", index=0, name=_pyplatform.processor() or _pyplatform.machine(),
                           vendor="", sm_count=os.cpu_count() or 1, total_memory_bytes=mem, source="os")

    def torch_device(self, index: int = 0) -> str:
        return "cpu"

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None:
        raise NotImplementedError("lazy device memory (zbal) exists on NPU only")

    def memory_allocated(self, index: int = 0) -> int:
        return 0

    def memory_available(self, index: int = 0) -> int:
        """Host bytes free now (``MemAvailable``), what CPU pools are checked against before allocation."""
        from pipeline.platforms.cpu import host_available_bytes

        return host_available_bytes()


def host_available_bytes() -> int:
    """Host memory the kernel could hand out now: ``MemAvailable`` from /proc/meminfo (Linux),
    else free physical pages (``os.sysconf``); 0 when unknown."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
