"""A small closed-loop HTTP load generator for the reliability tests and `perf/bench_reliability.py`.

What: `Load(url, requests, connections=8, streams=4)` runs, in its own thread and event loop,
`connections` httpx clients (HTTP/2 with prior knowledge by default, like `h2load -c 8 -m 4`; or
HTTP/1.1 with `streams` connections each) each keeping `streams` requests in flight, cycling
through `requests` (`Req(method, path, body)`). Every answer is counted by status and, for a
non-2xx one, by the `code` of the JSON error body (Envoy's own replies carry its response code
details there, e.g. `upstream_reset_before_response_started{connection_termination}`; the
processor's carry its reason); a transport error counts as status 0 with the exception's name
(`LocalProtocolError` over HTTP/2 is mostly Envoy answering early, a 503 before the body was
read, and resetting the stream while httpx still sends the body: a failure all the same).
`with Load(...) as load:` starts it; leaving the block stops it (requests in flight finish).
`load.requests` can be changed while it runs (reload tests add and remove routes).
`H2load(url, req, seconds, connections=8, streams=4)` runs `h2load` (Debian nghttp2-client; `make
setup` installs it) against one route instead and reads its summary into the same `Report`
(`by_status` from its status-code line; errored and timed-out requests as status 0). Use it where
the server sends GOAWAY: python's h2 (under httpx) fails every stream of a connection that got one,
even a graceful GOAWAY whose streams RFC 9113 lets finish (a client bug, not a gateway failure).
Cost: about 1 ms of client CPU per request (httpx); on this 2-core machine the client takes a
share of the cores the gateway uses, which lowers throughput but not the failure count. h2load
costs a few microseconds per request.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    body: bytes | None = None
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


@dataclass
class Report:
    sent: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_code: collections.Counter = field(default_factory=collections.Counter)  # (path, status, code) of failures
    samples: list[str] = field(default_factory=list)  # the first two failures' bodies of each kind
    seconds: float = 0.0

    @property
    def ok(self) -> int:
        return sum(n for s, n in self.by_status.items() if 200 <= s < 300)

    @property
    def failed(self) -> int:
        return self.sent - self.ok

    def summary(self) -> str:
        codes = ", ".join(f"{p} {s} {c}: {n}" for (p, s, c), n in self.by_code.most_common(6))
        return (f"{self.sent} requests in {self.seconds:.1f}s, {self.failed} failed"
                + (f" ({codes})" if codes else ""))


class Load:
    def __init__(self, url: str, requests: list[Req], connections: int = 8, streams: int = 4,
                 http2: bool = True, timeout: float = 10.0, ok=lambda r: 200 <= r.status_code < 300):
        self.url = url
        self.requests: list[Req] = list(requests)
        self.connections, self.streams, self.http2, self.timeout = connections, streams, http2, timeout
        self.ok = ok
        self.report = Report()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="load")
        self._started = 0.0

    def _record(self, req: Req, status: int, code: str, text: str) -> None:
        with self._lock:
            self.report.sent += 1
            self.report.by_status[status] += 1
            if not 200 <= status < 300:
                self.report.by_code[(req.path, status, code)] += 1
                if self.report.by_code[(req.path, status, code)] <= 2 and len(self.report.samples) < 20:
                    self.report.samples.append(f"{req.method} {req.path}: {status} {text[:300]}")

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        n = i
        while not self._stop.is_set():
            reqs = self.requests
            req = reqs[n % len(reqs)]
            n += 1
            try:
                r = await client.request(req.method, self.url + req.path, content=req.body, headers=dict(req.headers))
            except httpx.HTTPError as e:
                self._record(req, 0, type(e).__name__, repr(e))
                continue
            if self.ok(r):
                self._record(req, 200 if 200 <= r.status_code < 300 else r.status_code, "", "")
                continue
            code = ""
            try:
                doc = json.loads(r.content)
                err = doc.get("error") if isinstance(doc, dict) else None
                code = str(err.get("code") if isinstance(err, dict) else err or "")[:120]
                if isinstance(err, dict) and err.get("flags") not in (None, "", "-"):
                    code += f" [{err['flags']}]"  # %RESPONSE_FLAGS%, where the local reply carries it
            except ValueError:
                code = r.text[:80]
            self._record(req, r.status_code if r.status_code >= 300 else 599, code, r.text)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=1 if self.http2 else self.streams, max_keepalive_connections=None)
        clients = [httpx.AsyncClient(http1=not self.http2, http2=self.http2, limits=limits, timeout=self.timeout)
                   for _ in range(self.connections)]
        try:
            await asyncio.gather(*(self._one(c, i * self.streams + j) for i, c in enumerate(clients)
                                   for j in range(self.streams)))
        finally:
            for c in clients:
                await c.aclose()

    def _main(self) -> None:
        asyncio.run(self._run())

    def start(self) -> "Load":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> Report:
        self._stop.set()
        self._thread.join(self.timeout + 5)
        self.report.seconds = time.monotonic() - self._started
        return self.report

    def __enter__(self) -> "Load":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


H2LOAD = shutil.which("h2load")


class H2load:
    """`h2load -c connections -m streams -D seconds` on one route, in the background."""

    def __init__(self, url: str, req: Req, seconds: float, connections: int = 8, streams: int = 4):
        if H2LOAD is None:
            raise RuntimeError("h2load is not installed (Debian nghttp2-client; `make setup` installs it)")
        self.req, self.seconds = req, seconds
        self._body = None
        cmd = [H2LOAD, "-c", str(connections), "-m", str(streams), "-D", str(max(1, round(seconds))), "-t", "1"]
        for k, v in req.headers:
            cmd += ["-H", f"{k}: {v}"]
        if req.body is not None:
            self._body = tempfile.NamedTemporaryFile(suffix=".json")
            self._body.write(req.body)
            self._body.flush()
            cmd += ["-d", self._body.name]
        self.cmd = cmd + [url + req.path]
        self.proc: subprocess.Popen | None = None
        self.report = Report()
        self.output = ""

    def start(self) -> "H2load":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    def wait(self) -> Report:
        assert self.proc is not None
        self.output, _ = self.proc.communicate(timeout=self.seconds + 30)
        if self._body is not None:
            self._body.close()
        self.report = parse_h2load(self.output, self.req.path)
        self.report.seconds = self.seconds
        return self.report

    def __enter__(self) -> "H2load":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None and exc[0] is not None:
            self.proc.kill()
        self.wait()


def parse_h2load(text: str, path: str) -> Report:
    """h2load's summary: `requests: T total, S started, D done, OK succeeded, F failed, E errored,
    X timeout` and `status codes: A 2xx, B 3xx, C 4xx, D 5xx`."""
    r = Report()
    m = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
                  r"(\d+) errored, (\d+) timeout", text)
    c = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text)
    if not m or not c:
        raise RuntimeError(f"cannot read h2load's output:\n{text[-2000:]}")
    total, _started, done, _ok, _failed, errored, timeout = map(int, m.groups())
    ok2, ok3, bad4, bad5 = map(int, c.groups())
    r.sent = total
    r.by_status.update({200: ok2 + ok3, 400: bad4, 500: bad5, 0: total - ok2 - ok3 - bad4 - bad5})
    for status, n, what in ((400, bad4, "4xx"), (500, bad5, "5xx"), (0, errored, "errored"),
                            (0, timeout, "timeout"), (0, total - done - errored - timeout, "not done")):
        if n > 0:
            r.by_code[(path, status, what)] += n
    r.by_status = collections.Counter({k: v for k, v in r.by_status.items() if v})
    return r
