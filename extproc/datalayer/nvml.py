"""Local GPUs through NVML: memory used / total and utilization per GPU, failing soft where there is none.

What: `read_gpus()` returns `NvmlReading(gpus, reason)`: on a host with an NVIDIA driver and the
`nvidia-ml-py` package (module `pynvml`), one `GpuStats` per device (index, UUID, name, memory
used and total in bytes from `nvmlDeviceGetMemoryInfo`, utilization 0..1 from
`nvmlDeviceGetUtilizationRates().gpu`, the percent of the last sample period in which a kernel
ran) and `reason=None`; elsewhere `gpus=None` and a `reason` saying why ("pynvml is not
importable ...", "NVML init failed: ..."). It never raises. `Nvml` keeps NVML initialised across
reads (`with Nvml() as n: n.read()`), which `read_gpus()` does once per call.
Why: engines export GPU state unevenly (Triton does, vLLM and SGLang do not); on a host where the
processor runs next to its engines NVML gives the memory headroom the GPU-memory scorer needs.
Off the request path: call it from a periodic task.
Cost: nvmlInit once (tens of ms); a read is three NVML calls per GPU (tens of microseconds each).
Package: nvidia-ml-py (13.615.71 on PyPI when this was written), not a dependency of the
processor; without it every read is the soft failure.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from types import ModuleType


@dataclasses.dataclass(frozen=True, slots=True)
class GpuStats:
    index: int
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: float  # 0..1

    @property
    def memory_free_bytes(self) -> int:
        return max(self.memory_total_bytes - self.memory_used_bytes, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class NvmlReading:
    gpus: tuple[GpuStats, ...] | None
    reason: str | None = None  # why gpus is None

    @property
    def ok(self) -> bool:
        return self.gpus is not None


def _import() -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module("pynvml"), None
    except ImportError as exc:
        return None, f"pynvml is not importable ({exc}); install nvidia-ml-py on GPU hosts"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """NVML initialised once; `read()` per call; `close()` shuts it down. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: ModuleType | None = None
        self._reason: str | None = None
        module, reason = _import()
        if module is None:
            self._reason = reason
            return
        try:
            module.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self._reason = f"NVML init failed: {type(exc).__name__}: {exc}"
            return
        self._nvml = module

    @property
    def reason(self) -> str | None:
        return self._reason

    def read(self) -> NvmlReading:
        with self._lock:
            nvml = self._nvml
            if nvml is None:
                return NvmlReading(None, self._reason or "NVML is closed")
            try:
                gpus = []
                for index in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                    gpus.append(GpuStats(index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                                         name=_text(nvml.nvmlDeviceGetName(handle)),
                                         memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
                                         utilization=min(max(float(rates.gpu) / 100.0, 0.0), 1.0)))
            except Exception as exc:  # noqa: BLE001 - a GPU lost or a driver reset: report, never raise
                return NvmlReading(None, f"NVML read failed: {type(exc).__name__}: {exc}")
            return NvmlReading(tuple(gpus))

    def close(self) -> None:
        with self._lock:
            nvml, self._nvml = self._nvml, None
            if nvml is not None:
                self._reason = "NVML is closed"
                try:
                    nvml.nvmlShutdown()
                except Exception:  # noqa: BLE001 - shutting down: nothing to do about it
                    pass

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_gpus() -> NvmlReading:
    """One reading of every local GPU (init, read, shutdown), or the reason there is none."""
    with Nvml() as nvml:
        return nvml.read()


__all__ = ["GpuStats", "Nvml", "NvmlReading", "read_gpus"]
