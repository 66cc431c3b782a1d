"""A fake platform for tests and replay: reports given DeviceFacts and records every call in order."""

from __future__ import annotations

from typing import Any, Optional

from pipeline.core.contracts import DeviceFacts


class FakePlatform:
    """Pretends to be ``facts.type`` with tensors on ``torch_device_str`` (CPU); ``free_bytes``: reported free memory;
    ``prime_bytes``: first ``prime_graph_capture``'s bytes; ``calls``: ``(method, args)`` in order."""

    def __init__(self, facts: DeviceFacts, torch_device_str: str = "cpu", free_bytes: Optional[int] = None,
                 prime_bytes: int = 0) -> None:
        self.facts = facts
        self.prime_bytes = prime_bytes
        if free_bytes is not None:  # only then a memory_available(index) probe (pools and ranks read it)
            self.memory_available = lambda index=0: self._record("memory_available", (index,), int(free_bytes))
        self.device_type = facts.type
        self._torch_device = torch_device_str
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def init_blas(self) -> bool:
        self.calls.append(("init_blas", ()))
        return self.device_type in ("cuda", "musa")

    def device_facts(self, index: int = 0) -> DeviceFacts:
        self.calls.append(("device_facts", (index,)))
        return self.facts

    def torch_device(self, index: int = 0) -> str:
        return self._torch_device

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None:
        self.calls.append(("init_lazy_device_memory", (nbytes, rank, world_size, cpu_group)))
        if self.device_type != "npu":
            raise NotImplementedError("lazy device memory (zbal) exists on NPU only")

    def memory_allocated(self, index: int = 0) -> int:
        return 0

    def prime_graph_capture(self, index: int = 0) -> int:
        """Recorded; ``prime_bytes`` on the first call, 0 after (as the CUDA platform: a process pays once)."""
        paid = 0 if self.called("prime_graph_capture") else self.prime_bytes
        return self._record("prime_graph_capture", (index,), paid)

    def _record(self, method: str, args: tuple[Any, ...], value: Any) -> Any:
        self.calls.append((method, args))
        return value

    def called(self, method: str) -> list[tuple[Any, ...]]:
        """Arguments of every call to ``method``, in order."""
        return [args for name, args in self.calls if name == method]
