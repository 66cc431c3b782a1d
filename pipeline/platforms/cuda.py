"""CUDA platform (NVIDIA; ROCm builds of torch also report ``cuda`` and set ``vendor="amd"``), and the process's
CUDA-graph capture primitives: its one capture stream, the one-time priming, a capture with its warm-up."""

from __future__ import annotations

from typing import Any, Callable, Optional

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
        already). :func:`prime_capture`; called before the KV pool's budget is read."""
        self._torch()
        return prime_capture(index)


_STREAMS: dict[int, Any] = {}  # device index -> this process's capture stream
_PRIMED: dict[int, int] = {}  # device index -> device bytes the priming took (measured once)


def capture_stream(device: Any = None) -> Any:
    """This process's one capture stream on ``device`` (a ``torch.device``, index or None), as sglang: each new stream
    would cost the stream pool and a never-freed cuBLAS workspace again."""
    import torch

    idx = device if isinstance(device, int) else None if device is None else torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    s = _STREAMS.get(idx)
    if s is None:
        s = _STREAMS[idx] = torch.cuda.Stream(device=idx)
    return s


def prime_capture(device: Any = None) -> int:
    """Pay the process's one-time graph costs on ``device`` (stream pool, lazily loaded graph machinery; outside the
    allocator) before the pool budget is read; returns the free bytes they took, 0 when already primed."""
    import torch

    s = capture_stream(device)
    idx = s.device.index
    if idx in _PRIMED:
        return 0
    with torch.cuda.device(idx):
        torch.cuda.synchronize()
        free = int(torch.cuda.mem_get_info()[0])
        x = torch.zeros(1, device=s.device)
        capture_graph(lambda: x.add_(1), stream=s)
        torch.cuda.synchronize()
        _PRIMED[idx] = max(free - int(torch.cuda.mem_get_info()[0]), 0)
    return _PRIMED[idx]


def capture_graph(fn: Callable[[], Any], pool: Any = None, stream: Any = None) -> tuple[Any, Any]:
    """Capture ``fn`` into a ``torch.cuda.CUDAGraph`` after one side-stream warm-up: ``(graph, out)``, ``out`` rewritten
    by each replay. ``pool``: a shared ``graph_pool_handle()``; ``stream``: the same for every capture of a series
    (default :func:`capture_stream`). Raises what capture raises."""
    import torch

    side = stream if stream is not None else capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=side):
        out = fn()
    return g, out
