"""CUDA platform (NVIDIA; ROCm builds of torch also report ``cuda`` and set ``vendor="amd"``)."""

from __future__ import annotations

from typing import Any, Optional

from pipeline.core.contracts import DeviceFacts
from pipeline.core.errors import ConfigError


class CudaPlatform:
    """Platform for ``device=cuda[:N]``; facts come from ``torch.cuda.get_device_properties``."""

    device_type = "cuda"

    def _torch(self, device: str = "cuda"):
        import torch

        if not torch.cuda.is_available():
            from pipeline.platforms import _why_not, device_unavailable

            raise device_unavailable(device, _why_not("cuda")[1])
        return torch

    def init_blas(self) -> bool:
        """Create the cuBLAS handle with a tiny GEMM on the current device (as sglang's init_cublas)."""
        torch = self._torch()
        a = torch.ones((16, 16), dtype=torch.float16, device="cuda")
        (a @ a).sum().item()
        return True

    def device_facts(self, index: int = 0) -> DeviceFacts:
        torch = self._torch(f"cuda:{index}")
        if index >= torch.cuda.device_count():
            raise ConfigError(f"cuda:{index} does not exist (this machine has {torch.cuda.device_count()} GPUs)",
                              code="device_unavailable", flags=[("device", f"cuda:{index}")],
                              allowed=[f"cuda:{i}" for i in range(torch.cuda.device_count())],
                              remedy="pick an existing GPU index (LOCAL_RANK under torchrun)")
        torch.cuda.set_device(index)
        p = torch.cuda.get_device_properties(index)
        is_hip = getattr(torch.version, "hip", None) is not None
        return DeviceFacts(type="cuda", index=index, name=p.name, vendor="amd" if is_hip else "nvidia",
                           compute_capability=(p.major, p.minor), sm_count=p.multi_processor_count,
                           total_memory_bytes=p.total_memory, cuda_version=torch.version.cuda,
                           source="torch.cuda")

    def torch_device(self, index: int = 0) -> str:
        return f"cuda:{index}"

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None:
        raise NotImplementedError("lazy device memory (zbal) exists on NPU only")

    def memory_allocated(self, index: int = 0) -> int:
        return int(self._torch().cuda.memory_allocated(index))

    def memory_available(self, index: int = 0) -> int:
        """Device bytes free now (``torch.cuda.mem_get_info``: other processes' use counted too)."""
        return int(self._torch().cuda.mem_get_info(index)[0])

    def prime_graph_capture(self, index: int = 0) -> int:
        """Pay the process's one-time CUDA-graph costs on ``cuda:index`` now; the device bytes they took (0 when paid
        already). :func:`pipeline.runtime.cuda_graphs.prime_capture`; called before the KV pool's budget is read."""
        from pipeline.runtime.cuda_graphs import prime_capture

        self._torch()
        return prime_capture(index)
