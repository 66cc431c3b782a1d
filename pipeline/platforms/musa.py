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
        self.device_module()
        import torch

        a = torch.ones((16, 16), dtype=torch.float16, device="musa")
        (a @ a).sum().item()
        return True
