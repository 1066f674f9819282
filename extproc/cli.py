"""`adapterctl`: validate configs, render Envoy, run the processor or the whole stack, test a route.

Examples:
  adapterctl validate examples/finance-llm-adapter.yaml
  adapterctl render-envoy examples/finance-llm-adapter.yaml -o envoy/finance-llm-adapter.yaml --check
  adapterctl up examples/finance-llm-adapter.yaml --simulate        # what `make run` does
  adapterctl render-k8s examples/finance-llm-adapter.yaml -o k8s/   # Kubernetes, Istio, InferencePool
  adapterctl render-compose examples/compose.yaml -o docker-compose.yml
  adapterctl serve examples/finance-llm-adapter.yaml --workers 2    # processor only
  adapterctl reload --config examples/finance-llm-adapter.yaml      # reload the running processor
  adapterctl test --route=/v1/analyze --input='{"query":"计算Q3营收"}'
  adapterctl tools tests/data/openapi/petstore.yaml --format mcp
  adapterctl align LEGACY.yaml ADAPTER_SCHEMA.json -o mapping.yaml --report report.md
  adapterctl quota --watch                                         # tenants' CPU against quotas
  adapterctl bundle build adapters/finance -o finance.zip --version 1.2.0 --sign-key key.pem
  adapterctl bundle verify finance.zip --public-key key.pub        # 1 and the reasons when refused
  adapterctl bundle load finance.zip --config gw.yaml              # preloaded in a sandbox, then live
  adapterctl restart --rolling --config gw.yaml                    # new worker code, one worker at a time
Exit codes: 0 ok, 1 invalid config or failed check, 2 usage error, 3 start-up failure.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from extproc.config.loader import ConfigError, load_file


def _endpoint_arg(value: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    from extproc.config.schema import split_host_port

    name, sep, eps = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError("expected NAME=HOST:PORT[,HOST:PORT]")
    try:
        return name, tuple(split_host_port(e) for e in eps.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_validate(args: argparse.Namespace) -> int:
    from extproc.config.snapshot import ProfileRef

    snap = load_file(args.file)
    routes = [r for r in snap.routes.values() if r.kind != "health"]
    print(f"{args.file}: valid AdapterGateway {snap.name!r}: {len(routes)} route(s), "
          f"{len(snap.backends)} backend(s), {len(snap.tenants)} tenant(s)")
    for r in routes:
        extra = f" model={r.model}" if r.kind in ("llm", "tensor") else ""
        path = r.path + ("*" if r.match == "prefix" else "")
        targets = ", ".join(b.name for b in r.backends)
        sched = r.picker
        if sched is None:
            picker = ""
        elif isinstance(sched, ProfileRef) and not sched.implicit:
            picker = f", profile={sched.name}"
        else:  # a picker, alone or as its own implicit profile
            picker = f", picker={(sched.picker if isinstance(sched, ProfileRef) else sched).name}"
        print(f"  route {r.name}: {path} -> {targets} ({r.kind}{extra}, failureMode={r.failure_mode}{picker})")
    for ref in snap.plugins.values():
        params = ref.params.model_dump(by_alias=True)
        print(f"  plugin {ref.name}: {ref.type} ({ref.slot})" + (f" {params}" if params else ""))
    for prof in snap.profiles.values():
        if prof.implicit:
            continue
        scorers = ", ".join(f"{s.name}*{w:g}" for s, w in prof.scorers) or "none"
        filters = ", ".join(f.name for f in prof.filters) or "none"
        print(f"  profile {prof.name}: filters {filters} -> scorers {scorers} -> picker {prof.picker.name}"
              + (" (explain)" if prof.explain else ""))
    if snap.epp is not None:
        e = snap.epp
        print(f"  epp: endpoint picker of pool {e.pool.name} ({len(e.pool.endpoint_ids)} endpoint(s)), "
              f"{_what_picks(e.route.picker)}, on port {snap.processor.base_port}"
              + (" (TLS)" if e.tls else "") + (f", health also on {e.health_port}" if e.health_port else ""))
    for b in snap.backends.values():
        eps = ", ".join(f"{h}:{p}" + ("{" + ",".join(f"{k}={v}" for k, v in b.endpoint_labels[e].items()) + "}"
                                      if b.endpoint_labels[e] else "")
                        for (h, p), e in zip(b.endpoints, b.endpoint_ids))
        print(f"  backend {b.name}: {b.kind} over {b.protocol} at {eps}" + (" (implicit)" if b.implicit else ""))
    for ro in snap.rollouts.values():
        arms = ", ".join(f"{a} {ro.rollout.weight(a) / 100:g}% ({ro.arm_backends[a]})" for a in ro.arms)
        keys = ", ".join(s.label for s in ro.policy.sources) or "none (weighted random)"
        force = f", forced by {ro.policy.force.label}" if ro.policy.force is not None else ""
        print(f"  rollout {ro.name} on {', '.join(ro.routes)}: {arms}; key {keys}{force}")
    return 0


def envoy_validate(path: str) -> tuple[bool, str]:
    from extproc.envoy_bin import find_envoy

    proc = subprocess.run([find_envoy(), "--mode", "validate", "-c", path, "--disable-hot-restart", "-l", "error"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _what_picks(ref) -> str:
    from extproc.config.snapshot import ProfileRef

    if isinstance(ref, ProfileRef) and not ref.implicit:
        return f"profile {ref.name}"
    return f"picker {(ref.picker if isinstance(ref, ProfileRef) else ref).name}"


def cmd_render_envoy(args: argparse.Namespace) -> int:
    from extproc.envoy_render import render_yaml

    snap = load_file(args.file)
    if args.xds_dir:
        return _render_dynamic(args, snap)
    text = render_yaml(snap, args.workers)
    out = _emit(text, args.output)
    if args.check:
        target = out
        if target is None:
            fd, target = tempfile.mkstemp(suffix=".yaml")
            os.write(fd, text.encode())
            os.close(fd)
        ok, output = envoy_validate(target)
        print(f"envoy --mode validate: {'OK' if ok else 'REJECTED'}", file=sys.stderr)
        if not ok:
            print(output, file=sys.stderr)
            return 1
    return 0


def _emit(text: str, out: str | None) -> str | None:
    """Write a rendered config to `out` (a file, created with its folder) or stdout (`-`/None)."""
    if out and out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        return out
    sys.stdout.write(text)
    return None


def _render_dynamic(args: argparse.Namespace, snap) -> int:
    """`render-envoy --xds-dir DIR`: a bootstrap whose listener, routes, clusters and endpoints come
    from files in DIR, plus those files; `adapterctl serve --xds-dir DIR` keeps them current."""
    from extproc.xds import XdsWriter, bootstrap_yaml, envoy_validate, render_bootstrap

    xds_dir = Path(args.xds_dir).resolve()
    xds_dir.mkdir(parents=True, exist_ok=True)
    XdsWriter(xds_dir).write(snap, args.workers, wait=False)
    text = bootstrap_yaml(snap, args.workers, xds_dir)
    _emit(text, args.output)
    if args.check:
        ok, output = envoy_validate(render_bootstrap(snap, args.workers, xds_dir), xds_dir)
        print(f"envoy --mode validate (bootstrap with {xds_dir} inlined): {'OK' if ok else 'REJECTED'}",
              file=sys.stderr)
        if not ok:
            print(output, file=sys.stderr)
            return 1
    return 0


def _kill_children() -> None:
    """SIGKILL every direct child (Envoy, processor workers, simulators) before a forced exit: their
    parent-death signal is SIGTERM, which a worker still draining its first stop could take as the
    start of a graceful drain and outlive us; a forced exit leaves no process behind."""
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


class _Signals:
    """SIGINT/SIGTERM handling installed before anything starts, so a Ctrl-C during start-up or
    right after it is never lost: the first signal asks for an orderly stop, a second one forces
    exit."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.count = 0
        signal.signal(signal.SIGINT, self._handler)
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.count > 1:
            print("\nsecond signal: forcing exit", file=sys.stderr)
            _kill_children()
            os._exit(130)
        self.stop.set()

    def wait(self) -> None:
        while not self.stop.wait(0.5):
            pass


def _on_sighup(reload) -> None:
    """SIGHUP runs `reload()` (the supervisor's, or the stack's) on a thread, not in the signal
    handler: it waits for the workers' acknowledgements. One result line goes to stderr; a refusal
    is already logged by the supervisor with its reasons."""
    from extproc.supervisor import describe

    def run() -> None:
        try:
            result = reload()
        except Exception as e:  # noqa: BLE001 - a reload must never take the processor down
            print(f"config reload failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return
        if result is not None and getattr(result, "accepted", False):
            print(describe(result), file=sys.stderr, flush=True)

    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=run, name="reload", daemon=True).start())


def _xds_writer(xds_dir: str | None):
    if not xds_dir:
        return None
    try:
        from extproc.xds import XdsWriter
    except ImportError as e:
        raise RuntimeError(f"--xds-dir needs extproc.xds, which is not available here ({e})") from None
    return XdsWriter(xds_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    from extproc.supervisor import Supervisor

    signals = _Signals()
    snap = load_file(args.file)
    proc = snap.processor
    workers = args.workers or proc.workers or (1 if snap.epp is not None else os.cpu_count() or 1)  # EPP: one port
    sup = Supervisor(args.file, proc.bind_address or proc.address, args.base_port or proc.base_port, workers,
                     args.admin_port or proc.admin_port, proc.shutdown_grace, log_level=args.log_level,
                     admin_address=proc.bind_address or "127.0.0.1",
                     endpoints=dict(args.endpoint or ()), record_dir=args.record_dir,
                     xds=_xds_writer(args.xds_dir))
    sup.start()
    _on_sighup(sup.reload)
    print(f"processor: {workers} worker(s) on {proc.address}:{sup.workers[0].port}..{sup.workers[-1].port}, "
          f"metrics on http://127.0.0.1:{sup.admin[1]}/metrics", flush=True)
    signals.wait()
    sup.stop()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from extproc.stack import Stack

    signals = _Signals()
    stack = Stack(args.file, simulate=args.simulate, listen_port=args.port, admin_port=args.admin_port,
                  workers=args.workers, log_level=args.log_level, run_dir=args.run_dir)
    stack.start()
    if signals.stop.is_set():  # Ctrl-C while starting: stop now, in order
        stack.stop()
        return 0
    _on_sighup(getattr(stack, "reload", None) or stack.supervisor.reload)  # before the banner that offers it
    snap = stack.snapshot
    print(f"adapter-gateway {snap.name!r} is up:", flush=True)
    print(f"  gateway    {stack.url}   (Envoy admin {stack.admin_url})")
    print(f"  processor  {len(stack.supervisor.workers)} worker(s), metrics {stack.processor_admin_url}/metrics")
    for name, (_, port) in stack.simulators.items():
        what = ("ONNX Runtime KServe server with demo models" if snap.backends[name].adapter.api == "kserve"
                else "OpenAI API simulator (simulated, not a model)")
        print(f"  backend    {name} -> {what} on 127.0.0.1:{port}")
    for r in snap.routes.values():
        print(f"  route      {r.path}{'*' if r.match == 'prefix' else ''} ({r.kind})")
    print(f"  envoy config {stack.envoy_config}")
    print("Try:  curl -s localhost:%d/v1/analyze -d '{\"query\":\"计算Q3营收\"}'" % snap.listener.port)
    print("Ctrl-C stops everything; SIGHUP reloads the config into the processor.", flush=True)
    signals.wait()
    stack.stop()
    print("stopped.", file=sys.stderr)
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/") + args.route
    headers = {"x-adapter-debug": "1", "content-type": "application/json"}
    started = time.perf_counter()
    try:
        resp = httpx.post(url, content=args.input.encode(), headers=headers, timeout=args.timeout)
    except httpx.HTTPError as e:
        print(f"request to {url} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    latency = (time.perf_counter() - started) * 1000
    print(f"POST {url}")
    print(f"status:   {resp.status_code}")
    print(f"latency:  {latency:.1f} ms")
    if "x-adapter-route" in resp.headers:
        print(f"route:    {resp.headers['x-adapter-route']} -> backend {resp.headers.get('x-adapter-backend')}")
    raw = resp.headers.get("x-adapter-backend-request")
    print("backend request (produced by the processor):")
    if raw:
        decoded = base64.b64decode(raw)
        print(_pretty(decoded))
    else:
        print("  (not reported: passthrough routes forward the body unchanged, or the request failed before mapping)")
    print("response:")
    print(_pretty(resp.content))
    return 0 if resp.status_code < 400 else 1


def _pretty(data: bytes) -> str:
    try:
        return json.dumps(json.loads(data), ensure_ascii=False, indent=2)
    except ValueError:
        return data.decode("utf-8", "replace")


def cmd_quota(args: argparse.Namespace) -> int:
    from ebpf.quota import main as quota_main

    return quota_main(args.rest)


def cmd_rtt(args: argparse.Namespace) -> int:
    from ebpf.rtt import main as rtt_main

    return rtt_main(args.rest)


def cmd_agent(args: argparse.Namespace) -> int:
    from ebpf.agent import main as agent_main

    return agent_main(args.rest)


def cmd_worker(args: argparse.Namespace) -> int:
    from extproc.server import WorkerSettings, run_worker

    if args.bundle_root and args.endpoint:
        print("adapterctl worker: --endpoint applies to --config; a bundle holds its overrides", file=sys.stderr)
        return 2
    return run_worker(WorkerSettings(args.config or "", args.address, args.port, args.index, args.shutdown_grace,
                                     endpoints=tuple(args.endpoint or ()), record_dir=args.record_dir,
                                     bundle_root=args.bundle_root))


def _default_admin(config: str | None) -> str:
    """The processor admin URL: `spec.processor.adminPort` of `config` when it can be read at all
    (the file may be the broken edit being reloaded, so only that field is looked at), else 9902."""
    port = 9902
    if config:
        import yaml

        try:
            doc = yaml.safe_load(Path(config).read_text())
            port = int(doc["spec"]["processor"]["adminPort"])
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
            pass
    return f"http://127.0.0.1:{port}"


def cmd_reload(args: argparse.Namespace) -> int:
    import httpx

    url = (args.admin or _default_admin(args.config)).rstrip("/") + "/reload"
    try:
        resp = httpx.post(url, timeout=args.timeout)
        doc = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        print(f"adapterctl reload: {url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not doc.get("accepted"):
        print(f"config reload refused, keeping generation {doc.get('generation')} (digest {doc.get('digest')}):")
        for line in doc.get("issues") or [doc.get("errors", "")]:
            print(f"  {line}")
        return 1
    generation = doc["generation"]
    print(f"config reload accepted: generation {generation} (digest {doc['digest']})")
    workers, digests = doc.get("workers", {}), doc.get("worker_digests", {})
    lagging = False
    for i in range(int(doc.get("workers_total", len(workers)))):
        g = workers.get(str(i))
        if g is None:
            print(f"worker {i}: not running")
        else:
            print(f"worker {i}: generation {g} (digest {digests.get(str(i), '?')})")
        lagging |= g != generation
    for line in doc.get("issues") or ():
        print(f"  {line}")
    return 1 if lagging or doc.get("errors") else 0


def cmd_bundle(args: argparse.Namespace) -> int:
    """`bundle build` / `bundle verify`: the logic is canary/bundle.py (imported here, not at start-up)."""
    from canary.bundle import BundleError, build, verify

    try:
        if args.bundle_command == "build":
            m = build(args.directory, args.output, version=args.version, name=args.name, sign_key=args.sign_key)
            signed = "signed" if args.sign_key else "unsigned"
            print(f"built {args.output}: {m.name} {m.version} ({m.created}), {len(m.files)} files, {signed}")
            return 0
        b = verify(args.file, public_key=args.public_key, require_signature=args.require_signature)
    except BundleError as e:
        print(f"adapterctl bundle {args.bundle_command}: refused {getattr(args, 'file', None) or args.directory}:",
              file=sys.stderr)
        for p in e.problems:
            print(f"  {p.file}: {p.field}: {p.reason}", file=sys.stderr)
        return 1
    m = b.manifest
    sig = ("signature verified" if b.signature_checked else
           "signed, signature not checked (no --public-key)" if b.signed else "unsigned")
    print(f"ok {args.file}: {m.name} {m.version} ({m.created}), {len(m.files)} files, {sig}, "
          f"manifest sha256 {b.digest}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="adapterctl", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("validate", help="check a config file; prints what it defines or every problem")
    s.add_argument("file")
    s.set_defaults(fn=cmd_validate)

    s = sub.add_parser("render-envoy", help="generate the Envoy bootstrap from a config")
    s.add_argument("file")
    s.add_argument("-o", "--output", help="output file (default: stdout)")
    s.add_argument("--workers", type=int, help="processor workers (default: config, else CPU count)")
    s.add_argument("--check", action="store_true", help="also run `envoy --mode validate` on the result")
    s.add_argument("--xds-dir", metavar="DIR", help="a bootstrap reading listener, routes, clusters and endpoints "
                   "from files in DIR (written too), for `adapterctl serve --xds-dir DIR` to keep current")
    s.set_defaults(fn=cmd_render_envoy)

    s = sub.add_parser("serve", help="run the processor (supervisor and workers) in the foreground")
    s.add_argument("file")
    s.add_argument("--workers", type=int)
    s.add_argument("--base-port", type=int)
    s.add_argument("--admin-port", type=int)
    s.add_argument("--endpoint", type=_endpoint_arg, action="append", metavar="NAME=HOST:PORT",
                   help="point a backend at other endpoints (repeatable)")
    s.add_argument("--record-dir", help="write every ProcessingRequest received here (text format) for replay")
    s.add_argument("--xds-dir", metavar="DIR",
                   help="write Envoy's listener, routes, clusters and endpoints here (file-based xDS) at start "
                   "and after every accepted reload" + ("" if _xds_available() else
                                                        " [not available: extproc.xds is not installed]"))
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("reload", help="reload the running processor's config; prints each worker's generation",
                       description="POST /reload to the processor supervisor: the config file is validated "
                       "once and, when accepted, every worker moves to the new generation. Exit 0 when "
                       "accepted and every worker acknowledged, 1 when refused (reasons printed) or a worker "
                       "lagged.")
    s.add_argument("--admin", metavar="URL", help="the processor admin URL (default: http://127.0.0.1:PORT "
                   "with PORT the --config file's spec.processor.adminPort, else 9902)")
    s.add_argument("--config", metavar="FILE", help="the AdapterGateway file, for the default admin port")
    s.add_argument("--timeout", type=float, default=30.0)
    s.set_defaults(fn=cmd_reload)

    s = sub.add_parser("up", help="run Envoy, the processor and (with --simulate) backend simulators")
    s.add_argument("file")
    s.add_argument("--simulate", action="store_true",
                   help="start an OpenAI API simulator per backend and point the backend at it")
    s.add_argument("--port", type=int, help="listener port (default: the config's, 8080)")
    s.add_argument("--admin-port", type=int, help="Envoy admin port (default: the config's, 9901)")
    s.add_argument("--workers", type=int)
    s.add_argument("--run-dir", help="where to write the rendered Envoy config (default: a temp dir)")
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser("test", help="send one request through the gateway and show what the processor did")
    s.add_argument("--route", required=True, help="path, e.g. /v1/analyze")
    s.add_argument("--input", required=True, help="JSON body")
    s.add_argument("--url", default="http://127.0.0.1:8080", help="gateway URL")
    s.add_argument("--timeout", type=float, default=60.0)
    s.set_defaults(fn=cmd_test)

    s = sub.add_parser("bundle", help="build or verify an adapter bundle (a SHA256-manifested, optionally "
                       "signed ZIP)", description="Adapter bundles (canary/bundle.py, docs/canary.md). Exit 0 "
                       "when built or verified, 1 when refused (every problem on stderr as FILE: FIELD: REASON).")
    bsub = s.add_subparsers(dest="bundle_command", required=True)
    b = bsub.add_parser("build", help="zip every regular file of DIR with a manifest (and a signature)")
    b.add_argument("directory", metavar="DIR")
    b.add_argument("-o", "--output", required=True, metavar="FILE.zip")
    b.add_argument("--version", help="the bundle's version (default: the build time, YYYYMMDD.HHMMSS)")
    b.add_argument("--name", help="the bundle's name (default: DIR's name)")
    b.add_argument("--sign-key", metavar="KEY.pem", help="sign the manifest with this ed25519 private key (PEM)")
    b.set_defaults(fn=cmd_bundle)
    b = bsub.add_parser("verify", help="check every file's SHA256, the file list, paths, sizes and the signature")
    b.add_argument("file", metavar="FILE.zip")
    b.add_argument("--public-key", metavar="KEY.pub", help="the signature must verify with this ed25519 public "
                   "key (PEM or OpenSSH)")
    b.add_argument("--require-signature", action="store_true", help="refuse an unsigned bundle")
    b.set_defaults(fn=cmd_bundle)
    from canary.cli import register_bundle_load, register_restart

    register_bundle_load(bsub)  # bundle load (a running gateway)
    register_restart(sub)  # restart --rolling

    from extproc.logs_cli import register as register_logs
    from extproc.status_cli import register as register_status

    register_logs(sub)  # logs
    register_status(sub)  # status

    from extproc.k8s_render import register as register_render

    register_render(sub)  # render-k8s, render-compose
    from extproc.attribution_cli import register as register_attribution

    register_attribution(sub)  # attribution

    from extproc.semantic.cli import register

    register(sub)  # tools, align
    from canary.cli import register as register_canary

    register_canary(sub)  # canary status|promote|rollback|pause|resume

    for name, fn, text in (
        ("quota", cmd_quota, "per-tenant CPU use against the quota, throttling, admissions (--watch for live)"),
        ("rtt", cmd_rtt, "per-upstream TCP RTT histograms measured by the eBPF agent"),
        ("agent", cmd_agent, "run the tenant agent (eBPF CPU/RTT measurement, cgroup quotas); needs root"),
    ):
        s = sub.add_parser(name, help=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(fn=fn)

    s = sub.add_parser("worker", help=argparse.SUPPRESS)
    source = s.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a config file (a worker run by hand; SIGHUP re-reads it)")
    source.add_argument("--bundle-root", help="the supervisor's bundle root: serve `current` (SIGHUP loads it again)")
    s.add_argument("--address", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--index", type=int, default=0)
    s.add_argument("--shutdown-grace", type=float, default=5.0)
    s.add_argument("--endpoint", type=_endpoint_arg, action="append")
    s.add_argument("--record-dir")
    s.set_defaults(fn=cmd_worker)
    return p


def _xds_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("extproc.xds") is not None
    except (ImportError, ValueError):
        return False


_DELEGATED = {"quota": "ebpf.quota", "rtt": "ebpf.rtt", "agent": "ebpf.agent"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-") and a not in ("debug", "info", "warning", "error")), None)
    if command in _DELEGATED:  # bcc-style tools with their own argparse (and --help, --ebpf)
        import importlib

        rest = argv[argv.index(command) + 1:]
        return importlib.import_module(_DELEGATED[command]).main(rest)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"invalid config:\n{e}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError) as e:
        print(f"adapterctl {args.command}: {e}", file=sys.stderr)
        return 3
