"""Live Envoy config from files: LDS, RDS, CDS and EDS resources a running Envoy applies without a restart.

What: `render_bootstrap(snap, workers, xds_dir)` is the bootstrap Envoy starts with once: node, admin,
overload manager, the processor-side clusters (processor, one access-log cluster per worker) and
`dynamic_resources` reading `<xds_dir>/lds.yaml` and `<xds_dir>/cds.yaml`. The listener's HCM reads
its routes from `<xds_dir>/rds.yaml` (RDS: a route change drains no listener); a backend whose
endpoints are all IPs is an EDS cluster reading `<xds_dir>/eds-<cluster>.yaml` (host names stay
STRICT_DNS with inline endpoints: EDS takes addresses, not names). `render_resources` builds these
resources from the same pieces as the static `envoy_render.render`.

`XdsWriter(xds_dir, ack).write(snap, workers)` renders and writes the files, make before break:
  1. `clusters`: clusters (and their endpoint files) of the old and the new config together,
  2. `routes`: the route configuration, then the listener,
  3. `prune`: the clusters of the new config only; endpoint files of removed clusters deleted,
calling `ack(step)` after each step that changed a file, so no route ever names a cluster Envoy
does not have yet. `EnvoyAdminAck` (what `Stack` passes) polls Envoy's admin `/stats` until each
written file's subscription reports the version written, or raises `XdsError` naming the file
Envoy rejected.

Why files: Envoy watches `xds_dir` (`watched_directory`) and re-reads on every rename into it, so
an atomic rename (temp file in the same directory, fsync, `os.rename`) is an atomic update; no xDS
server runs. Every rename makes Envoy re-read every file of the directory, so unchanged files are
not rewritten.

Cost: a render is a pure function of the snapshot (milliseconds); a write is a few small files,
and with the ack a few admin round trips per step (tens of milliseconds on this machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx
import yaml

from extproc.config.snapshot import Snapshot
from extproc.envoy_render import (ROUTE_CONFIG_NAME, STAT_PREFIX, als_clusters, backend_cluster, bootstrap_base,
                                  dump_yaml, listener, load_assignment, processor_cluster, route_configuration,
                                  uses_eds, worker_count)

_T = "type.googleapis.com/"
LISTENER_TYPE = _T + "envoy.config.listener.v3.Listener"
ROUTE_TYPE = _T + "envoy.config.route.v3.RouteConfiguration"
CLUSTER_TYPE = _T + "envoy.config.cluster.v3.Cluster"
ENDPOINTS_TYPE = _T + "envoy.config.endpoint.v3.ClusterLoadAssignment"

LDS_FILE = "lds.yaml"
RDS_FILE = "rds.yaml"
CDS_FILE = "cds.yaml"
STEPS = ("clusters", "routes", "prune")


def eds_file(cluster: str) -> str:
    return f"eds-{cluster}.yaml"


def config_source(xds_dir: str | Path, name: str) -> dict[str, Any]:
    """A ConfigSource reading `<xds_dir>/<name>`, re-read whenever a file is renamed into xds_dir."""
    d = str(Path(xds_dir).absolute())
    return {"path_config_source": {"path": f"{d}/{name}", "watched_directory": {"path": d}},
            "resource_api_version": "V3"}


@dataclass(frozen=True)
class XdsResources:
    """What Envoy gets dynamically: resource dicts as in the static bootstrap, without `@type`."""
    listeners: tuple[dict[str, Any], ...]
    route_configs: tuple[dict[str, Any], ...]
    clusters: tuple[dict[str, Any], ...]
    endpoints: Mapping[str, dict[str, Any]]  # cluster name -> ClusterLoadAssignment (EDS clusters only)

    def files(self) -> dict[str, dict[str, Any]]:
        """File name -> DiscoveryResponse body, in the order make before break writes them."""
        out = {eds_file(c): discovery(ENDPOINTS_TYPE, [cla]) for c, cla in self.endpoints.items()}
        out[CDS_FILE] = discovery(CLUSTER_TYPE, self.clusters)
        out[RDS_FILE] = discovery(ROUTE_TYPE, self.route_configs)
        out[LDS_FILE] = discovery(LISTENER_TYPE, self.listeners)
        return out


def discovery(type_url: str, resources: Any) -> dict[str, Any]:
    """A DiscoveryResponse file; version_info is a hash of the resources (Envoy reports it back
    as the subscription's `version_text` stat, which is how an ack knows the file was applied)."""
    body = [{"@type": type_url, **{k: v for k, v in r.items() if k != "@type"}} for r in resources]
    version = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {"version_info": version, "resources": body}


def render_resources(snap: Snapshot, workers: int | None = None, xds_dir: str | Path = "xds") -> XdsResources:
    """The listener (HCM on RDS), the one route configuration, the backend clusters (EDS where all
    endpoints are IPs) and their load assignments. `xds_dir` is where the files will live (the
    listener and EDS clusters name their files by absolute path)."""
    n = worker_count(snap, workers)
    clusters, endpoints = [], {}
    for b in snap.backends.values():
        if uses_eds(b):
            clusters.append(backend_cluster(b, config_source(xds_dir, eds_file(b.cluster))))
            endpoints[b.cluster] = load_assignment(b)
        else:
            clusters.append(backend_cluster(b))
    return XdsResources(
        listeners=(listener(snap, n, rds=config_source(xds_dir, RDS_FILE)),),
        route_configs=(route_configuration(snap),),
        clusters=tuple(clusters),
        endpoints=endpoints,
    )


def render_bootstrap(snap: Snapshot, workers: int | None, xds_dir: str | Path) -> dict[str, Any]:
    """The bootstrap for a live-config Envoy: processor-side clusters static (they change only
    with the worker count, which needs a restart), everything else from `xds_dir`."""
    n = worker_count(snap, workers)
    return {
        **bootstrap_base(snap),
        "static_resources": {"clusters": [processor_cluster(snap, n), *als_clusters(snap, n)]},
        "dynamic_resources": {"lds_config": config_source(xds_dir, LDS_FILE),
                              "cds_config": config_source(xds_dir, CDS_FILE)},
    }


def bootstrap_yaml(snap: Snapshot, workers: int | None, xds_dir: str | Path) -> str:
    header = (f"# Generated from {snap.source} ({snap.name}, digest {snap.digest}); listeners, routes,\n"
              f"# clusters and endpoints live in {Path(xds_dir).absolute()} and change without a restart.\n")
    return header + dump_yaml(render_bootstrap(snap, workers, xds_dir))


class XdsError(RuntimeError):
    """Envoy rejected a file, or did not apply it in time; the message names the file."""


class XdsStep(str):
    """The name of a make-before-break step (`clusters`, `routes`, `prune`), as passed to `ack`;
    `.files` maps each file written in it to the version_info written, `.dir` is the directory."""

    files: Mapping[str, str]
    dir: Path

    def __new__(cls, name: str, files: Mapping[str, str], xds_dir: Path) -> "XdsStep":
        s = super().__new__(cls, name)
        s.files = dict(files)
        s.dir = xds_dir
        return s


@dataclass(frozen=True)
class XdsWriteResult:
    """What one `write` did: files renamed into place (in order) and deleted, steps that changed."""
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    steps: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.changed or self.removed)


def _dump(doc: dict[str, Any]) -> bytes:
    """JSON, which is YAML too: every string quoted, so Envoy's YAML reader cannot take a route
    named `n` for `false` (see `envoy_render.dump_yaml`)."""
    return (json.dumps(doc, indent=1, ensure_ascii=False) + "\n").encode()


class XdsWriter:
    """Writes `render_resources(snap, workers)` into `xds_dir`, make before break, one write at a time.

    The current state is what is on disk (old clusters are read back from `cds.yaml`), so a new
    writer on an existing directory continues where the last one stopped. The worker count is
    fixed by the first write: the processor-side clusters are static in the bootstrap.
    `transform`, if given, is applied to every snapshot first (the stack puts its own ports and
    simulator endpoints over a snapshot freshly loaded from the config file).
    """

    def __init__(self, xds_dir: str | Path, ack: Callable[[XdsStep], Any] | None = None,
                 transform: Callable[[Snapshot], Snapshot] | None = None):
        self.dir = Path(xds_dir).absolute()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ack = ack
        self.transform = transform
        self.workers: int | None = None
        self._lock = threading.Lock()

    def bootstrap(self, snap: Snapshot, workers: int | None = None) -> dict[str, Any]:
        if self.transform is not None:
            snap = self.transform(snap)
        return render_bootstrap(snap, workers, self.dir)

    def write(self, snap: Snapshot, workers: int | None = None, *, wait: bool = True) -> XdsWriteResult:
        """Render and apply; `wait=False` skips the acks (the first write, before Envoy runs)."""
        with self._lock:
            if self.transform is not None:
                snap = self.transform(snap)
            n = worker_count(snap, workers)
            if self.workers is not None and n != self.workers:
                raise XdsError(f"processor worker count changed from {self.workers} to {n}: the processor and "
                               "access-log clusters are static in Envoy's bootstrap, so this needs an Envoy restart")
            result = self._write(render_resources(snap, n, self.dir), wait)
            self.workers = n
            return result

    def write_resources(self, resources: XdsResources, *, wait: bool = True) -> XdsWriteResult:
        """Apply resources rendered (and possibly amended) by the caller, make before break."""
        with self._lock:
            return self._write(resources, wait)

    def _write(self, resources: XdsResources, wait: bool) -> XdsWriteResult:
        new = resources.files()
        ack = self.ack if wait else None
        changed: list[str] = []
        steps: list[str] = []
        old_clusters = self._clusters_on_disk()
        new_clusters = {r["name"]: r for r in new[CDS_FILE]["resources"]}

        # 1. clusters: old and new together; endpoint files first, so a new EDS cluster finds its file
        union = dict(new_clusters)
        union.update({k: v for k, v in old_clusters.items() if k not in new_clusters})
        step1 = {f: new[f] for f in new if f.startswith("eds-")}
        step1[CDS_FILE] = discovery(CLUSTER_TYPE, list(union.values()))
        self._step("clusters", step1, ack, changed, steps)
        # 2. routes, then the listener
        self._step("routes", {RDS_FILE: new[RDS_FILE], LDS_FILE: new[LDS_FILE]}, ack, changed, steps)
        # 3. prune: the new clusters only, then the endpoint files nobody reads any more
        self._step("prune", {CDS_FILE: new[CDS_FILE]}, ack, changed, steps)
        removed = []
        for p in sorted(self.dir.glob("eds-*.yaml")):
            if p.name not in new:
                p.unlink()
                removed.append(p.name)
        return XdsWriteResult(tuple(changed), tuple(removed), tuple(steps))

    def _step(self, name: str, docs: dict[str, dict[str, Any]], ack: Callable[[XdsStep], Any] | None,
              changed: list[str], steps: list[str]) -> None:
        previous: dict[str, bytes | None] = {}
        written: dict[str, str] = {}
        for fname, doc in docs.items():
            data = _dump(doc)
            path = self.dir / fname
            old = path.read_bytes() if path.exists() else None
            if old == data:
                continue
            previous[fname] = old
            self._atomic_write(path, data)
            written[fname] = doc["version_info"]
            changed.append(fname)
        if not written:
            return
        steps.append(name)
        if ack is None:
            return
        try:
            ack(XdsStep(name, written, self.dir))
        except BaseException:
            # put back what Envoy still runs, so the directory and Envoy agree; then report
            for fname, old in reversed(list(previous.items())):
                if old is None:
                    (self.dir / fname).unlink(missing_ok=True)
                else:
                    self._atomic_write(self.dir / fname, old)
            raise

    def _atomic_write(self, path: Path, data: bytes) -> None:
        """Temp file in the same directory, fsync, rename: Envoy sees the old file or the new one."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # readable by an Envoy running as another user
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _clusters_on_disk(self) -> dict[str, dict[str, Any]]:
        path = self.dir / CDS_FILE
        if not path.exists():
            return {}
        doc = yaml.safe_load(path.read_text()) or {}
        return {r["name"]: r for r in doc.get("resources") or []}


def inline_files(bootstrap: Mapping[str, Any], xds_dir: str | Path) -> dict[str, Any]:
    """`bootstrap` with the files of `xds_dir` put inline as static resources (RDS routes in the
    HCM, EDS endpoints as load assignments): `envoy --mode validate` does not read dynamic files,
    so this is how to have Envoy check what the directory holds."""
    d = Path(xds_dir)

    def resources(name: str) -> list[dict[str, Any]]:
        doc = json.loads((d / name).read_text())
        return [{k: v for k, v in r.items() if k != "@type"} for r in doc.get("resources") or []]

    routes = {r["name"]: r for r in resources(RDS_FILE)}
    listeners = resources(LDS_FILE)
    for lst in listeners:
        for chain in lst.get("filter_chains", []):
            for f in chain.get("filters", []):
                hcm = f.get("typed_config", {})
                if "rds" in hcm:
                    hcm["route_config"] = routes[hcm.pop("rds")["route_config_name"]]
    clusters = []
    for c in resources(CDS_FILE):
        if c.get("type") == "EDS":
            eds = c.pop("eds_cluster_config")
            c["type"] = "STATIC"
            c["load_assignment"] = resources(eds_file(eds.get("service_name") or c["name"]))[0]
        clusters.append(c)
    out = json.loads(json.dumps(bootstrap))
    out.pop("dynamic_resources", None)
    static = out.setdefault("static_resources", {})
    static["listeners"] = static.get("listeners", []) + listeners
    static["clusters"] = static.get("clusters", []) + clusters
    return out


def envoy_validate(bootstrap: Mapping[str, Any], xds_dir: str | Path | None = None) -> tuple[bool, str]:
    """`envoy --mode validate` on `bootstrap`, with the files of `xds_dir` inlined when given."""
    import subprocess

    from extproc.envoy_bin import find_envoy

    doc = inline_files(bootstrap, xds_dir) if xds_dir is not None else dict(bootstrap)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(doc, f)
        f.flush()
        cmd = [find_envoy(), "--mode", "validate", "-c", f.name, "--disable-hot-restart", "-l", "error"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def subscription_stat(fname: str) -> str:
    """The admin stats prefix of the subscription that reads `fname`."""
    if fname == LDS_FILE:
        return "listener_manager.lds"
    if fname == CDS_FILE:
        return "cluster_manager.cds"
    if fname == RDS_FILE:
        return f"http.{STAT_PREFIX}.rds.{ROUTE_CONFIG_NAME}"
    if fname.startswith("eds-") and fname.endswith(".yaml"):
        return f"cluster.{fname[4:-5]}"
    raise ValueError(f"not an xDS file: {fname}")


@dataclass
class EnvoyAdminAck:
    """An `ack` for XdsWriter that waits until Envoy applied the step's files, read from `/stats`.

    Applied: the file's subscription reports the version written (`<prefix>.version_text`: the
    version is a hash of the file's resources, so it cannot match early); after `clusters` also no cluster is
    still warming (a new EDS cluster is usable only then), after `routes` no listener is warming.
    Rejected: its `update_rejected` or `update_failure` moved past the value at the previous ack:
    `XdsError` naming the file. Not applied within `timeout`: `XdsError` too.
    """

    admin_url: str
    timeout: float = 10.0
    interval: float = 0.02
    _counters: dict[str, float] = field(default_factory=dict, init=False)

    def stats(self) -> dict[str, Any]:
        r = httpx.get(f"{self.admin_url}/stats", params={"format": "json"}, timeout=2.0)
        r.raise_for_status()
        return {s["name"]: s["value"] for s in r.json()["stats"] if "name" in s}

    def baseline(self) -> dict[str, Any]:
        """Remember the rejection counters now (call once Envoy is up); returns the stats read."""
        stats = self.stats()
        self._counters = {k: v for k, v in stats.items() if k.endswith((".update_rejected", ".update_failure"))}
        return stats

    def rejected(self, stats: Mapping[str, Any] | None = None) -> list[str]:
        """Subscriptions whose rejection counters are above zero (for a start-up check)."""
        stats = self.stats() if stats is None else stats
        return sorted(k for k, v in stats.items() if k.endswith((".update_rejected", ".update_failure")) and v)

    def __call__(self, step: XdsStep) -> None:
        deadline = time.monotonic() + self.timeout
        pending = dict(step.files)
        try:
            while True:
                stats = self.stats()
                for fname in list(pending):
                    prefix = subscription_stat(fname)
                    for bad in ("update_rejected", "update_failure"):
                        key = f"{prefix}.{bad}"
                        if stats.get(key, 0) > self._counters.get(key, 0):
                            raise XdsError(f"Envoy rejected {step.dir / fname} in step {step}: {key} went "
                                           f"{self._counters.get(key, 0):g} -> {stats[key]:g} (Envoy's log says why)")
                    if stats.get(f"{prefix}.version_text") == pending[fname]:
                        del pending[fname]
                warming = 0
                if step == "clusters":
                    warming = stats.get("cluster_manager.warming_clusters", 0)
                elif step == "routes":
                    warming = stats.get("listener_manager.total_listeners_warming", 0)
                if not pending and not warming:
                    return
                if time.monotonic() > deadline:
                    what = ", ".join(str(step.dir / f) for f in pending) or f"{warming:g} warming"
                    raise XdsError(f"Envoy did not apply {what} within {self.timeout:g}s (step {step})")
                time.sleep(self.interval)
        finally:
            try:
                self.baseline()
            except httpx.HTTPError:
                pass


__all__ = ["render_resources", "render_bootstrap", "bootstrap_yaml", "XdsResources", "XdsWriter", "XdsWriteResult",
           "XdsStep", "XdsError", "EnvoyAdminAck", "config_source", "inline_files", "envoy_validate", "discovery",
           "eds_file", "subscription_stat", "LDS_FILE", "RDS_FILE", "CDS_FILE", "STEPS"]
