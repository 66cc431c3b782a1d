"""Intel XPU platform (``torch.xpu``, built into torch >= 2.4). Untested on hardware.

No BLAS warm-up (sglang does that on cuda/musa only) and no lazy device memory.
"""

from __future__ import annotations

from pipeline.platforms.vendor import VendorPlatform


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
