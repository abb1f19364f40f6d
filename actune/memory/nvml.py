"""The GPU as NVML sees it (pynvml, from the nvidia-ml-py package)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """What NVML reports about one GPU, or why there is none."""

    available: bool
    name: str = ""
    total: int = 0
    free: int = 0
    used: int = 0
    driver: str = ""
    reason: str = ""


def probe(index: int = 0) -> DeviceInfo:
    """Query GPU ``index`` through NVML; never raises (no GPU gives ``available=False``)."""
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - a declared dependency
        return DeviceInfo(False, reason=f"pynvml is not importable ({err})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return DeviceInfo(False, reason=f"no NVIDIA GPU or driver ({err})")
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return DeviceInfo(True, _text(name), int(mem.total), int(mem.free), int(mem.used),
                          _text(driver))
    except pynvml.NVMLError as err:
        return DeviceInfo(False, reason=f"NVML could not read GPU {index} ({err})")
    finally:
        pynvml.nvmlShutdown()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
