"""Platforms: one :class:`Platform` per device type, chosen by :func:`platform_for` (no ``if device == …`` chains).
Importing this package does not import torch."""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from pipeline.core.contracts import DeviceFacts
from pipeline.core.errors import ConfigError


@runtime_checkable
class Platform(Protocol):
    """One device type's effects: ``init_blas()`` (True if it did anything; cuda/musa), ``device_facts(index)``,
    ``torch_device(index)`` (``"cuda:1"``), ``init_lazy_device_memory(nbytes, rank, world_size, cpu_group)`` (NPU only,
    before graph capture; else NotImplementedError), ``memory_allocated(index)`` (0 on CPU)."""

    device_type: str

    def init_blas(self) -> bool: ...

    def device_facts(self, index: int) -> DeviceFacts: ...

    def torch_device(self, index: int) -> str: ...

    def init_lazy_device_memory(self, nbytes: int, rank: int, world_size: int, cpu_group: Optional[Any]) -> None: ...

    def memory_allocated(self, index: int) -> int: ...


# Device types that parse (pipeline.core.validation.DEVICE_TYPES) but that no platform here serves, and why.
NO_PLATFORM = {"mps": "Apple MPS has no attn-setup platform and no backend record lists it"}


def parse_device(device: str) -> tuple[str, int]:
    """``"cuda:1"`` → ("cuda", 1); ``"cpu"`` → ("cpu", 0); ``"auto"`` → ("auto", 0). Raises ConfigError
    (``invalid_value``, flag ``device``) otherwise."""
    from pipeline.core.validation import check_device

    check_device(device)
    head, _, idx = device.partition(":")
    return head, int(idx) if idx else 0


_VENDOR = {"musa": ("pipeline.platforms.vendor", "MusaPlatform"), "npu": ("pipeline.platforms.vendor", "NpuPlatform"),
           "xpu": ("pipeline.platforms.vendor", "XpuPlatform")}  # imported when first asked for
PLATFORM_TYPES = ("cpu", "cuda", *_VENDOR)  # the device types with an attn-setup platform


def platform_for(device: str) -> Platform:
    """The platform for a device string (``auto``: CUDA when torch sees a GPU, else CPU); vendor plugins load lazily.
    Raises :class:`ConfigError` (``device_unavailable``) when the type is not present."""
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
    raise device_unavailable(device, NO_PLATFORM.get(kind, f"device type {kind!r} has no attn-setup platform"))


def _why_not(kind: str) -> tuple[int, str]:
    """(devices of ``kind`` torch sees here, why none when 0) — imports torch and, if installed, the vendor plugin."""
    import importlib

    import torch

    if kind == "cuda":
        if torch.cuda.is_available():
            return torch.cuda.device_count(), ""
        cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
        return 0, "torch sees no CUDA device" + (f": torch {torch.__version__} is a CPU-only build" if cpu_build
                                                 else "")
    mod_name, cls = _VENDOR[kind]
    plugin = getattr(importlib.import_module(mod_name), cls).plugin
    if plugin is not None:
        try:
            importlib.import_module(plugin)
        except ImportError:
            return 0, f"its torch plugin {plugin} is not installed"
        except Exception as e:  # noqa: BLE001 - a broken plugin is a reason, not a crash
            return 0, f"its torch plugin {plugin} does not import ({type(e).__name__}: {e})"
    mod = getattr(torch, kind, None)
    try:
        count = int(mod.device_count()) if mod is not None and mod.is_available() else 0
    except Exception as e:  # noqa: BLE001
        return 0, f"torch.{kind} fails ({type(e).__name__}: {e})"
    return (count, "") if count else (0, f"torch.{kind} reports no device")


def device_survey() -> tuple[list[str], dict[str, str]]:
    """``(usable, not_here)``: ``cpu`` and one ``<type>:<index>`` per device torch sees; each other type with why not.
    Imports torch: error paths only."""
    usable, not_here = ["cpu"], {}
    for kind in ("cuda", *_VENDOR):
        count, why = _why_not(kind)
        usable += [f"{kind}:{i}" for i in range(count)]
        if why:
            not_here[kind] = why
    return usable, {**not_here, **NO_PLATFORM}


def device_unavailable(device: str, why: str, install: str = "") -> ConfigError:
    """The ``device_unavailable`` ConfigError (returned) for ``device``: ``why``, ``allowed`` the usable devices, each
    other type's reason (:func:`device_survey`), a remedy picking a usable device, ``install`` the plugin, or for a type
    without platform the :data:`PLATFORM_TYPES`."""
    usable, not_here = device_survey()
    kind = device.partition(":")[0]
    others = ", ".join(f"{k} ({w})" for k, w in not_here.items() if k != kind)
    where = f"install torch with its {install} plugin on a machine with that accelerator" if install else \
        "run on a machine with that accelerator and its torch plugin"
    if kind not in PLATFORM_TYPES:  # no platform at all: no machine or plugin would make it usable
        where = f"use a device type attn-setup supports ({', '.join(PLATFORM_TYPES)}) on a machine that has it"
    return ConfigError(
        f"{device} cannot be used: {why}. Usable on this machine: {', '.join(usable)}"
        + (f". Not usable here: {others}" if others else ""),
        code="device_unavailable", flags=[("device", device)], allowed=usable,
        remedy=f"pass device='{usable[1] if len(usable) > 1 else 'cpu'}', or {where}")

