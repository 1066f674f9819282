"""Benchmark: our ONNX Runtime server with dynamic batching off and on (a benchmark, never a test).

What: one server process (``python -m backends.onnxruntime``) serves a bench repository built at
start (the demo ``fraud-mlp``, int8 active, 8-32-16-2; and ``wide-mlp``, fp32 128-1536x3-2, 20 MB
of weights, where a single row is a memory-bound GEMV and stacking rows pays off most).  For each model, batching
is switched at run time through the admin endpoint (off: ``max_batch_size`` 1; on: the
``--batch``/``--delay-us`` settings), and each offered rate is measured **open-loop**: Poisson
arrivals at a fixed rate, each request sent on an idle keep-alive HTTP/1.1 connection (a new one
is opened when none is idle, up to ``--max-connections``; beyond that requests wait in the
client, and that wait counts).  Latency runs from a request's scheduled arrival to the last byte of
its answer, so a saturated server shows up as growing latency, not as a politely slower client.
Then one **closed-loop** point per mode (``--closed`` concurrent clients back to back) gives the
saturation throughput.  Requests are what ``tritonclient.http`` sends with ``binary_data=True``
(binary tensor extension, one row of random features), outputs binary.
Per point: achieved throughput, p50/p90/p99/max latency, errors, mean rows per ``session.run``
(from the server's ``ort_batch_size`` histogram) and server CPU per request (/proc).
Prints a table and, unless ``--no-write``, appends a dated section to perf/RESULTS.md.

Run: ``.venv/bin/python perf/bench_ort_batching.py [--duration 5] [--rates fraud-mlp=500,1000,...]
[--no-write]``.  A default run takes about three minutes.  The load generator is Python (uvloop,
raw HTTP/1.1) in this process; server and client share the machine's cores, which is said in the
results.  Everything it starts is stopped by PID on exit.

Cost: none at serving time; this file is a tool.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script\'s folder, on sys.path)

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import orjson  # noqa: E402

from backends.onnxruntime.models import build_mlp, write_fraud_mlp  # noqa: E402

RESULTS = REPO / "perf" / "RESULTS.md"
DEFAULT_RATES = {"fraud-mlp": (500, 1000, 1500, 2500), "wide-mlp": (200, 400, 700, 1000, 1500)}
WIDE = (128, 1536, 1536, 1536, 2)  # 20 MB of fp32 weights: one row is a memory-bound GEMV (~1.2 ms here)
WARMUP_S = 1.0


@dataclasses.dataclass
class Point:
    model: str
    mode: str  # "off" or "on"
    load: str  # "open 500/s" or "closed 64"
    offered: float | None
    completed: int = 0  # requests scheduled in the window that were answered 200
    answered: int = 0  # 200 answers that arrived within the window (the throughput)
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = dataclasses.field(default_factory=list)
    rows_per_run: float = 0.0
    cpu_seconds: float = 0.0  # server CPU during the measured seconds
    other_cores: float = 0.0  # CPU used by everything but the server and this load generator, in cores
    skipped: bool = False  # not run: a lower rate already saturated the server in this mode
    cpu_us_per_request: float = 0.0
    max_connections_used: int = 0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("nan")

    @property
    def throughput(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0


# -- the server --------------------------------------------------------------------------------------


def build_repository(root: Path) -> None:
    write_fraud_mlp(root)
    wide = root / "wide-mlp" / "1"
    wide.mkdir(parents=True, exist_ok=True)
    (wide / "model.onnx").write_bytes(build_mlp(list(WIDE), seed=11, name="wide-mlp").SerializeToString())
    (root / "wide-mlp" / "config.yaml").write_text("precision_order: [fp32]\nmax_batch_size: 32\nwarmup: true\n")


def start_server(repository: Path, threads: int | None) -> tuple[subprocess.Popen, int]:
    args = [sys.executable, "-m", "backends.onnxruntime", "--repository", str(repository), "--port", "0"]
    if threads:
        args += ["--threads", str(threads)]
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline and process.poll() is None:
            if selector.select(timeout=0.2):
                line = process.stdout.readline()
                match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if match:
                    return process, int(match.group(1))
    stop(process)
    raise SystemExit("the server did not start")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch_totals(base: str, model: str) -> tuple[float, float]:
    """(rows run, session.run calls) so far, from the server's ort_batch_size histogram."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    rows = runs = 0.0
    for line in text.splitlines():
        if line.startswith(f'ort_batch_size_sum{{model="{model}"}}'):
            rows = float(line.split()[-1])
        elif line.startswith(f'ort_batch_size_count{{model="{model}"}}'):
            runs = float(line.split()[-1])
    return rows, runs


# -- the load generator -----------------------------------------------------------------------------


def request_bytes(model: str, width: int, port: int, seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal((1, width)).astype(np.float32)
    head = orjson.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, width],
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "scores", "parameters": {"binary_data": True}}]})
    body = head + x.tobytes()
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(head)}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def call(self, payload: bytes) -> int:
        self.writer.write(payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        match = re.search(rb"(?i)content-length:\s*(\d+)", head)
        await self.reader.readexactly(int(match.group(1)) if match else 0)
        return status

    def close(self) -> None:
        self.writer.close()


class Pool:
    def __init__(self, port: int, limit: int) -> None:
        self.port, self.limit = port, limit
        self.idle: list[Connection] = []
        self.opened = 0
        self.waiters: list[asyncio.Future] = []

    async def acquire(self) -> Connection:
        if self.idle:
            return self.idle.pop()
        if self.opened < self.limit:
            self.opened += 1
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            return Connection(reader, writer)
        future = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        return await future

    def release(self, conn: Connection | None) -> None:
        if conn is None:
            self.opened -= 1
            return
        while self.waiters:
            waiter = self.waiters.pop(0)
            if not waiter.done():
                waiter.set_result(conn)
                return
        self.idle.append(conn)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


async def cpu_marker(pid: int, measure_from: float, measure_to: float, point: Point) -> None:
    """Server CPU seconds, and other processes' load, between the two instants (the measured window)."""
    await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
    server0, busy0, own0, t0 = cpu_seconds(pid), machine_busy_seconds(), time.process_time(), time.perf_counter()
    await asyncio.sleep(max(0.0, measure_to - time.perf_counter()))
    server1, busy1, own1, t1 = cpu_seconds(pid), machine_busy_seconds(), time.process_time(), time.perf_counter()
    point.cpu_seconds = server1 - server0
    point.other_cores = max(0.0, (busy1 - busy0) - (server1 - server0) - (own1 - own0)) / (t1 - t0)


async def _one(pool: Pool, payload: bytes, scheduled: float, point: Point, window: tuple[float, float]) -> None:
    conn = None
    try:
        conn = await pool.acquire()
        status = await conn.call(payload)
        ok = status == 200
    except (OSError, asyncio.IncompleteReadError, ValueError):
        ok = False
        if conn is not None:
            conn.close()
        conn = None
    finally:
        pool.release(conn)
    done = time.perf_counter()
    if ok and window[0] <= done < window[1]:
        point.answered += 1
    if window[0] <= scheduled < window[1]:
        if ok:
            point.completed += 1
            point.latencies.append(done - scheduled)
        else:
            point.errors += 1


async def open_loop(pid: int, port: int, payloads: list[bytes], rate: float, duration: float, point: Point,
                    max_connections: int) -> None:
    pool = Pool(port, max_connections)
    rng = random.Random(1)
    tasks: set[asyncio.Task] = set()
    start = time.perf_counter()
    measure_from, measure_to = start + WARMUP_S, start + WARMUP_S + duration
    marker = asyncio.ensure_future(cpu_marker(pid, measure_from, measure_to, point))
    next_at, i = start, 0
    while next_at < measure_to:
        now = time.perf_counter()
        if next_at > now:
            await asyncio.sleep(next_at - now)
        task = asyncio.ensure_future(_one(pool, payloads[i % len(payloads)], next_at, point,
                                          (measure_from, measure_to)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        next_at += rng.expovariate(rate)
    await marker
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    point.seconds = duration
    point.max_connections_used = pool.opened
    pool.close()


async def closed_loop(pid: int, port: int, payloads: list[bytes], clients: int, duration: float,
                      point: Point) -> None:
    start = time.perf_counter()
    measure_from, measure_to = start + WARMUP_S, start + WARMUP_S + duration
    marker = asyncio.ensure_future(cpu_marker(pid, measure_from, measure_to, point))

    async def client(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conn, j = Connection(reader, writer), k
        while True:
            sent = time.perf_counter()
            if sent >= measure_to:
                break
            try:
                ok = await conn.call(payloads[j % len(payloads)]) == 200
            except (OSError, asyncio.IncompleteReadError):
                ok = False
            j += 1
            done = time.perf_counter()
            if ok and measure_from <= done < measure_to:
                point.answered += 1
            if sent >= measure_from:
                if ok:
                    point.completed += 1
                    point.latencies.append(done - sent)
                else:
                    point.errors += 1
        conn.close()

    await asyncio.gather(*(client(k) for k in range(clients)), marker)
    point.seconds = duration
    point.max_connections_used = clients


# -- the run ------------------------------------------------------------------------------------------


def set_batching(base: str, model: str, batch: int, delay_us: int) -> None:
    response = httpx.post(f"{base}/admin/models/{model}/batching",
                          json={"max_batch_size": batch, "max_queue_delay_us": delay_us}, timeout=10)
    response.raise_for_status()


def measure(process: subprocess.Popen, port: int, point: Point, runner) -> Point:
    base = f"http://127.0.0.1:{port}"
    rows0, runs0 = batch_totals(base, point.model)
    runner()
    rows1, runs1 = batch_totals(base, point.model)
    point.rows_per_run = (rows1 - rows0) / (runs1 - runs0) if runs1 > runs0 else 0.0
    point.cpu_us_per_request = point.cpu_seconds / point.answered * 1e6 if point.answered else 0.0
    print(f"  {point.model:10} batching {point.mode:3} {point.load:13} -> {point.throughput:8.1f}/s "
          f"p50 {point.pct(50):7.2f} p99 {point.pct(99):8.2f} ms, rows/run {point.rows_per_run:5.2f}, "
          f"errors {point.errors}, other load {point.other_cores:.2f} cores", flush=True)
    return point


def machine() -> str:
    import onnxruntime

    return (f"{benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}; "
            f"onnxruntime {onnxruntime.__version__} ({', '.join(onnxruntime.get_available_providers())})")


def report(points: list[Point], args: argparse.Namespace, command: str) -> str:
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## {when}: bench_ort_batching (ONNX Runtime server, dynamic batching off vs on)",
        "",
        f"- Machine: {machine()}",
        f"- Code: git {benchenv.git_revision()} (plus the working tree)",
        f"- Command: `{command}`; {WARMUP_S:.0f} s warm-up then {args.duration:g} s measured per point",
        f"- Server: `python -m backends.onnxruntime` (uvicorn + httptools, HTTP/1.1), thread pool {args.threads or 'default'}, "
        "1 instance per model, `intra_op_threads` 1. Batching off = `max_batch_size` 1; on = "
        f"`max_batch_size` {args.batch}, `max_queue_delay_us` {args.delay_us}, switched at run time through "
        "`POST /admin/models/{m}/batching` on the same server process.",
        f"- Models: `fraud-mlp` (8-32-16-2, int8 variant active, the demo model); `wide-mlp` "
        f"({'-'.join(map(str, WIDE))}, fp32, 20 MB of weights: a single row is a memory-bound GEMV). One row of features per request, binary tensors.",
        "- Load: open-loop Poisson arrivals at the offered rate over keep-alive HTTP/1.1 connections (up to "
        f"{args.max_connections}; latency from the scheduled arrival, so client-side waiting counts), and one "
        f"closed-loop point with {args.closed} clients back to back. The Python load generator and the server "
        f"share the same {os.cpu_count()} cores over loopback.",
        "",
        "Latency in ms (of the requests scheduled in the measured seconds); req/s = 200 answers that arrived in the measured seconds, per second; rows/run = mean rows per `session.run` (server "
        "histogram, warm-up included); CPU = server process CPU (user+sys) in the measured seconds per answered request.",
        "",
        "| model | batching | load | req/s | p50 | p90 | p99 | max | rows/run | server CPU us/req | errors "
        "| other load (cores) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        if p.skipped:
            lines.append(f"| {p.model} | {p.mode} | {p.load} | skipped: a lower rate already saturated the "
                         "server (p50 over 2 s) | | | | | | | | |")
            continue
        lines.append(f"| {p.model} | {p.mode} | {p.load} | {p.throughput:,.0f} | {p.pct(50):.2f} | {p.pct(90):.2f} | "
                     f"{p.pct(99):.2f} | {p.pct(100):.2f} | {p.rows_per_run:.2f} | {p.cpu_us_per_request:,.0f} | "
                     f"{p.errors} | {p.other_cores:.2f} |")
    lines.append("")
    lines.append(summary(points))
    lines.append("")
    return "\n".join(lines)


def summary(points: list[Point]) -> str:
    out = []
    for model in dict.fromkeys(p.model for p in points):
        closed = {p.mode: p for p in points if p.model == model and p.offered is None}
        if "off" in closed and "on" in closed and closed["off"].throughput:
            gain = closed["on"].throughput / closed["off"].throughput
            out.append(f"{model}: closed-loop saturation {closed['off'].throughput:,.0f} req/s off vs "
                       f"{closed['on'].throughput:,.0f} on ({gain:.2f}x), p99 {closed['off'].pct(99):.1f} vs "
                       f"{closed['on'].pct(99):.1f} ms.")
        opened = [(p_off, p_on) for p_off in points for p_on in points
                  if p_off.model == p_on.model == model and p_off.offered and p_off.offered == p_on.offered
                  and (p_off.mode, p_on.mode) == ("off", "on")]
        for p_off, p_on in opened:
            off = "saturated (skipped)" if p_off.skipped else f"p99 {p_off.pct(99):.2f} ms, {p_off.throughput:,.0f}/s"
            on = "saturated (skipped)" if p_on.skipped else f"p99 {p_on.pct(99):.2f} ms, {p_on.throughput:,.0f}/s"
            out.append(f"  at {p_off.offered:,.0f}/s offered: off {off}; on {on}.")
    return "Summary:\n\n```\n" + "\n".join(out) + "\n```"


def parse_rates(text: str | None) -> dict[str, tuple[float, ...]]:
    rates = dict(DEFAULT_RATES)
    for item in filter(None, (text or "").split(";")):
        model, _, values = item.partition("=")
        rates[model.strip()] = tuple(float(v) for v in values.split(",") if v)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--rates", default=None,
                        help="offered rates per model, e.g. 'fraud-mlp=500,1000;wide-mlp=100,200'")
    parser.add_argument("--models", default="fraud-mlp,wide-mlp")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_size when batching is on")
    parser.add_argument("--delay-us", type=int, default=1000, help="max_queue_delay_us when batching is on")
    parser.add_argument("--closed", type=int, default=32, help="clients of the closed-loop point")
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="server inference thread pool size")
    parser.add_argument("--no-write", action="store_true", help="print only; RESULTS.md untouched")
    args = parser.parse_args(argv)
    rates = parse_rates(args.rates)
    command = "python perf/bench_ort_batching.py " + " ".join(argv if argv is not None else sys.argv[1:])

    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None

    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="ort-bench-") as tmp:
        repository = Path(tmp) / "models"
        build_repository(repository)
        process, port = start_server(repository, args.threads)
        base = f"http://127.0.0.1:{port}"
        try:
            for model in [m.strip() for m in args.models.split(",") if m.strip()]:
                width = WIDE[0] if model == "wide-mlp" else 8
                payloads = [request_bytes(model, width, port, seed) for seed in range(64)]
                for mode in ("off", "on"):
                    set_batching(base, model, 1 if mode == "off" else args.batch, args.delay_us)
                    saturated = False
                    for rate in rates.get(model, ()):
                        point = Point(model, mode, f"open {rate:,.0f}/s", rate)
                        if saturated:
                            point.skipped = True
                            points.append(point)
                            continue
                        with asyncio.Runner(loop_factory=loop_factory) as runner:
                            points.append(measure(process, port, point, lambda: runner.run(
                                open_loop(process.pid, port, payloads, rate, args.duration, point,
                                          args.max_connections))))
                        saturated = point.pct(50) > 2000
                    point = Point(model, mode, f"closed {args.closed}", None)
                    with asyncio.Runner(loop_factory=loop_factory) as runner:
                        points.append(measure(process, port, point, lambda: runner.run(
                            closed_loop(process.pid, port, payloads, args.closed, args.duration, point))))
        finally:
            stop(process)

    text = report(points, args, command.strip())
    print()
    print(text)
    if not args.no_write:
        with RESULTS.open("a", encoding="utf-8") as handle:
            handle.write("\n" + text)
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
