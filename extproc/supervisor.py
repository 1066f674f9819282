"""The processor supervisor: N worker processes on one config generation, shared metrics, ordered start and stop.

What: loads and validates the config file once and publishes it as an immutable bundle
(extproc/config/bundle.py) under a bundle root; starts `python -m extproc worker --bundle-root ROOT`
once per port (base_port, base_port+1, ...), each its own endpoint in Envoy's processor cluster,
and waits until each prints `ready`. `reload()` validates the file again: a refused file is logged
once and changes nothing; an accepted one becomes the next generation's bundle, every live worker
gets SIGHUP and loads it, and the supervisor waits (bounded) until each acknowledges on stdout
(`loaded generation=G digest=D`), then hands the snapshot to the xDS writer when there is one
(workers first, Envoy second). A worker that dies is restarted on the last accepted bundle, never
on the raw file. The admin port serves `/metrics` (Prometheus, merged over the workers through
prometheus_client's multiprocess directory, plus the per-worker config generation),
`/healthz` (200 when every worker is alive), `GET /config` and `POST /reload`, and the canary
controller's `GET /canary[/NAME]` and `POST /canary/NAME/ACTION` (promote, rollback, pause, resume).
Canary control (`canary/control.py`): the supervisor owns one `Controller`; before every publish
(generation 1 and each reload) the config file is compiled once more to reconcile the controller
with its rollouts, and the bundle is published with the step plans' current weights overriding the
file's (`publish(..., rollouts=...)`); a thread ticks the controller (reads every worker's feed
file, judges, advances the plans) and, when a plan's weights changed, republishes through
`reload()`: the same make-before-break path, workers first, Envoy second. Plan state lives in
`spec.processor.stateDir` (default `.adapter-state` beside the config file; the `state_dir`
argument overrides it), read once at start.
Adapter bundles (`POST /bundles` with a ZIP as the body, `adapterctl bundle load`): verified
(canary/bundle.py), preloaded in the sandbox (canary/preload.py: compiled with the config, golden
cases run), then kept in `<stateDir>/bundles/` (`loaded.json` lists them, oldest first, so a
restarted supervisor serves them again) and published as the next generation, the loaded ZIPs copied
into the config bundle (`publish(..., loaded=...)`); a refusal (422, with the stage and the reasons)
changes nothing. `GET /bundles`: what the accepted snapshot holds and uses. Bundles the config file
names (`spec.bundles[].path`) with content the accepted generation lacks run the same preload before
generation 1 or a reload is published (a failure refuses it).
Rolling restart (`POST /restart`, `adapterctl restart --rolling`): each worker in turn is stopped with
its drain (SIGTERM: NOT_SERVING, then the shutdown grace) and replaced by a fresh process on the same
port, waited for until ready, then ROLLING_SETTLE seconds before the next; reloads wait meanwhile.
`stop()` sends SIGTERM to all, waits the grace period plus a margin, then kills.
Why: a Python process is one core; separate processes (not fork after gRPC init, which grpcio
forbids) listed as separate Envoy endpoints spread the load. One writer of config generations
means every worker serves the same one, and a laggard is visible. Workers die with the supervisor
(PR_SET_PDEATHSIG), so no process is left behind even on SIGKILL.
Cost: a thread per worker monitor, one per worker stdout and one for the admin server; nothing on
the request path.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from extproc.config.bundle import Bundle, publish
from extproc.config.loader import ConfigError

if TYPE_CHECKING:
    from extproc.config.snapshot import Snapshot

log = logging.getLogger("extproc.supervisor")

ACK_TIMEOUT = 10.0  # how long reload() waits for every worker's acknowledgement
CANARY_RETRY = 5.0  # seconds between attempts to publish a plan's weights while the config file is refused
LOADED_INDEX = "loaded.json"  # <stateDir>/bundles/: the loaded adapter bundles' file names, oldest first
MAX_POST_BYTES = 64 << 20  # the admin port's largest request body (a bundle ZIP: canary.bundle.Limits.max_zip_bytes)
ROLLING_SETTLE = 1.5  # after a replaced worker is ready: Envoy's processor health check (1 s interval) sees it
_READY = re.compile(r"^ready (\S+) generation=(\d+) digest=([0-9a-f]+)$")
_LOADED = re.compile(r"^loaded generation=(\d+) digest=([0-9a-f]+)$")
_REFUSED = re.compile(r"^refused generation=(\S+): (.*)$")


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - non-Linux
        pass


STABLE_S = 60.0  # a worker that ran this long before exiting is restarted without back-off


def restart_delay(crashes: int) -> float:
    """Seconds before restarting a worker after `crashes` exits in a row: 0.4, 0.8, 1.6, 3.2, then 5."""
    return min(0.2 * 2 ** min(crashes, 5), 5.0)


@dataclass
class _Worker:
    index: int
    port: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    crashes: int = 0  # exits in a row, each within STABLE_S of its start (the restart back-off's exponent)
    spawned_at: float = 0.0  # monotonic time its current process started
    # what the worker said on stdout (reset when it is respawned)
    ready: bool = False
    generation: int | None = None
    digest: str | None = None
    changed: float | None = None  # wall time its (generation, digest) last changed
    last: str = ""  # "ready", "loaded" or "refused": its last protocol line
    refused: tuple[str, str] | None = None  # (generation, reason) of its last refusal
    events: int = 0  # protocol lines seen from this process
    replacing: bool = False  # a rolling restart is replacing this process (the monitor must not respawn it)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True)
class ReloadResult:
    accepted: bool
    generation: int  # the generation now accepted (the kept one when refused)
    digest: str
    snapshot: Any  # the new Snapshot when accepted, else None
    workers: dict[int, int] = field(default_factory=dict)  # worker index -> generation it acknowledged
    errors: str = ""  # the refusal's issues, or workers that lagged; empty when all is well

    def to_json(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "generation": self.generation, "digest": self.digest,
                "workers": {str(i): g for i, g in sorted(self.workers.items())}, "errors": self.errors,
                "issues": [line for line in self.errors.splitlines() if line.strip()]}


def describe(result: ReloadResult) -> str:
    """One line for logs and `adapterctl`: what a reload did."""
    if not result.accepted:
        return f"config reload refused, keeping generation {result.generation} (digest {result.digest})"
    workers = " ".join(f"{i}={g}" for i, g in sorted(result.workers.items())) or "none"
    line = f"config reload accepted: generation {result.generation} (digest {result.digest}); workers {workers}"
    return line + (f"; {'; '.join(result.errors.splitlines())}" if result.errors else "")


class Supervisor:
    def __init__(self, config_path: str, address: str, base_port: int, workers: int, admin_port: int,
                 shutdown_grace: float = 5.0, admin_address: str = "127.0.0.1", log_level: str = "info",
                 endpoints: dict[str, tuple[tuple[str, int], ...]] | None = None, record_dir: str | None = None,
                 xds: Any = None, bundle_root: str | None = None, state_dir: str | None = None):
        """`xds`: an object with `write(snapshot, workers)` (extproc.xds.XdsWriter), called after
        the workers have a new generation. `bundle_root`: where bundles are published (default: a
        temporary directory removed by stop()). `state_dir`: canary plan state (default: the config's
        `spec.processor.stateDir`, else `.adapter-state` beside the config file)."""
        self.config_path = config_path
        self.address = address
        self.admin = (admin_address, admin_port)
        self.grace = shutdown_grace
        self.log_level = log_level
        self.endpoints = dict(endpoints or {})
        self.worker_args = ["--record-dir", record_dir] if record_dir else []
        self.xds = xds
        self.workers = [_Worker(i, base_port + i) for i in range(workers)]
        self._own_root = bundle_root is None
        self.bundle_root = bundle_root or tempfile.mkdtemp(prefix="adapter-bundles-")
        self._bundle: Bundle | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # spawn vs stop
        self._reload_lock = threading.Lock()  # one reload at a time
        self._cond = threading.Condition()  # workers' protocol state and the accepted snapshot
        self._reloads = {"accepted": 0, "refused": 0}
        self._last_refusal: dict[str, Any] | None = None
        self._processor_tls: str | None = None  # spec.processor.tls at the first worker start (JSON or "off")
        self._accepted_at: float | None = None
        self._metrics_dir = tempfile.mkdtemp(prefix="adapter-metrics-")
        self._http: ThreadingHTTPServer | None = None
        self._state_dir = state_dir
        self.controller: Any = None  # canary.control.Controller, made by start()
        self._pending: Any = None  # the controller's reconciliation for the bundle being published
        self._loaded: list[str] = []  # adapter bundle ZIPs loaded at run time, oldest first (state dir bundles/)
        self._bundle_lock = threading.Lock()  # one adapter bundle load at a time
        self._restarts = {"rolling": 0}
        self.preload_limits: Any = None  # canary.preload.SandboxLimits (None: its defaults)
        self.batch_control: Any = None  # extproc.qos.batch_control.BatchControlRuntime, once a config asks

    @property
    def feed_dir(self) -> str:
        """Where the workers write gateway-wide state (in-flight table, canary feed): ADAPTER_STATE_DIR."""
        return os.path.join(self._metrics_dir, "state")

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        """Publish generation 1 (a `ConfigError` propagates), start the workers on it, wait for
        each `ready`, hand the snapshot to xDS, serve the admin port."""
        try:
            rollouts = self._prepare_rollouts()
            self._loaded = self._read_loaded()
            self._preload_declared(set())
            bundle = publish(self.bundle_root, self.config_path, 1, self.endpoints, rollouts=rollouts,
                             loaded=tuple(self._loaded))
            assert bundle is not None
            with self._cond:
                self._bundle = bundle
                self._accepted_at = time.time()
            log.info("config %s: generation 1 (digest %s) published as %s", self.config_path, bundle.digest,
                     bundle.path)
            for w in self.workers:
                self._spawn(w)
            deadline = time.monotonic() + timeout
            for w in self.workers:
                self._wait_ready(w, deadline)
            self._commit_rollouts(bundle.snapshot)
            self._configure_batch_control(bundle.snapshot)
            if self.xds is not None:
                self.xds.write(bundle.snapshot, len(self.workers))
            self._serve_admin()
        except BaseException:
            self.stop()
            raise
        for w in self.workers:
            threading.Thread(target=self._monitor, args=(w,), daemon=True, name=f"worker-{w.index}").start()
        threading.Thread(target=self._canary_loop, daemon=True, name="canary-control").start()

    # -- canary control --------------------------------------------------------------------
    def _prepare_rollouts(self) -> dict[str, Any] | None:
        """Reconcile the controller with the config file's rollouts; the weight overrides to publish."""
        from canary.control import Controller, Pending, default_state_dir
        from extproc.config.loader import load_file, parse_text, read_config

        model, _ = parse_text(read_config(self.config_path), self.config_path)
        if self.controller is None:
            self.controller = Controller(default_state_dir(self.config_path, self._state_dir
                                                           or model.spec.processor.state_dir), self.feed_dir)
        if not any(r.plan is not None for r in model.spec.rollouts):
            self._pending = Pending({}, tuple(r.name for r in model.spec.rollouts), [])
            return None
        preview = load_file(self.config_path, 1, dict(self.endpoints) or None)
        self._pending = self.controller.prepare(preview)
        return self._pending.overrides() or None

    def _commit_rollouts(self, snapshot: "Snapshot") -> None:
        pending, self._pending = self._pending, None
        if pending is not None and self.controller is not None:
            self.controller.commit(pending)
            self.controller.set_manual(snapshot)

    def _canary_loop(self) -> None:
        """Tick the controller; republish when a plan's weights changed (or a publish is owed)."""
        ctl = self.controller
        retry_at = 0.0  # after a refused republish (the file no longer compiles): retried every CANARY_RETRY s
        while ctl is not None and not self._stopping.wait(max(0.05, min(ctl.interval / 4, 0.25))):
            if not ctl.controlled:
                continue
            try:
                changed = ctl.tick()
                if (changed or (ctl.needs_apply() and time.monotonic() >= retry_at)) and not self._stopping.is_set():
                    result = self.reload(reason="canary")
                    retry_at = 0.0 if result.accepted else time.monotonic() + CANARY_RETRY
            except Exception:  # noqa: BLE001 - the loop must outlive one bad tick
                log.exception("canary controller tick failed")

    def _configure_batch_control(self, snapshot: "Snapshot") -> None:
        """Run the batch controllers `spec.qos.batchControl` asks for (docs/qos.md "Batch policies"):
        one thread per endpoint and model, here and not in the workers, so one per gateway acts."""
        from extproc.qos.batch_control import BatchControlRuntime, plans_from

        plans = plans_from(snapshot.spec.spec.qos, snapshot.backends)
        if plans and self.batch_control is None:
            self.batch_control = BatchControlRuntime()
        if self.batch_control is not None:
            self.batch_control.configure(plans)

    def canary_action(self, name: str, action: str, reason: str = "") -> dict[str, Any]:
        """An operator's action on a rollout's plan, applied at once (a republish)."""
        assert self.controller is not None, "start() first"
        event = self.controller.action(name, action, reason)
        result = self.reload(reason="canary")
        return {"event": event, "applied": result.accepted and not self.controller.needs_apply(),
                "reload": result.to_json(), "status": self.controller.status(name)[name]}

    # -- adapter bundles loaded at run time -------------------------------------------------
    @property
    def loaded_dir(self) -> str:
        """Where loaded adapter bundles are kept: `<stateDir>/bundles/` (with `loaded.json`, their order)."""
        assert self.controller is not None, "start() first"
        return os.path.join(str(self.controller.state_dir), "bundles")

    def _read_loaded(self) -> list[str]:
        """The loaded bundles saved by an earlier run (those whose file is gone are dropped, logged)."""
        index = os.path.join(self.loaded_dir, LOADED_INDEX)
        try:
            with open(index) as f:
                names = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            log.error("%s: unreadable (%s); starting without loaded adapter bundles", index, e)
            return []
        paths = [os.path.join(self.loaded_dir, n) for n in names if isinstance(n, str) and "/" not in n]
        kept = [p for p in paths if os.path.isfile(p)]
        for p in sorted(set(paths) - set(kept)):
            log.error("loaded adapter bundle %s is gone; not served", p)
        return kept

    def _write_loaded(self, paths: list[str]) -> None:
        os.makedirs(self.loaded_dir, exist_ok=True)
        index = os.path.join(self.loaded_dir, LOADED_INDEX)
        tmp = f"{index}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump([os.path.basename(p) for p in paths], f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, index)

    def load_adapter_bundle(self, data: bytes) -> dict[str, Any]:
        """Load an adapter bundle (the ZIP's bytes) into the running gateway: verified, preloaded in the
        sandbox (canary/preload.py: compiled with the config and the bundles loaded before, its golden
        cases run), then kept in the state directory and published as the next generation (every worker,
        then Envoy). Refused at any step: nothing changes, and the answer says why."""
        from canary.bundle import BundleError, Limits, load
        from canary.preload import SandboxLimits, preload

        with self._bundle_lock:
            os.makedirs(self.loaded_dir, exist_ok=True)
            if len(data) > Limits().max_zip_bytes:
                return {"accepted": False, "stage": "verify", "problems": [f"bundle: size: {len(data)} bytes, more "
                        f"than max_zip_bytes {Limits().max_zip_bytes}"], "generation": self.snapshot.generation}
            fd, incoming = tempfile.mkstemp(prefix=".incoming-", suffix=".zip", dir=self.loaded_dir)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            keep = False
            try:
                try:
                    b = load(incoming)  # hashes and paths; the signature is checked by the preload's compile
                except BundleError as e:
                    return self._refused("verify", [str(p) for p in e.problems])
                ref = f"{b.manifest.name}@{b.manifest.version}"
                result = preload(self.config_path, incoming, tuple(self._loaded), self.endpoints or None,
                                 self.preload_limits or SandboxLimits())
                if not result.ok:
                    return self._refused("preload", result.reason.splitlines(), ref, result.to_json())
                final = os.path.join(self.loaded_dir, f"{ref}-{b.digest[:16]}.zip")
                os.replace(incoming, final)
                keep = True
                before = list(self._loaded)
                after = [p for p in before if not os.path.basename(p).startswith(ref + "-")] + [final]
                self._write_loaded(after)  # first: a supervisor restarted from here on serves it too
                self._loaded = after
                reload = self.reload(reason="bundle")
                if not reload.accepted:
                    self._loaded = before
                    self._write_loaded(before)
                    if final not in before:
                        os.unlink(final)
                    return self._refused("publish", reload.errors.splitlines(), ref, result.to_json())
                for p in before:  # an older copy of the same version, replaced
                    if p not in self._loaded:
                        os.unlink(p)
                log.warning("adapter bundle %s (manifest sha256 %s) loaded: generation %d; golden cases %d passed "
                            "in the sandbox (%s)", ref, b.digest, reload.generation, len(result.golden), result.network)
                return {"accepted": True, "bundle": ref, "digest": b.digest, "routes": list(result.routes),
                        "generation": reload.generation, "reload": reload.to_json(), "preload": result.to_json()}
            finally:
                if not keep:
                    try:
                        os.unlink(incoming)
                    except FileNotFoundError:
                        pass

    def _preload_declared(self, known: set[str]) -> None:
        """The golden cases of bundles the config file names (`spec.bundles[].path`) whose content the
        accepted generation does not hold (`known` digests), run in the sandbox before they are
        published; a failure is a `ConfigError` (the reload is refused, generation 1 does not start).
        A bundle that does not verify is left to the compile, which names it with file:line."""
        from canary.bundle import BundleError, load
        from canary.preload import SandboxLimits, preload
        from extproc.config.loader import parse_text, read_config, relative_to

        model, _ = parse_text(read_config(self.config_path), self.config_path)
        resolve = relative_to(self.config_path)
        new = []
        for e in model.spec.bundles:
            if e.path is None:
                continue
            try:
                if load(resolve(e.path)).digest not in known:
                    new.append(str(resolve(e.path)))
            except BundleError:
                continue
        if not new:
            return
        result = preload(self.config_path, None, tuple(self._loaded), self.endpoints or None,
                         self.preload_limits or SandboxLimits(), declared=tuple(new))
        if not result.ok:
            raise ConfigError(f"{self.config_path}: spec.bundles: refused by the preload sandbox:\n{result.reason}")
        log.info("bundles %s named by %s: %d golden cases passed in the sandbox", result.bundle, self.config_path,
                 len(result.golden))

    def _refused(self, stage: str, problems: list[str], ref: str = "", preload: Any = None) -> dict[str, Any]:
        log.error("adapter bundle %s refused at %s, keeping generation %d:\n%s", ref or "?", stage,
                  self.snapshot.generation, "\n".join(problems))
        return {"accepted": False, "stage": stage, "bundle": ref, "problems": problems,
                "generation": self.snapshot.generation, "preload": preload}

    def bundles_state(self) -> dict[str, Any]:
        """What `GET /bundles` answers: the bundles the accepted snapshot holds, and which are active."""
        snap = self.snapshot
        return {"generation": snap.generation, "active": dict(snap.active_bundles),
                "loaded": [os.path.basename(p) for p in self._loaded],
                "bundles": {ref: {"name": b.name, "version": b.version, "digest": b.digest, "loaded": b.loaded,
                                  "signed": b.signed, "routes": list(b.parts), "golden": b.golden}
                            for ref, b in snap.bundles.items()},
                "routes": {n: r.bundle for n, r in snap.routes.items() if r.bundle}}

    # -- rolling restart -------------------------------------------------------------------
    def rolling_restart(self, settle: float = ROLLING_SETTLE, timeout: float = 30.0) -> dict[str, Any]:
        """Replace every worker with a fresh process (new code from disk), one at a time: the old one is
        sent SIGTERM (NOT_SERVING: Envoy's health check stops new streams; its open streams finish
        within the shutdown grace), the new one starts on the same port on the accepted generation and
        is waited for (`ready`), then `settle` seconds (one Envoy health-check interval: it is back in
        rotation) before the next. Reloads wait meanwhile. A worker that does not come back stops the
        restart (the monitor keeps restarting it as for a crash)."""
        done = []
        with self._reload_lock:
            for w in self.workers:
                if self._stopping.is_set():
                    break
                with self._lock:
                    old = w.proc
                    w.replacing = True
                started = time.monotonic()
                try:
                    if old is not None and old.poll() is None:
                        old.send_signal(signal.SIGTERM)
                        try:
                            old.wait(self.grace + 2.0)
                        except subprocess.TimeoutExpired:
                            log.warning("worker %d did not stop within the grace period; killing", w.index)
                            old.kill()
                            old.wait()
                    from prometheus_client import multiprocess

                    if old is not None:
                        multiprocess.mark_process_dead(old.pid, self._metrics_dir)
                    drained = time.monotonic() - started
                    with self._lock:
                        if self._stopping.is_set():
                            break
                        self._spawn(w)
                finally:
                    w.replacing = False
                try:
                    self._wait_ready(w, time.monotonic() + timeout)
                except RuntimeError as e:
                    log.error("rolling restart stopped at worker %d: %s", w.index, e)
                    return {"ok": False, "workers": done, "error": str(e)}
                done.append({"index": w.index, "port": w.port, "old_pid": old.pid if old else None, "pid": w.pid,
                             "drained_s": round(drained, 3), "ready_s": round(time.monotonic() - started, 3),
                             "generation": w.generation})
                log.info("rolling restart: worker %d replaced (pid %s -> %s)", w.index, old.pid if old else None, w.pid)
                if settle > 0 and w is not self.workers[-1]:
                    self._stopping.wait(settle)
            self._restarts["rolling"] += 1
        return {"ok": True, "workers": done}

    @property
    def snapshot(self) -> "Snapshot":
        """The accepted config snapshot (what every worker serves, or is about to)."""
        assert self._bundle is not None, "start() first"
        return self._bundle.snapshot

    def _spawn(self, w: _Worker) -> None:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self._metrics_dir, PYTHONUNBUFFERED="1",
                   ADAPTER_STATE_DIR=os.path.join(self._metrics_dir, "state"))  # gateway-wide state (in-flight)
        if self._processor_tls is None and self._bundle is not None:  # fixed at the first spawn, like Envoy's side
            tls = self._bundle.snapshot.processor.tls
            self._processor_tls = tls.model_dump_json() if tls is not None else "off"
        if self._processor_tls is not None:
            env["ADAPTER_PROCESSOR_TLS"] = self._processor_tls  # extproc.server.PROCESSOR_TLS_ENV
        cmd = [sys.executable, "-m", "extproc", "--log-level", self.log_level, "worker",
               "--bundle-root", self.bundle_root, "--address", self.address, "--port", str(w.port),
               "--index", str(w.index), "--shutdown-grace", str(self.grace), *self.worker_args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, preexec_fn=die_with_parent, text=True,
                                start_new_session=True)
        with self._cond:
            w.proc = proc
            w.spawned_at = time.monotonic()
            w.ready, w.generation, w.digest, w.last, w.refused, w.events = False, None, None, "", None, 0
        # Drain stdout for the life of the process: protocol lines, and a stray print never blocks it.
        threading.Thread(target=self._drain, args=(w, proc), daemon=True, name=f"worker-{w.index}-out").start()

    def _drain(self, w: _Worker, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._on_line(w, proc, line.strip())
        with self._cond:
            self._cond.notify_all()

    def _on_line(self, w: _Worker, proc: subprocess.Popen, line: str) -> None:
        ready, loaded, refused = _READY.match(line), _LOADED.match(line), _REFUSED.match(line)
        if not (ready or loaded or refused):
            if line:
                log.debug("worker %d: %s", w.index, line)
            return
        with self._cond:
            if w.proc is not proc:
                return  # a line from a process already replaced
            w.events += 1
            if refused:
                w.last, w.refused = "refused", (refused.group(1), refused.group(2))
                log.error("worker %d (pid %d) refused config bundle generation %s: %s", w.index, proc.pid,
                          refused.group(1), refused.group(2))
            else:
                m = ready or loaded
                g, d = int(m.group(m.re.groups - 1)), m.group(m.re.groups)
                if (g, d) != (w.generation, w.digest) or ready:
                    w.changed = time.time()
                w.generation, w.digest = g, d
                w.last = "ready" if ready else "loaded"
                if ready:
                    w.ready = True
                    # it may have read `current` just before a reload published the next one
                    if self._bundle is not None and d != self._bundle.digest:
                        self._hangup(w)
            self._cond.notify_all()

    def _wait_ready(self, w: _Worker, deadline: float) -> None:
        proc = w.proc
        assert proc is not None
        with self._cond:
            while not (w.proc is proc and w.ready):
                if proc.poll() is not None:
                    reason = f": {w.refused[1]}" if w.refused else ""
                    raise RuntimeError(f"processor worker {w.index} (port {w.port}) did not start: exited with "
                                       f"code {proc.returncode}{reason}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"processor worker {w.index} (port {w.port}) did not start: timed out")
                self._cond.wait(min(remaining, 0.2))

    def _monitor(self, w: _Worker) -> None:
        while not self._stopping.is_set():
            proc = w.proc
            if proc is None:
                return
            code = proc.wait()
            if self._stopping.is_set():
                return
            if w.replacing or w.proc is not proc:  # a rolling restart stopped it and starts its successor
                while w.replacing and not self._stopping.is_set():
                    time.sleep(0.05)
                continue
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(proc.pid, self._metrics_dir)
            w.restarts += 1
            # the back-off grows with crashes in a row: a worker that had run STABLE_S or more starts over
            w.crashes = 1 if time.monotonic() - w.spawned_at >= STABLE_S else w.crashes + 1
            delay = restart_delay(w.crashes)
            log.error("worker %d (pid %d) exited with %s; restarting in %.1fs on generation %d", w.index, proc.pid,
                      code, delay, self.snapshot.generation)
            time.sleep(delay)
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn(w)  # same --bundle-root: it serves the last accepted bundle
            try:
                self._wait_ready(w, time.monotonic() + 30)
            except RuntimeError as e:
                log.error("%s", e)

    def _hangup(self, w: _Worker) -> bool:
        try:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGHUP)
                return True
        except ProcessLookupError:
            pass
        return False

    # -- reload ----------------------------------------------------------------------------
    def reload(self, timeout: float = ACK_TIMEOUT, reason: str = "file") -> ReloadResult:
        """Validate the config file again and, when it is accepted, move every worker to it.

        Refused: logged once with its file:line issues, nothing changes. Accepted: published as
        the next generation (or, when its content is the accepted one, kept as it is), every live
        worker is told (SIGHUP) and acknowledges on stdout; this waits up to `timeout` seconds for
        them, then calls `xds.write` (workers first: they keep older snapshots, so Envoy's old
        routes still find theirs). `errors` names workers that lagged. `reason` "canary": the
        controller applies a plan's new weights (the file is compiled again all the same)."""
        with self._reload_lock:
            current = self.snapshot
            try:
                self._preload_declared({b.digest for b in current.bundles.values()})
                bundle = publish(self.bundle_root, self.config_path, current.generation + 1, self.endpoints,
                                 unchanged=current.digest, rollouts=self._prepare_rollouts(),
                                 loaded=tuple(self._loaded))
            except (ConfigError, OSError) as e:
                self._pending = None
                text = str(e) if isinstance(e, ConfigError) else f"{self.config_path}: cannot publish bundle: {e}"
                if reason == "canary" and self.controller is not None:
                    self.controller.failed_apply(text)
                with self._cond:
                    self._reloads["refused"] += 1
                    self._last_refusal = {"at": time.time(), "generation_kept": current.generation,
                                          "digest_kept": current.digest, "source": self.config_path,
                                          "issues": text.splitlines()}
                log.error("config reload refused, keeping generation %d (digest %s):\n%s", current.generation,
                          current.digest, text)
                return ReloadResult(False, current.generation, current.digest, None, self.worker_generations(), text)
            with self._cond:
                if bundle is not None:
                    self._bundle = bundle
                    self._accepted_at = time.time()
                self._reloads["accepted"] += 1
            snap = self.snapshot
            errors = self._tell_workers(snap, timeout)
            self._commit_rollouts(snap)  # the plans' weights are live from now on
            self._configure_batch_control(snap)
            refused = [e for e in errors if " refused generation " in e]
            if refused and self.xds is not None:
                # a worker that could not load it would answer Envoy's new routes with config_mismatch:
                # Envoy keeps the routes every worker serves
                log.error("generation %d not sent to Envoy: %s", snap.generation, "; ".join(refused))
            elif self.xds is not None:
                try:
                    self.xds.write(snap, len(self.workers))
                except Exception as e:  # noqa: BLE001 - reported; the workers already serve it
                    log.error("xDS write for generation %d failed: %s", snap.generation, e)
                    errors.append(f"xds: {e}")
            result = ReloadResult(True, snap.generation, snap.digest, snap, self.worker_generations(),
                                  "\n".join(errors))
            (log.warning if errors else log.info)("%s", describe(result))
            return result

    def _tell_workers(self, snap: "Snapshot", timeout: float) -> list[str]:
        with self._cond:
            told = {w.index: (w.proc, w.events) for w in self.workers if w.ready and self._hangup(w)}
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                pending = [w for w in self.workers if not self._settled(w, told, snap)]
                remaining = deadline - time.monotonic()
                if not pending or remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
            errors = []
            for w in self.workers:
                if w.digest == snap.digest and w.ready:
                    continue
                if w.last == "refused" and w.refused:
                    errors.append(f"worker {w.index} refused generation {w.refused[0]}: {w.refused[1]}")
                elif not w.alive() or not w.ready:
                    errors.append(f"worker {w.index} is not running (restarting); it will start on generation "
                                  f"{snap.generation}")
                else:
                    errors.append(f"worker {w.index} did not acknowledge generation {snap.generation} within "
                                  f"{timeout:g}s (serving generation {w.generation})")
            return errors

    def _settled(self, w: _Worker, told: dict[int, tuple[Any, int]], snap: "Snapshot") -> bool:
        """Whether reload() can stop waiting for `w`: it acknowledged `snap`, or refused it."""
        proc, events = told.get(w.index, (None, -1))
        if w.proc is proc:  # told: wait for a line after the SIGHUP
            return w.events > events and (w.digest == snap.digest or w.last == "refused")
        return w.ready and w.digest == snap.digest  # (re)started since: its ready line says

    def worker_generations(self) -> dict[int, int]:
        with self._cond:
            return {w.index: w.generation for w in self.workers if w.alive() and w.ready and w.generation is not None}

    def config_state(self) -> dict[str, Any]:
        """What `GET /config` answers."""
        with self._cond:
            b = self._bundle
            return {
                "generation": b.generation if b else None,
                "digest": b.digest if b else None,
                "source": self.config_path,
                "bundle": str(b.path) if b else None,
                "accepted_at": self._accepted_at,
                "workers": [{"index": w.index, "port": w.port, "pid": w.pid, "alive": w.alive(), "ready": w.ready,
                             "generation": w.generation, "digest": w.digest, "restarts": w.restarts,
                             "changed_at": w.changed,
                             "refused": ({"generation": w.refused[0], "reason": w.refused[1]}
                                         if w.refused else None)}
                            for w in self.workers],
                "reloads": dict(self._reloads),
                "last_refusal": self._last_refusal,
                "state_dir": self.feed_dir,  # the workers' shared state (adapterctl logs -f reads it)
                "batch_control": self.batch_control.status() if self.batch_control is not None else [],
            }

    # -- stop ------------------------------------------------------------------------------
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
            self._http = None
        if self.controller is not None:
            self.controller.close()
        if self.batch_control is not None:
            self.batch_control.stop()
        shutil.rmtree(self._metrics_dir, ignore_errors=True)
        if self._own_root:
            shutil.rmtree(self.bundle_root, ignore_errors=True)

    def alive(self) -> bool:
        return all(w.alive() for w in self.workers)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc]

    # -- admin -----------------------------------------------------------------------------
    def _serve_admin(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

        sup = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                path = self.path.split("?")[0]
                if path == "/metrics":
                    registry = CollectorRegistry()
                    multiprocess.MultiProcessCollector(registry, path=sup._metrics_dir)
                    registry.register(_ConfigCollector(sup))
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    ok = sup.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"worker down\n", "text/plain")
                elif path == "/config":
                    self._json(200, sup.config_state())
                elif path == "/canary" or path.startswith("/canary/"):
                    self._canary_status(path[len("/canary/"):] or None if path != "/canary" else None)
                elif path == "/bundles":
                    self._json(200, sup.bundles_state())
                else:
                    self._send(404, b"not found: try /metrics, /healthz, /config, /canary or POST /reload\n",
                               "text/plain")

            def _canary_status(self, name: str | None) -> None:
                from canary.control import UnknownRollout

                try:
                    self._json(200, {"rollouts": sup.controller.status(name)})
                except UnknownRollout as e:
                    self._json(404, {"error": "unknown_rollout", "message": str(e)})

            def _canary_action(self, path: str, body: bytes) -> None:
                from canary.control import ACTIONS, NoPlan, UnknownRollout
                from canary.plan import PlanError

                parts = path.strip("/").split("/")
                if len(parts) != 3 or parts[2] not in ACTIONS:
                    self._json(404, {"error": "not_found", "message": f"POST /canary/NAME/ACTION with ACTION one "
                                     f"of {', '.join(ACTIONS)}"})
                    return
                try:
                    reason = str((json.loads(body) if body.strip() else {}).get("reason") or "")
                except (ValueError, AttributeError):
                    self._json(400, {"error": "bad_request", "message": "the body must be JSON: {\"reason\": \"...\"}"})
                    return
                try:
                    self._json(200, sup.canary_action(parts[1], parts[2], reason))
                except UnknownRollout as e:
                    self._json(404, {"error": "unknown_rollout", "message": str(e)})
                except NoPlan as e:
                    self._json(409, {"error": "no_plan", "message": str(e)})
                except PlanError as e:
                    self._json(409, {"error": "not_allowed", "message": str(e)})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_POST_BYTES:  # a bundle ZIP is at most canary.bundle.Limits.max_zip_bytes
                    self._json(413, {"accepted": False, "stage": "verify", "problems": [
                        f"bundle: size: {length} bytes, more than {MAX_POST_BYTES}"]})
                    self.close_connection = True
                    return
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?")[0]
                if path.startswith("/canary/"):
                    self._canary_action(path, body)
                    return
                if path == "/bundles":
                    try:
                        doc = sup.load_adapter_bundle(body)
                    except OSError as e:  # the state directory is not writable, the disk is full, ...
                        log.error("adapter bundle load failed: %s", e)
                        self._json(500, {"accepted": False, "stage": "keep", "generation": sup.snapshot.generation,
                                         "problems": [f"{sup.loaded_dir}: cannot keep the bundle: {e}"]})
                        return
                    self._json(200 if doc["accepted"] else 422, doc)
                    return
                if path == "/restart":
                    doc = sup.rolling_restart()
                    self._json(200 if doc["ok"] else 500, doc)
                    return
                if path != "/reload":
                    self._send(404, b"not found: POST /reload, /bundles, /restart or /canary/NAME/ACTION\n",
                               "text/plain")
                    return
                result = sup.reload()
                doc = result.to_json()
                with sup._cond:
                    doc["worker_digests"] = {str(w.index): w.digest for w in sup.workers if w.digest}
                    doc["workers_total"] = len(sup.workers)
                self._json(200 if result.accepted else 409, doc)

            def _json(self, code: int, doc: Any) -> None:
                self._send(code, (json.dumps(doc, indent=1) + "\n").encode(), "application/json")

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


class _ConfigCollector:
    """The supervisor's own series, merged into `/metrics`: which generation each worker serves
    (one series per live worker, so a laggard shows), the accepted one, reload outcomes."""

    def __init__(self, sup: Supervisor):
        self.sup = sup

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self.sup.config_state()
        info = GaugeMetricFamily("adapter_processor_worker_config_info",
                                 "the config generation and digest each live worker serves (value 1)",
                                 labels=["worker", "generation", "digest"])
        for w in state["workers"]:
            if w["alive"] and w["ready"] and w["generation"] is not None:
                info.add_metric([str(w["index"]), str(w["generation"]), w["digest"]], 1)
        yield info
        if state["generation"] is not None:
            yield GaugeMetricFamily("adapter_processor_config_accepted_generation",
                                    "the config generation the supervisor accepted last", value=state["generation"])
        reloads = CounterMetricFamily("adapter_processor_config_reloads", "config reloads by result",
                                      labels=["result"])
        for result in ("accepted", "refused"):
            reloads.add_metric([result], state["reloads"][result])
        yield reloads
