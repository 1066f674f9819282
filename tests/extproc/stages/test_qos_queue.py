"""Stage `qos-queue` (extproc/stages/qos_queue.py) through `ExtProcService.Process` with a real Runtime and
compiled config: while the pool's one slot is held a request's stream gets no reply to its body, the waiting
ones are admitted by class once the slot frees, the refusal shapes (429 for P2, 503 for P1) are the route's
OpenAI dialect, and no slot leaks when a client disconnects while queued or a stream is reset after
admission. Order and outcomes are asserted, never durations."""

from __future__ import annotations

import asyncio

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_text
from extproc.metrics import ProcessorMetrics
from extproc.runtime import Runtime
from extproc.stream import ConfigRef, ExtProcService
from tests.extproc.test_stream import _Context

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: q}
spec:
  tenants: [{id: gold}, {id: std}, {id: batch}]
  backends: [{name: llm, endpoints: ["127.0.0.1:9"], models: [m]}, {name: free, endpoints: ["127.0.0.1:10"], models: [f]}]
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: api, targets: [llm, free]}
  qos:
    tenants: [{tenant: gold, priorityClass: P0}, {tenant: batch, priorityClass: P2}]
    admission:
      - {backend: llm, initialLimit: 1, minLimit: 1, maxLimit: 1, maxQueue: 2, maxWait: 500ms, retryAfter: 3}
"""


def service():
    rt = Runtime()
    svc = ExtProcService(ConfigRef(load_text(CONFIG, "q.yaml")), ProcessorMetrics(CollectorRegistry()), runtime=rt)
    return svc, rt


def headers():
    r = pb.ProcessingRequest()
    for k, v in ((":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")):
        h = r.request_headers.headers.headers.add()
        h.key, h.raw_value = k, v.encode()
    return r


def body(model="m"):
    r = pb.ProcessingRequest()
    r.request_body.body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    r.request_body.end_of_stream = True
    return r


class Stream:
    """One ext_proc stream: Envoy's messages fed one at a time; `replies` as they come."""

    def __init__(self, svc, tenant, name, log):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.replies: list = []
        self.name, self.log = name, log

        async def source():
            while True:
                m = await self.inbox.get()
                if m is None:
                    return
                yield m

        async def consume():
            async for r in svc.Process(source(), _Context(("x-adapter-route", "api"), ("x-adapter-tenant", tenant))):
                self.replies.append(r)
                if len(self.replies) == 2:
                    log.append(name)

        self.task = asyncio.create_task(consume())

    async def send(self, *msgs):
        for m in msgs:
            await self.inbox.put(m)
        await settle()

    async def end(self):
        await self.inbox.put(None)
        await asyncio.wait_for(self.task, 5)


async def settle():
    """Let every ready coroutine run (the streams' generators hand messages over in several steps)."""
    for _ in range(50):
        await asyncio.sleep(0)


def pool(rt):
    return rt.admission.pools["llm"]


def error_of(reply):
    ir = reply.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() or h.header.value for h in ir.headers.set_headers}
    return ir.status.code, orjson.loads(ir.body), hdrs


async def test_waiting_streams_get_no_reply_until_admitted_by_class():
    svc, rt = service()
    log: list = []
    a = Stream(svc, "std", "a", log)
    await a.send(headers(), body())
    assert log == ["a"] and pool(rt).inflight() == 1
    b = Stream(svc, "std", "b-P1", log)
    c = Stream(svc, "gold", "c-P0", log)
    await b.send(headers(), body())
    await c.send(headers(), body())
    assert log == ["a"] and len(b.replies) == 1 and len(c.replies) == 1  # headers answered, bodies not
    assert pool(rt).queue.count == 2
    await a.end()  # a's request ends: its slot goes to the P0 request although it came second
    await c.send()
    assert log == ["a", "c-P0"]
    assert c.replies[1].request_body.response.header_mutation.set_headers  # dispatch's routing reply
    await c.end()
    await b.send()
    await b.end()
    assert log == ["a", "c-P0", "b-P1"] and pool(rt).inflight() == 0 and pool(rt).queue.count == 0


async def test_other_pools_are_not_limited():
    svc, rt = service()
    log: list = []
    a = Stream(svc, "std", "a", log)
    await a.send(headers(), body())
    f = Stream(svc, "std", "free", log)
    await f.send(headers(), body("f"))
    assert log == ["a", "free"] and pool(rt).inflight() == 1
    await a.end()
    await f.end()


async def test_full_queue_429_for_p2_and_503_for_p1_in_the_openai_dialect():
    svc, rt = service()
    log: list = []
    held = [Stream(svc, "std", f"s{i}", log) for i in range(3)]
    for s in held:
        await s.send(headers(), body())
    assert pool(rt).queue.count == 2
    p2 = Stream(svc, "batch", "p2", log)
    await p2.send(headers(), body())
    await asyncio.wait_for(p2.task, 5)
    status, doc, hdrs = error_of(p2.replies[1])
    assert status == 429 and doc["error"]["code"] == "overloaded" and doc["error"]["type"]
    assert hdrs.get("retry-after") == "3"
    p1 = Stream(svc, "std", "p1", log)
    await p1.send(headers(), body())
    await asyncio.wait_for(p1.task, 5)
    status, doc, _ = error_of(p1.replies[1])
    assert status == 503 and doc["error"]["code"] == "queue_full"
    for s in held:
        await s.end()
    assert pool(rt).inflight() == 0 and pool(rt).queue.count == 0


async def test_client_gone_while_queued_and_stream_reset_after_admission_leak_no_slot():
    svc, rt = service()
    log: list = []
    a = Stream(svc, "std", "a", log)
    await a.send(headers(), body())
    gone = Stream(svc, "std", "gone", log)
    await gone.send(headers(), body())
    assert pool(rt).queue.count == 1
    gone.task.cancel()  # Envoy resets the side stream: the client disconnected while its request waited
    await asyncio.gather(gone.task, return_exceptions=True)
    assert pool(rt).queue.count == 0 and pool(rt).queue.bytes == 0 and pool(rt).inflight() == 1
    b = Stream(svc, "std", "b", log)
    await b.send(headers(), body())
    await a.end()
    await b.send()
    assert log == ["a", "b"] and pool(rt).inflight() == 1
    b.task.cancel()  # admitted and dispatched, then the stream is reset (a worker's stream torn down)
    await asyncio.gather(b.task, return_exceptions=True)
    assert pool(rt).inflight() == 0 and pool(rt).own == 0
    assert not rt.lifecycle._open  # every request ended (on_done ran: the slot went with it)
