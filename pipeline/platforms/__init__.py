"""Platforms: one implementation of :class:`Platform` per device type, chosen by :func:`platform_for`.

This replaces sglang's ``if device == "cuda" … elif "npu"`` chains. Importing this package does not
import torch; each platform imports it when it first touches the device.
"""

from __future__ import annotations

from pipeline.platforms.base import Platform
from pipeline.core.errors import ConfigError

__all__ = ["Platform", "platform_for", "parse_device"]


def parse_device(device: str) -> tuple[str, int]:
    """``"cuda:1"`` → ("cuda", 1); ``"cpu"`` → ("cpu", 0); ``"auto"`` → ("auto", 0).

    Raises ConfigError (``invalid_value``, flag ``device``) for a string that is not a device
    (:func:`pipeline.core.validation.check_device`), e.g. ``cuda:²``.
    """
    from pipeline.core.validation import check_device

    check_device(device)
    head, _, idx = device.partition(":")
    return head, int(idx) if idx else 0


_VENDOR = {"musa": ("pipeline.platforms.musa", "MusaPlatform"), "npu": ("pipeline.platforms.npu", "NpuPlatform"),
           "xpu": ("pipeline.platforms.xpu", "XpuPlatform")}


def platform_for(device: str) -> Platform:
    """The platform for a device string (``auto`` picks CUDA when torch sees a GPU, else CPU).

    musa/npu/xpu platforms import their vendor plugin lazily, when they first touch the device.
    Raises :class:`ConfigError` (``device_unavailable``) when the device type is not present.
    """
    kind, _ = parse_device(device)
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        from pipeline.platforms.cpu import CpuPlatform

        return CpuPlatform()
    if kind == "cuda":
        from pipeline.platforms.cuda import CudaPlatform

        return CudaPlatform()
    if kind in _VENDOR:
        import importlib

        mod, cls = _VENDOR[kind]
        return getattr(importlib.import_module(mod), cls)()
    raise ConfigError(
        f"device type {kind!r} has no platform on this machine",
        code="device_unavailable", flags=[("device", device)],
        allowed=["auto", "cpu", "cuda[:N]", "musa[:N]", "npu[:N]", "xpu[:N]"],
        remedy="pass device='cpu', or run on a machine with that accelerator and its torch plugin",
    )
