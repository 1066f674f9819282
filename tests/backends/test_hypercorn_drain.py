"""backends/hypercorn_drain.py: the graceful-stop patch waits for unwritten HTTP/2 responses."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from backends import hypercorn_drain


def _server(buffers: dict, closed: bool = False) -> SimpleNamespace:
    return SimpleNamespace(protocol=SimpleNamespace(protocol=SimpleNamespace(stream_buffers=buffers, closed=closed)))


def test_pending_sends_are_the_connections_open_stream_buffers():
    assert hypercorn_drain.pending_h2_sends(_server({1: object(), 3: object()})) == 2
    assert hypercorn_drain.pending_h2_sends(_server({1: object()}, closed=True)) == 0  # nothing will be written
    assert hypercorn_drain.pending_h2_sends(SimpleNamespace(protocol=SimpleNamespace(protocol=object()))) == 0  # h11


def test_drain_returns_once_the_last_response_is_written():
    buffers = {1: object()}
    server = _server(buffers)

    async def run() -> tuple[int, bool]:
        async def written() -> None:
            await asyncio.sleep(0.05)
            buffers.clear()  # what hypercorn's send task does after END_STREAM

        task = asyncio.create_task(written())
        left = await hypercorn_drain.drain(server, wait_s=5.0)
        return left, task.done()

    assert asyncio.run(run()) == (0, True)


def test_drain_gives_up_after_its_bound():
    server = _server({1: object()})
    assert asyncio.run(hypercorn_drain.drain(server, wait_s=0.02)) == 1


def test_install_patches_hypercorn_once():
    from hypercorn.asyncio.tcp_server import TCPServer

    assert hypercorn_drain.install() is True  # pyproject pins the version it was written for
    patched = TCPServer._initiate_server_close
    assert hypercorn_drain.install() is True
    assert TCPServer._initiate_server_close is patched


def test_the_reaper_ends_a_task_that_spent_its_cancel_in_a_finally():
    """The hypercorn hang: a request task cancelled once sends its 500 in `finally` and waits there
    for a buffer that never drains. The reaper cancels it again; a protected task is left alone."""

    async def run() -> tuple[bool, bool, bool]:
        never = asyncio.Event()
        stop = asyncio.Event()

        async def request() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                await never.wait()  # the second wait: only a second cancel ends it

        async def protected() -> None:
            await asyncio.sleep(0.5)

        stuck, kept = asyncio.create_task(request()), asyncio.create_task(protected())
        await asyncio.sleep(0)
        stuck.cancel()  # hypercorn's one cancel at the end of its graceful timeout
        await asyncio.sleep(0.02)
        assert not stuck.done()
        reaper = asyncio.create_task(hypercorn_drain.reap_after(stop, 0.01, protect={kept, asyncio.current_task()}, every_s=0.01))
        stop.set()
        await asyncio.wait({stuck}, timeout=5)
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)
        return stuck.cancelled(), kept.done(), kept.cancelled()

    stuck_cancelled, _kept_done, kept_cancelled = asyncio.run(run())
    assert stuck_cancelled and not kept_cancelled
