"""Fixtures for the ebpf/ tests: skip reasons, unique cgroup names, CPU burners killed by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from ebpf.cgroups import CgroupLayout

FLATBUFFERS_REASON = "PyPI flatbuffers==25.12.19 (the snapshot runtime) is not installed"


def root_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (creates cgroups under /sys/fs/cgroup)"
    lay = CgroupLayout.detect()
    if lay.limit_via == "none":
        return "no cgroup cpu controller (v1 cpu or v2 cpu.max) on this host"
    return None


def ebpf_reason() -> str | None:
    why = root_reason()
    if why:
        return why
    from ebpf.programs import ebpf_unavailable

    why = ebpf_unavailable()
    return f"eBPF cannot load: {why}" if why else None


needs_root = pytest.mark.skipif(root_reason() is not None, reason=str(root_reason()))
needs_ebpf = pytest.mark.skipif(ebpf_reason() is not None, reason=str(ebpf_reason()))


@pytest.fixture
def cg_name():
    """A cgroup root name of our own (so tests never touch a running agent's adapter-gateway tree)."""
    return f"agw-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _join_cgroups(dirs):
    def preexec():
        for d in dirs:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    return preexec


class Burners:
    """Busy-loop processes started straight into a tenant's cgroups; killed by pid on teardown."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, mgr, tenant: str, n: int = 1) -> list[int]:
        dirs = [str(d) for d in mgr.paths(tenant).dirs()]
        for _ in range(n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               preexec_fn=_join_cgroups(dirs)))
        return [p.pid for p in self.procs[-n:]]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
        self.procs.clear()


@pytest.fixture
def burners():
    b = Burners()
    yield b
    b.stop()
