"""device-init: BLAS init on cuda/musa only (as sglang's ``init_cublas``), then record device facts."""

from __future__ import annotations

from pipeline.core.contracts import DeviceFacts
from pipeline.platforms.base import Platform

BLAS_DEVICES = ("cuda", "musa")


def decide_blas(device_type: str) -> bool:
    """Whether BLAS must be initialised on this device type (sglang: cuda and musa only)."""
    return device_type in BLAS_DEVICES


def apply(platform: Platform, index: int) -> tuple[DeviceFacts, bool]:
    """Initialise BLAS where the decision says so and read the device facts of ``index``."""
    facts = platform.device_facts(index)
    blas = platform.init_blas() if decide_blas(platform.device_type) else False
    return facts, blas
