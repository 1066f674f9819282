"""Hypercorn's graceful stop, made to finish the HTTP/2 responses it has begun.

What: on shutdown, hypercorn 0.18 closes an HTTP/2 connection as soon as every stream on it is
closed from the application's side. Its sending task can still hold a response's last DATA frame
or its END_STREAM at that moment: the socket is closed before they are written and the client
(Envoy) sees the stream reset after its response started, which it must not retry (seen as one
503 ``upstream_reset_after_response_started`` in a few thousand requests when a simulator
endpoint is stopped with SIGTERM under load, tests/e2e/test_reliability.py).

How: `install()` wraps ``TCPServer._initiate_server_close`` so that, before closing, it waits
until the connection's HTTP/2 send buffers are empty (hypercorn deletes a stream's buffer after it
has written END_STREAM), polling every 2 ms for at most `DRAIN_WAIT_S`. HTTP/1.1 connections
close as before (their responses are written before the stream closes).

Cost: nothing while serving; at shutdown at most `DRAIN_WAIT_S` per connection, in parallel.

`reap_after()` is the hard stop behind the graceful one. Hypercorn cancels the tasks still running
when its `graceful_timeout` ends, once; a request task whose application was cancelled then sends
hypercorn's own 500 in a `finally` and waits there for a send buffer that the closed connection
never drains, so the cancel is spent and the process never exits (seen about once in ten SIGTERMs
under load: the simulator's loop idle, one Envoy stream left waiting until its timeout). The
reaper cancels every other task again, every 50 ms, until the server has returned.

Used by the OpenAI/vLLM simulator and our ONNX Runtime server, both of which pin hypercorn
0.18.0 (pyproject.toml); `install()` leaves other versions alone and says so, since it reaches
into hypercorn's internals.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("backends.hypercorn_drain")

DRAIN_WAIT_S = 1.0
PATCHED_VERSION = "0.18.0"
_MARK = "_adapter_gateway_drains"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hypercorn")
    except PackageNotFoundError:  # pragma: no cover - hypercorn is a dependency
        return ""


def pending_h2_sends(server: object) -> int:
    """Streams of `server`'s (a hypercorn TCPServer) HTTP/2 connection whose response is not
    fully written yet; 0 for HTTP/1.1 or when it cannot tell."""
    wrapper = getattr(server, "protocol", None)
    protocol = getattr(wrapper, "protocol", None)
    buffers = getattr(protocol, "stream_buffers", None)
    if not isinstance(buffers, dict) or getattr(protocol, "closed", False):
        return 0
    return len(buffers)


async def drain(server: object, wait_s: float = DRAIN_WAIT_S, poll_s: float = 0.002) -> int:
    """Wait until `server`'s HTTP/2 responses are fully written, for at most `wait_s`.
    Returns how many were still pending when it gave up (0: all written)."""
    deadline = time.monotonic() + wait_s
    while (pending := pending_h2_sends(server)) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    return pending_h2_sends(server)


def install() -> bool:
    """Patch hypercorn's TCPServer once (idempotent). Returns whether the patch is in place."""
    from hypercorn.asyncio.tcp_server import TCPServer

    if getattr(TCPServer, _MARK, False):
        return True
    found = _version()
    if found != PATCHED_VERSION:
        log.warning("hypercorn %s (not %s): graceful stop left as it is; an HTTP/2 response being "
                    "written at shutdown may be cut", found or "?", PATCHED_VERSION)
        return False
    original = TCPServer._initiate_server_close

    async def _initiate_server_close(self) -> None:
        left = await drain(self)
        if left:
            log.warning("closing a connection with %d HTTP/2 responses not fully written after %.1f s",
                        left, DRAIN_WAIT_S)
        await original(self)

    TCPServer._initiate_server_close = _initiate_server_close
    setattr(TCPServer, _MARK, True)
    return True


async def reap_after(shutdown_event: asyncio.Event, delay_s: float, protect: set[asyncio.Task],
                     every_s: float = 0.05) -> None:
    """Once `shutdown_event` is set and `delay_s` more have passed, cancel every task other than
    `protect` and this one, again every `every_s`, until cancelled itself (the caller cancels it
    when its server has returned)."""
    await shutdown_event.wait()
    await asyncio.sleep(delay_s)
    me = asyncio.current_task()
    warned = False
    while True:
        others = [t for t in asyncio.all_tasks() if t is not me and t not in protect and not t.done()]
        if others and not warned:
            log.warning("%d tasks still running %.1f s after the stop began; cancelling them", len(others), delay_s)
            warned = True
        for task in others:
            task.cancel()
        await asyncio.sleep(every_s)

