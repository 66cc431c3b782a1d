"""device-init: BLAS init on cuda/musa only (as sglang's ``init_cublas``); the device facts are recorded.

The decision only: the setup table's device-init step (:mod:`pipeline.setup.table`) reads the facts and
initialises BLAS through the platform.
"""

from __future__ import annotations

BLAS_DEVICES = ("cuda", "musa")


def decide_blas(device_type: str) -> bool:
    """Whether BLAS must be initialised on this device type (sglang: cuda and musa only)."""
    return device_type in BLAS_DEVICES
