"""The embedded stack behind `adapterctl up` (and the end-to-end tests): simulators, processor, Envoy.

What: `Stack(config).start()` starts, in order, an embedded backend per backend when
`simulate=True` (an OpenAI API *simulator* for OpenAI/vLLM backends, our real ONNX Runtime
KServe server with demo models for KServe backends; the backends' endpoints are then pointed at
them, and this is logged),
the processor supervisor and its workers, then Envoy; it returns when Envoy's listener answers.
Envoy runs for the stack's whole life (one process, `--disable-hot-restart`) on a bootstrap whose
listener, routes, clusters and endpoints are files in `<run_dir>/xds/` (`extproc.xds`): `stack.xds`
writes them make before break, waiting on Envoy's admin stats, and the supervisor calls it after
every accepted reload (when it takes `xds=`; else `Stack.reload()` writes them itself), so a new
route, backend or endpoint needs no restart. `stop()` stops them in reverse order (Envoy
first, so no new request reaches a stopping processor), each bounded, killing what does not exit.
Every child dies with this process (PR_SET_PDEATHSIG), so nothing is left behind.
Why: one code path for `make run`, the tests and the benchmarks.
Cost: about 2 to 4 s to start on this machine (Python imports dominate).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from extproc.config.loader import load_file
from extproc.config.snapshot import Snapshot
from extproc.envoy_bin import find_envoy
from extproc.envoy_render import worker_count
from extproc.supervisor import Supervisor, die_with_parent
from extproc.xds import EnvoyAdminAck, XdsWriter, bootstrap_yaml

log = logging.getLogger("adapterctl.up")


PORT_SLICE_ENV = "ADAPTER_PORT_SLICE"  # "k/n": only ports whose 64-port block is k modulo n (parallel test runs)
_BLOCK = 64


def _port_slice() -> tuple[int, int] | None:
    """(k, n) from `ADAPTER_PORT_SLICE=k/n`, or None. Processes that pick ports at once (pytest-xdist
    workers, and what each starts: the variable is inherited) get disjoint ports: one process's chosen
    but not yet bound port is not free to another's choice, which the kernel's `bind(0)` cannot know."""
    raw = os.environ.get(PORT_SLICE_ENV)
    if not raw:
        return None
    k, sep, n = raw.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise ValueError(f"{PORT_SLICE_ENV}={raw!r}: expected k/n with 0 <= k < n")
    return int(k), int(n)


def _in_slice(port: int, width: int, where: tuple[int, int] | None) -> bool:
    """`width` ports from `port` lie in one 64-port block of this process's slice (any, without one)."""
    if where is None:
        return True
    k, n = where
    return (port // _BLOCK) % n == k and port % _BLOCK + width <= _BLOCK


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_FIXED_LOW = 20000  # below this, well-known services (Redis, Prometheus, brokers, databases) listen


def fixed_port_range(path: str = EPHEMERAL_RANGE) -> tuple[int, int] | None:
    """The ports the kernel never hands out by itself: between 20000 and the start of its ephemeral
    range (`ip_local_port_range`, 32768 by default), or above its end. A port chosen from the ephemeral
    range by `bind(0)` can be taken, before Envoy or a worker binds it, as the source port of any
    outgoing connection (a client's, Envoy's upstream's): a stack under load makes thousands. None when
    the file cannot be read or leaves fewer than 2048 such ports (then `bind(0)` is used)."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
    except (OSError, ValueError):
        return None
    if low - _FIXED_LOW >= 2048:
        return _FIXED_LOW, low - 1
    if 65535 - high >= 2048:
        return high + 1, 65535
    return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", avoid: frozenset[int] | set[int] = frozenset(), width: int = 1) -> int:
    """A port free now, other than those in `avoid`: ports a stack has chosen but not yet bound (its
    processor workers bind theirs after the simulators start) look free too. Chosen at random from
    `fixed_port_range()` and checked by binding it, so no outgoing connection takes it before its
    owner binds it; the kernel's `bind(0)` choice where there is no such range. With
    `ADAPTER_PORT_SLICE` set, one in this process's slice (`width` ports from it in one block)."""
    where = _port_slice()
    span = fixed_port_range()
    rng = random.Random()
    tries = 100 if where is None else 100 * where[1]
    for _ in range(tries):
        if span is None:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        else:
            port = rng.randint(span[0], span[1] - width + 1)
        if port in avoid or not _in_slice(port, width, where):
            continue
        if span is None or _bindable(host, port):
            return port
    raise RuntimeError(f"no free port outside the {len(avoid)} reserved ones"
                       + (f" in slice {where[0]}/{where[1]} ({PORT_SLICE_ENV})" if where else "")
                       + (f" in {span[0]}-{span[1]}" if span else ""))


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A base port with n consecutive free ports (for processor workers)."""
    for _ in range(200):
        base = free_port(host, width=n)
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind((host, base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what or url} exited with code {proc.returncode} during start-up")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code < 500:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.05)
    raise RuntimeError(f"{what or url} not ready after {timeout:g}s ({last})")


def stop_process(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGTERM this one process (by its handle: only what we started), wait bounded, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Stack:
    config_path: str
    simulate: bool | frozenset[str] = False  # True: every backend; or the names of those to simulate
    listen_port: int | None = None  # None: the config's
    admin_port: int | None = None
    processor_base_port: int | None = None
    processor_admin_port: int | None = None
    workers: int | None = None
    run_dir: str | None = None
    log_level: str = "warning"
    simulator_args: tuple[str, ...] = ()
    record_dir: str | None = None  # processor workers record every ProcessingRequest here
    agent: bool | None = None  # the tenant agent; None: when tenants have CPU limits and we are root
    agent_name: str = "adapter-gateway"  # cgroup root and snapshot name of the agent
    snapshot: Snapshot | None = field(default=None, init=False)
    simulators: dict[str, tuple[subprocess.Popen, int]] = field(default_factory=dict, init=False)
    supervisor: Supervisor | None = field(default=None, init=False)
    envoy: subprocess.Popen | None = field(default=None, init=False)
    agent_proc: subprocess.Popen | None = field(default=None, init=False)
    envoy_config: str = field(default="", init=False)
    xds: XdsWriter | None = field(default=None, init=False)  # writes Envoy's live config (extproc.xds)
    _endpoint_overrides: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict, init=False)
    _workers: int = field(default=0, init=False)
    _reserved: set[int] = field(default_factory=set, init=False)  # ports chosen for this stack, bound or not

    @property
    def envoy_pid(self) -> int | None:
        return self.envoy.pid if self.envoy is not None else None

    @property
    def url(self) -> str:
        return f"http://{self.snapshot.listener.address}:{self.snapshot.listener.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.snapshot.admin.address}:{self.snapshot.admin.port}"

    @property
    def processor_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.snapshot.processor.admin_port}"

    def start(self) -> "Stack":
        snap = load_file(self.config_path)  # ConfigError propagates: the caller exits non-zero
        try:
            self._start(snap)
        except BaseException:
            self.stop()
            raise
        return self

    def _apply(self, snap: Snapshot) -> Snapshot:
        """The stack's own ports and endpoints over a snapshot of the config file (the first one,
        and every reloaded one the supervisor hands to `self.xds`)."""
        proc = snap.processor
        processor = proc.model_copy(update={
            "workers": self._workers,
            "base_port": self.processor_base_port or proc.base_port,
            "admin_port": self.processor_admin_port or proc.admin_port,
        })
        snap = dataclasses.replace(
            snap, processor=processor,
            listener=snap.listener.model_copy(update={"port": self.listen_port or snap.listener.port}),
            admin=snap.admin.model_copy(update={"port": self.admin_port or snap.admin.port}),
        )
        overrides = {n: eps for n, eps in self._endpoint_overrides.items() if n in snap.backends}
        return snap.with_endpoints(overrides) if overrides else snap

    def _start(self, snap: Snapshot) -> None:
        workers = self._workers = worker_count(snap, self.workers)
        snap = self._apply(snap)
        processor = snap.processor
        overrides = self._endpoint_overrides
        # the stack's own ports, chosen but not bound until the processor and Envoy start: a simulator
        # must not get one of them from the kernel meanwhile (a worker then fails to bind, exit code 3)
        reserved = {snap.listener.port, snap.admin.port, processor.admin_port,
                    *range(processor.base_port, processor.base_port + workers)}
        self._reserved = reserved
        if self.simulate:
            chosen = set(snap.backends) if self.simulate is True else set(self.simulate)
            for name, backend in snap.backends.items():
                if name not in chosen:
                    continue
                port = free_port(avoid=reserved)
                reserved.add(port)
                if backend.adapter.api == "kserve":
                    self._start_ort(name, backend, port)
                    overrides[name] = (("127.0.0.1", port),)
                    continue
                models = sorted({r.model for r in snap.routes.values() if r.backend is backend and r.model}
                                | set(backend.models)) or ["default"]
                cmd = [sys.executable, "-m", "backends.simulator_openai", "--host", "127.0.0.1", "--port", str(port),
                       "--models", ",".join(models), "--log-level", self.log_level, *self.simulator_args]
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent, start_new_session=True)
                self.simulators[name] = (p, port)
                overrides[name] = (("127.0.0.1", port),)
                log.warning("backend %s -> OpenAI API simulator at 127.0.0.1:%d (simulated, not a real model)",
                            name, port)
            for name, (p, port) in self.simulators.items():
                health = "/v2/health/ready" if snap.backends[name].adapter.api == "kserve" else "/health"
                wait_http(f"http://127.0.0.1:{port}{health}", 60, p, f"embedded backend for {name}")
            snap = snap.with_endpoints(overrides)
        self.snapshot = snap
        self._start_agent(snap)

        run_dir = Path(self.run_dir or tempfile.mkdtemp(prefix="adapter-gateway-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        self.xds = XdsWriter(run_dir / "xds", transform=self._apply)
        self.xds.write(snap, workers, wait=False)  # Envoy reads these at start; the acks begin once it runs

        # the supervisor writes Envoy's config after every accepted reload, once its workers acknowledged
        self.supervisor = Supervisor(
            self.config_path, processor.bind_address or processor.address, processor.base_port, workers,
            processor.admin_port, shutdown_grace=processor.shutdown_grace, log_level=self.log_level,
            endpoints=overrides, record_dir=self.record_dir, xds=self.xds,
        )
        self.supervisor.start()

        self.envoy_config = str(run_dir / "envoy.yaml")
        Path(self.envoy_config).write_text(bootstrap_yaml(snap, workers, self.xds.dir))
        level = {"debug": "debug", "info": "info"}.get(self.log_level, "warning")
        self.envoy = subprocess.Popen(
            [find_envoy(), "-c", self.envoy_config, "--disable-hot-restart", "--concurrency", str(min(workers, 4)),
             "-l", level, "--log-format", "[envoy %l] %v"],
            preexec_fn=die_with_parent, start_new_session=True,
        )
        wait_http(f"{self.admin_url}/ready", 30, self.envoy, "envoy")
        wait_http(f"{self.url}/__adapter_not_a_route__", 10, self.envoy, "envoy listener")
        ack = EnvoyAdminAck(self.admin_url)
        rejected = ack.rejected(ack.baseline())
        if rejected:
            raise RuntimeError(f"Envoy rejected its initial config from {self.xds.dir}: {', '.join(rejected)}")
        self.xds.ack = ack

    def reload(self):
        """Reload the config file: the supervisor's `ReloadResult` (`accepted`, `generation`, `digest`,
        `workers`, `errors`). Workers load the new bundle first, then Envoy's files are rewritten."""
        return self.supervisor.reload()

    def _start_agent(self, snap: Snapshot) -> None:
        """The tenant agent (cgroups, eBPF CPU and RTT, the snapshot admission reads), before the processor."""
        wanted = self.agent
        if wanted is None:
            wanted = any(t.cpu is not None for t in snap.tenants) and os.geteuid() == 0
        if not wanted:
            return
        ports = sorted({p for b in snap.backends.values() for _, p in b.endpoints})
        cmd = [sys.executable, "-m", "ebpf.agent", "--tenants", self.config_path, "--name", self.agent_name,
               "--snapshot", snap.tenancy.snapshot, "--rtt-ports", ",".join(map(str, ports)) or "all", "--cleanup"]
        self.agent_proc = subprocess.Popen(cmd, preexec_fn=die_with_parent, start_new_session=True)
        deadline = time.monotonic() + 60
        while not Path(snap.tenancy.snapshot).exists():
            if self.agent_proc.poll() is not None:
                raise RuntimeError(f"tenant agent exited with code {self.agent_proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("tenant agent published no snapshot within 60s")
            time.sleep(0.1)
        log.warning("tenant agent running (pid %d), snapshot %s", self.agent_proc.pid, snap.tenancy.snapshot)

    def _start_ort(self, name: str, backend, port: int) -> None:
        """KServe backends get our real ONNX Runtime server with its demo models (real inference)."""
        repo = Path(self.run_dir or tempfile.mkdtemp(prefix="adapter-gateway-")) / f"models-{name}"
        http_port = free_port(avoid=self._reserved) if backend.protocol == "grpc" else port  # grpc: `port` is the gRPC one
        self._reserved.add(http_port)
        cmd = [sys.executable, "-m", "backends.onnxruntime", "--repository", str(repo), "--build-demo-models",
               "--host", "127.0.0.1", "--port", str(http_port), "--log-level", self.log_level]
        if backend.protocol == "grpc":
            cmd += ["--grpc-port", str(port)]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent, start_new_session=True)
        self.simulators[name] = (p, http_port)
        stand_in = " standing in for Triton (both speak KServe v2)" if backend.kind == "triton" else ""
        log.warning("backend %s -> ONNX Runtime KServe server at 127.0.0.1:%d with demo models%s", name, port,
                    stand_in)

    def stop(self) -> None:
        stop_process(self.envoy)
        if self.supervisor is not None:
            self.supervisor.stop()
        for p, _ in self.simulators.values():
            stop_process(p)
        stop_process(self.agent_proc)

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
