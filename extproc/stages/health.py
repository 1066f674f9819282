"""Stage `health`: `GET /health/adapter?probe=protocol-negotiation`, answered by the processor.

What: reports the processor worker's own status and, for `probe=protocol-negotiation` (the
default), probes every backend (see `extproc/probe.py`) and negotiates again with every
OpenAI-compatible one (`extproc/negotiate.py`: each backend's `dialect`, what its endpoints
answered, and per route with an output schema how it is asked for: `structured_output`). 200 when
all are ok, 503 with `failed` naming what is not (a backend down, a route whose backend cannot
constrain output and whose policy is to refuse); `probe=processor` checks only the processor. When the processor itself is
down, Envoy answers 503 instead (the route fails closed).
Cost: bounded by the probe timeout (0.5 s) plus the negotiation's wait (0.3 s, after the probes),
which stays under Envoy's message timeout (1 s by default).
"""

from __future__ import annotations

import asyncio
import os
import time
from urllib.parse import parse_qs, urlsplit

import orjson

from extproc.errors import reject
from extproc.negotiate import negotiator, route_notes
from extproc.probe import probe_backend
from extproc.types import HttpMessage, RequestState, Respond, Verdict

PROBES = ("protocol-negotiation", "processor")


class Health:
    name = "health"

    def __init__(self, timeout: float = 0.5, negotiate_timeout: float = 0.3):
        self.timeout = timeout
        self.negotiate_timeout = negotiate_timeout  # longer: the previous result, the negotiation goes on
        self.started = time.time()  # without a runtime (unit tests); the runtime's outlives reloads

    async def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict:
        query = parse_qs(urlsplit((msg.headers or {}).get(":path", "")).query)
        probe = (query.get("probe") or ["protocol-negotiation"])[0]
        if probe not in PROBES:
            return reject(400, "unknown_probe", f"unknown probe {probe!r}; known: {', '.join(PROBES)}")
        snap = state.snapshot
        body: dict = {
            "status": "ok",
            "probe": probe,
            "processor": {"status": "serving", "pid": os.getpid(), "config": snap.name,
                          "generation": snap.generation, "digest": snap.digest,
                          "uptime_s": round(time.time() - (state.runtime.started if state.runtime is not None
                                                           else self.started), 1)},
        }
        failed: list[str] = []
        if probe == "protocol-negotiation":
            names = list(snap.backends)
            # what each OpenAI-compatible backend accepts (its dialect), kept in the worker's runtime
            # (without one, in unit tests of this stage, nothing is negotiated)
            negotiating = negotiator(state.runtime)
            # the probes first, then the negotiation (not at the same time: a single-threaded server
            # would answer the probe late), within what is left of Envoy's message timeout
            results = await asyncio.gather(*(probe_backend(snap.backends[n], self.timeout) for n in names))
            dialects = await asyncio.gather(*(negotiating.negotiate(snap.backends[n], self.negotiate_timeout)
                                              for n in names if state.runtime is not None))
            dialects = dialects or [{"source": "not applicable"}] * len(names)
            for r, d in zip(results, dialects):
                if d.get("source") != "not applicable":
                    r["dialect"] = d
            body["backends"] = dict(zip(names, results))
            failed = [f"backend {n}" for n, r in zip(names, results) if r["status"] != "ok"]
            notes, refused = route_notes(snap, negotiating)
            if notes:
                body["structured_output"] = notes
            failed += refused
        if failed:
            body["status"] = "degraded"
            body["failed"] = failed
        status = 503 if failed else 200
        return Respond(status, orjson.dumps(body), "health_ok" if status == 200 else "health_failed")
