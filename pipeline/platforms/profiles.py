"""Named device profiles for ``attn-setup plan``, and ``auto``: this machine, found without torch.

Memory in bytes as the vendor states it; ``sm_count``: SMs (compute units on AMD; ROCm's ``cuda`` arch ``sm94`` for
gfx942). ``auto`` (:func:`detect`): ``pynvml`` if importable, else ``nvidia-smi``, else ``cpu``.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Callable, Optional

import msgspec

from pipeline.core.contracts import DeviceFacts
from pipeline.core.errors import UsageError

GB, GiB = 10**9, 1 << 30

PROFILES: dict[str, DeviceFacts] = {
    "cpu": DeviceFacts(type="cpu", name="CPU host", vendor="", source="profile:cpu (any host; memory not modelled)"),
    "a100": DeviceFacts(type="cuda", name="NVIDIA A100-SXM4-80GB", vendor="nvidia", compute_capability=(8, 0),
                        sm_count=108, total_memory_bytes=80 * GiB,
                        source="profile:a100 (NVIDIA A100 datasheet / Ampere whitepaper: 108 SMs, 80 GB HBM2e, CC 8.0)"),
    "h100": DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", vendor="nvidia", compute_capability=(9, 0),
                        sm_count=132, total_memory_bytes=80 * GiB,
                        source="profile:h100 (NVIDIA H100 SXM5 datasheet / Hopper whitepaper: 132 SMs, 80 GB HBM3, "
                               "CC 9.0)"),
    "h200": DeviceFacts(type="cuda", name="NVIDIA H200", vendor="nvidia", compute_capability=(9, 0),
                        sm_count=132, total_memory_bytes=141 * GB,
                        source="profile:h200 (NVIDIA H200 SXM datasheet: 141 GB HBM3e; same GH100 die as H100 SXM: "
                               "132 SMs, CC 9.0)"),
    "l40s": DeviceFacts(type="cuda", name="NVIDIA L40S", vendor="nvidia", compute_capability=(8, 9),
                        sm_count=142, total_memory_bytes=48 * GB,
                        source="profile:l40s (NVIDIA L40S datasheet / Ada whitepaper: 142 SMs, 48 GB GDDR6, CC 8.9)"),
    "b200": DeviceFacts(type="cuda", name="NVIDIA B200", vendor="nvidia", compute_capability=(10, 0),
                        sm_count=148, total_memory_bytes=180 * GB,
                        source="profile:b200 (NVIDIA DGX B200 datasheet: 1,440 GB over 8 GPUs = 180 GB HBM3e each; "
                               "148 SMs; CC 10.0)"),
    "rtx-pro-6000": DeviceFacts(type="cuda", name="NVIDIA RTX PRO 6000 Blackwell", vendor="nvidia",
                                compute_capability=(12, 0), sm_count=188, total_memory_bytes=96 * GB,
                                source="profile:rtx-pro-6000 (NVIDIA RTX PRO 6000 Blackwell datasheet: 24,064 CUDA "
                                       "cores = 188 SMs, 96 GB GDDR7, CC 12.0)"),
    "mi300x": DeviceFacts(type="cuda", name="AMD Instinct MI300X", vendor="amd", compute_capability=(9, 4),
                          sm_count=304, total_memory_bytes=192 * GB,
                          source="profile:mi300x (AMD MI300X datasheet: 304 CUs, 192 GB HBM3; gfx942, which a ROCm "
                                 "torch reports as device type cuda with capability (9, 4))"),
    "ascend-910b": DeviceFacts(type="npu", name="Ascend 910B", vendor="huawei", total_memory_bytes=64 * GB,
                               source="profile:ascend-910b (Huawei Ascend 910B: 64 GB HBM2e; torch_npu device type "
                                      "npu, no compute capability; AI cores not modelled)"),
}

# nvidia-smi names → profile, to fill the SM count that NVML / nvidia-smi do not report.
_NAME_HINTS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("L40S", "l40s"), ("B200", "b200"),
               ("RTX PRO 6000", "rtx-pro-6000"))

NVIDIA_SMI_QUERY = "index,name,compute_cap,memory.total,driver_version"


def names() -> list[str]:
    """Profile names accepted by ``--device-profile`` (``auto`` included)."""
    return list(PROFILES) + ["auto"]


def get(name: str, *, detector: Optional[Callable[[], DeviceFacts]] = None) -> DeviceFacts:
    """The DeviceFacts of profile ``name`` (case-insensitive; ``auto`` runs :func:`detect` or ``detector``). Raises
    :class:`UsageError` (exit 2, ``unknown_profile``) naming the allowed ones."""
    given, name = name, name.strip().lower()
    if name == "auto":
        return (detector or detect)()
    if name not in PROFILES:
        raise UsageError(f"unknown device profile {given!r}", code="unknown_profile",
                         flags=[("--device-profile", given)], allowed=names(),
                         remedy="pass one of the named profiles, or auto for this machine")
    return PROFILES[name]


def _with_sm_count(facts: DeviceFacts) -> DeviceFacts:
    for hint, prof in _NAME_HINTS:
        if hint in facts.name and PROFILES[prof].compute_capability == facts.compute_capability:
            return msgspec.structs.replace(facts, sm_count=PROFILES[prof].sm_count)
    return facts


def from_nvml(index: int = 0) -> Optional[DeviceFacts]:
    """Facts of GPU ``index`` through NVML (``pynvml``), or None when NVML is not importable/usable."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h))
            mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return _with_sm_count(DeviceFacts(type="cuda", index=index, name=name, vendor="nvidia",
                                      compute_capability=(int(cc[0]), int(cc[1])), total_memory_bytes=mem,
                                      source="auto:nvml"))


def parse_nvidia_smi(text: str) -> Optional[DeviceFacts]:
    """Facts of the first GPU from ``nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits`` (index,
    name, compute_cap, memory MiB, driver), or None without a usable line."""
    for line in text.strip().splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 4:
            continue
        try:
            major, minor = (int(x) for x in cols[2].split("."))
            mem = int(float(cols[3])) * (1 << 20)
            index = int(cols[0])
        except ValueError:
            continue
        return _with_sm_count(DeviceFacts(type="cuda", index=index, name=cols[1], vendor="nvidia",
                                          compute_capability=(major, minor), total_memory_bytes=mem,
                                          source="auto:nvidia-smi"))
    return None


def from_nvidia_smi(timeout_s: float = 10.0) -> Optional[DeviceFacts]:
    """Facts of the first GPU through the ``nvidia-smi`` executable, or None when absent/failing."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(proc.stdout) if proc.returncode == 0 else None


def detect() -> DeviceFacts:
    """This machine's first accelerator without importing torch: NVML, else nvidia-smi, else cpu."""
    facts = from_nvml() or from_nvidia_smi()
    if facts is not None:
        return facts
    return msgspec.structs.replace(PROFILES["cpu"], source="auto:cpu (no NVML, no working nvidia-smi)")
