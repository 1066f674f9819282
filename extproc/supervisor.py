"""The processor supervisor: N worker processes, their shared metrics, ordered start and stop.

What: starts `python -m extproc worker` once per port (base_port, base_port+1, ...), each its own
endpoint in Envoy's processor cluster, waits until each prints `ready`, restarts a worker that dies,
forwards SIGHUP (config reload), and serves the admin port: `/metrics` (Prometheus, merged over the
workers through prometheus_client's multiprocess directory) and `/healthz` (200 when every worker
is alive). `stop()` sends SIGTERM to all, waits the grace period plus a margin, then kills.
Why: a Python process is one core; separate processes (not fork after gRPC init, which grpcio
forbids) listed as separate Envoy endpoints spread the load, since Envoy keeps one HTTP/2
connection per worker per endpoint. Workers die with the supervisor (PR_SET_PDEATHSIG), so no
process is left behind even on SIGKILL.
Cost: a thread per worker monitor and one for the admin server; nothing on the request path.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("extproc.supervisor")


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - non-Linux
        pass


@dataclass
class _Worker:
    index: int
    port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0


class Supervisor:
    def __init__(self, config_path: str, address: str, base_port: int, workers: int, admin_port: int,
                 shutdown_grace: float = 5.0, admin_address: str = "127.0.0.1", log_level: str = "info",
                 endpoints: dict[str, tuple[tuple[str, int], ...]] | None = None, record_dir: str | None = None):
        self.config_path = config_path
        self.address = address
        self.admin = (admin_address, admin_port)
        self.grace = shutdown_grace
        self.log_level = log_level
        self.endpoint_args = [a for name, eps in (endpoints or {}).items()
                              for a in ("--endpoint", f"{name}=" + ",".join(f"{h}:{p}" for h, p in eps))]
        if record_dir:
            self.endpoint_args += ["--record-dir", record_dir]
        self.workers = [_Worker(i, base_port + i) for i in range(workers)]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._metrics_dir = tempfile.mkdtemp(prefix="adapter-metrics-")
        self._http: ThreadingHTTPServer | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        try:
            for w in self.workers:
                self._spawn(w)
            deadline = time.monotonic() + timeout
            for w in self.workers:
                self._wait_ready(w, deadline)
            self._serve_admin()
        except BaseException:
            self.stop()
            raise
        for w in self.workers:
            threading.Thread(target=self._monitor, args=(w,), daemon=True, name=f"worker-{w.index}").start()

    def _spawn(self, w: _Worker) -> None:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self._metrics_dir, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "extproc", "--log-level", self.log_level, "worker",
               "--config", self.config_path, "--address", self.address, "--port", str(w.port),
               "--index", str(w.index), "--shutdown-grace", str(self.grace), *self.endpoint_args]
        w.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, preexec_fn=die_with_parent, text=True,
                                  start_new_session=True)

    def _wait_ready(self, w: _Worker, deadline: float) -> None:
        assert w.proc is not None and w.proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(w.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        line = result[0] if result else ""
        if not line.startswith("ready"):
            code = w.proc.poll()
            raise RuntimeError(f"processor worker {w.index} (port {w.port}) did not start"
                               + (f": exited with code {code}" if code is not None else ": timed out"))
        # Keep draining stdout so a stray print can never block the worker.
        threading.Thread(target=lambda: [None for _ in w.proc.stdout], daemon=True).start()

    def _monitor(self, w: _Worker) -> None:
        while not self._stopping.is_set():
            proc = w.proc
            if proc is None:
                return
            code = proc.wait()
            if self._stopping.is_set():
                return
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(proc.pid, self._metrics_dir)
            w.restarts += 1
            delay = min(0.2 * 2 ** min(w.restarts, 5), 5.0)
            log.error("worker %d (pid %d) exited with %s; restarting in %.1fs", w.index, proc.pid, code, delay)
            time.sleep(delay)
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn(w)
            try:
                self._wait_ready(w, time.monotonic() + 30)
            except RuntimeError as e:
                log.error("%s", e)

    def reload(self) -> None:
        """Ask every worker to reload the config file (each keeps its last good config on error)."""
        for w in self.workers:
            if w.proc and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
        for w in self.workers:
            if w.proc and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace + 2.0
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop within the grace period; killing", w.index)
                w.proc.kill()
                w.proc.wait()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def alive(self) -> bool:
        return all(w.proc is not None and w.proc.poll() is None for w in self.workers)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc]

    # -- admin -----------------------------------------------------------------------------
    def _serve_admin(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

        sup = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path.split("?")[0] == "/metrics":
                    registry = CollectorRegistry()
                    multiprocess.MultiProcessCollector(registry, path=sup._metrics_dir)
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif self.path.split("?")[0] in ("/healthz", "/readyz"):
                    ok = sup.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"worker down\n", "text/plain")
                else:
                    self._send(404, b"not found: try /metrics or /healthz\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(self.admin, Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="admin").start()
