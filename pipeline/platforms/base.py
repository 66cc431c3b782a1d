"""The Platform protocol: everything device-specific the pipeline needs."""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from pipeline.core.contracts import DeviceFacts


@runtime_checkable
class Platform(Protocol):
    """One device type's effects.

    - ``init_blas()``: initialise the BLAS handle (cuBLAS on cuda, muBLAS on musa) so the first
      GEMM is not timed into something else; returns True if it did anything (sglang does this
      only on cuda/musa).
    - ``device_facts(index)``: :class:`DeviceFacts` of device ``index``.
    - ``torch_device(index)``: the torch device string tensors go to (``"cuda:1"``).
    - ``init_lazy_device_memory(nbytes, rank, world_size, cpu_group)``: NPU zbal lazy memory
      (must run before CUDA/NPU graph capture); other platforms raise NotImplementedError.
    - ``memory_allocated(index)``: device bytes currently allocated by torch (0 on CPU).
    """

    device_type: str

    def init_blas(self) -> bool: ...

    def device_facts(self, index: int) -> DeviceFacts: ...

    def torch_device(self, index: int) -> str: ...

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None: ...

    def memory_allocated(self, index: int) -> int: ...
