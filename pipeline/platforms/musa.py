"""Moore Threads MUSA platform (``torch_musa`` registers ``torch.musa``). Untested on hardware.

Besides CUDA, MUSA is the one device sglang initialises BLAS on (``init_cublas`` also runs for
``musa``): a tiny half-precision GEMM on the device creates the muBLAS handle up front.
"""

from __future__ import annotations

from pipeline.platforms.vendor import VendorPlatform


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
