"""`adapterctl`: validate configs, render Envoy, run the processor or the whole stack, test a route.

Examples:
  adapterctl validate examples/finance-llm-adapter.yaml
  adapterctl render-envoy examples/finance-llm-adapter.yaml -o envoy/finance-llm-adapter.yaml --check
  adapterctl up examples/finance-llm-adapter.yaml --simulate        # what `make run` does
  adapterctl serve examples/finance-llm-adapter.yaml --workers 2    # processor only
  adapterctl test --route=/v1/analyze --input='{"query":"计算Q3营收"}'
  adapterctl tools tests/data/openapi/petstore.yaml --format mcp
  adapterctl align LEGACY.yaml ADAPTER_SCHEMA.json -o mapping.yaml --report report.md
  adapterctl quota --watch                                         # tenants' CPU against quotas
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
    snap = load_file(args.file)
    routes = [r for r in snap.routes.values() if r.kind != "health"]
    print(f"{args.file}: valid AdapterGateway {snap.name!r}: {len(routes)} route(s), "
          f"{len(snap.backends)} backend(s), {len(snap.tenants)} tenant(s)")
    for r in routes:
        extra = f" model={r.model}" if r.kind in ("llm", "tensor") else ""
        path = r.path + ("*" if r.match == "prefix" else "")
        targets = ", ".join(b.name for b in r.backends)
        print(f"  route {r.name}: {path} -> {targets} ({r.kind}{extra}, failureMode={r.failure_mode})")
    for b in snap.backends.values():
        eps = ", ".join(f"{h}:{p}" for h, p in b.endpoints)
        print(f"  backend {b.name}: {b.kind} over {b.protocol} at {eps}" + (" (implicit)" if b.implicit else ""))
    return 0


def envoy_validate(path: str) -> tuple[bool, str]:
    from extproc.envoy_bin import find_envoy

    proc = subprocess.run([find_envoy(), "--mode", "validate", "-c", path, "--disable-hot-restart", "-l", "error"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def cmd_render_envoy(args: argparse.Namespace) -> int:
    from extproc.envoy_render import render_yaml

    snap = load_file(args.file)
    text = render_yaml(snap, args.workers)
    out = args.output
    if out and out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    else:
        sys.stdout.write(text)
    if args.check:
        target = out if out and out != "-" else None
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
            os._exit(130)
        self.stop.set()

    def wait(self) -> None:
        while not self.stop.wait(0.5):
            pass


def cmd_serve(args: argparse.Namespace) -> int:
    from extproc.supervisor import Supervisor

    signals = _Signals()
    snap = load_file(args.file)
    proc = snap.processor
    workers = args.workers or proc.workers or os.cpu_count() or 1
    sup = Supervisor(args.file, proc.bind_address or proc.address, args.base_port or proc.base_port, workers,
                     args.admin_port or proc.admin_port, proc.shutdown_grace, log_level=args.log_level,
                     admin_address=proc.bind_address or "127.0.0.1",
                     endpoints=dict(args.endpoint or ()), record_dir=args.record_dir)
    sup.start()
    signal.signal(signal.SIGHUP, lambda *_: sup.reload())
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
    signal.signal(signal.SIGHUP, lambda *_: stack.supervisor.reload())
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

    return run_worker(WorkerSettings(args.config, args.address, args.port, args.index, args.shutdown_grace,
                                     endpoints=tuple(args.endpoint or ()), record_dir=args.record_dir))


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
    s.set_defaults(fn=cmd_render_envoy)

    s = sub.add_parser("serve", help="run the processor (supervisor and workers) in the foreground")
    s.add_argument("file")
    s.add_argument("--workers", type=int)
    s.add_argument("--base-port", type=int)
    s.add_argument("--admin-port", type=int)
    s.add_argument("--endpoint", type=_endpoint_arg, action="append", metavar="NAME=HOST:PORT",
                   help="point a backend at other endpoints (repeatable)")
    s.add_argument("--record-dir", help="write every ProcessingRequest received here (text format) for replay")
    s.set_defaults(fn=cmd_serve)

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

    from extproc.semantic.cli import register

    register(sub)  # tools, align

    for name, fn, text in (
        ("quota", cmd_quota, "per-tenant CPU use against the quota, throttling, admissions (--watch for live)"),
        ("rtt", cmd_rtt, "per-upstream TCP RTT histograms measured by the eBPF agent"),
        ("agent", cmd_agent, "run the tenant agent (eBPF CPU/RTT measurement, cgroup quotas); needs root"),
    ):
        s = sub.add_parser(name, help=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(fn=fn)

    s = sub.add_parser("worker", help=argparse.SUPPRESS)
    s.add_argument("--config", required=True)
    s.add_argument("--address", default="127.0.0.1")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--index", type=int, default=0)
    s.add_argument("--shutdown-grace", type=float, default=5.0)
    s.add_argument("--endpoint", type=_endpoint_arg, action="append")
    s.add_argument("--record-dir")
    s.set_defaults(fn=cmd_worker)
    return p


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
