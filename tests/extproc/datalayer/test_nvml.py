"""NVML: the soft failure where there is no pynvml or no driver (its reason), and on a GPU host real readings."""

from __future__ import annotations

import importlib.util

import pytest

from extproc.datalayer.nvml import GpuStats, Nvml, NvmlReading, read_gpus

HAVE_PYNVML = importlib.util.find_spec("pynvml") is not None


def test_read_gpus_never_raises_and_explains_a_missing_gpu():
    reading = read_gpus()
    assert isinstance(reading, NvmlReading)
    if reading.ok:
        pytest.skip(f"this host has {len(reading.gpus)} GPU(s): the soft failure is not reachable here")
    assert reading.gpus is None
    if not HAVE_PYNVML:
        assert reading.reason.startswith("pynvml is not importable (No module named 'pynvml')")
        assert "nvidia-ml-py" in reading.reason
    else:  # the package without a driver: NVMLError_LibraryNotFound, DriverNotLoaded, ...
        assert reading.reason.startswith("NVML init failed: NVMLError")


def test_a_closed_handle_reads_soft():
    nvml = Nvml()
    first = nvml.read()
    nvml.close()
    nvml.close()  # twice is fine
    after = nvml.read()
    assert after.gpus is None
    assert after.reason == ("NVML is closed" if first.ok else first.reason)


def test_gpu_path_on_a_gpu_host():
    reading = read_gpus()
    if not reading.ok:
        print(f"no GPU path here: {reading.reason}")
        pytest.skip(f"no GPU: {reading.reason}")
    assert len(reading.gpus) >= 1
    for i, gpu in enumerate(reading.gpus):
        assert isinstance(gpu, GpuStats) and gpu.index == i
        assert gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.name
        assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.memory_free_bytes == gpu.memory_total_bytes - gpu.memory_used_bytes
        assert 0.0 <= gpu.utilization <= 1.0
    with Nvml() as nvml:  # one init, several reads
        assert [g.uuid for g in nvml.read().gpus] == [g.uuid for g in nvml.read().gpus]
