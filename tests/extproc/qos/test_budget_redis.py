"""The Redis budget store against a real `redis-server` (Debian's, installed by `make setup`), started on a free
port and stopped by its PID: the Lua check-and-charge, reconciliation, concurrent chargers, and an outage."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from extproc.config.schema import BudgetStoreSpec
from extproc.qos.budget import Limits
from extproc.qos.budget_store import BudgetState, RedisStore, StoreUnavailable
from extproc.stack import free_port

T0 = 1_796_000_000.0
REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (make setup installs it with "
                                 "apt-get as root)")


@contextlib.contextmanager
def redis_server():
    """A real redis-server on a free port, no persistence; yields its URL; stopped by PID."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="redis-")
    proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port, socket_timeout=1)
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.025)
        else:
            raise RuntimeError(f"redis-server on port {port} did not answer")
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)


def limits(rpm=None, tpm=None, rpd=None, tpd=None) -> Limits:
    return Limits((rpm, tpm), (rpd, tpd))


@needs_redis
def test_redis_store_charges_refuses_and_reconciles_like_the_memory_store():
    async def run(url):
        s = RedisStore(url, "t")
        lim = limits(rpm=3, tpm=100, tpd=1000)
        d1 = await s.charge("acme", lim, 40, T0)
        assert d1.admitted and (d1.windows[0].requests, d1.windows[0].tokens) == (1, 40)
        assert (await s.charge("acme", lim, 40, T0)).admitted
        d3 = await s.charge("acme", lim, 40, T0)
        assert not d3.admitted and d3.refused == (0, "tokens") and d3.windows[0].tokens == 80
        big = await s.charge("acme", lim, 101, T0)
        assert big.too_large and big.refused == (0, "tokens")
        await s.adjust("acme", d1.indexes, 7 - 40)  # the first used 7
        m, day = await s.read("acme", T0)
        assert (m.requests, m.tokens, m.peak, day.tokens) == (2, 47, 80, 47)
        assert (await s.charge("acme", lim, 53, T0)).admitted  # 47 + 53 = 100 exactly
        assert (await s.charge("acme", lim, 0, T0)).refused == (0, "requests")
        # another minute: a fresh window, the same day
        d = await s.charge("acme", lim, 10, T0 + 40)
        assert d.admitted and d.windows[0].tokens == 10 and d.windows[1].tokens == 110
        await s.client.aclose()

    with redis_server() as url:
        asyncio.run(run(url))


@needs_redis
def test_concurrent_chargers_on_one_redis_never_exceed_the_budget():
    """Two stores (two replicas' clients) charging 7 tokens concurrently against 1000 a day: 142 admitted."""
    async def run(url):
        stores = [RedisStore(url, "c", timeout=5), RedisStore(url, "c", timeout=5)]
        lim = limits(tpd=1000)
        results = await asyncio.gather(*(stores[i % 2].charge("acme", lim, 7, T0) for i in range(300)))
        assert sum(d.admitted for d in results) == 142
        _, day = await stores[0].read("acme", T0)
        assert (day.requests, day.tokens) == (142, 994)
        for s in stores:
            await s.client.aclose()

    with redis_server() as url:
        asyncio.run(run(url))


@needs_redis
def test_an_unreachable_redis_is_reported_as_store_unavailable_and_skipped_for_a_while(caplog):
    async def run(url):
        spec = BudgetStoreSpec(kind="redis", url=url, timeout=0.2)
        bs = BudgetState(spec)
        assert (await bs.charge("acme", limits(tpm=10), 1)).admitted
        return bs

    with redis_server() as url:
        bs = asyncio.run(run(url))
    # the server is gone now
    async def after():
        with pytest.raises(StoreUnavailable):
            await bs.charge("acme", limits(tpm=10), 1)
        assert bs.down
        with pytest.raises(StoreUnavailable, match="down"):  # skipped: no second connection attempt
            await bs.charge("acme", limits(tpm=10), 1)
    asyncio.run(after())
    assert bs.metrics.store_errors.labels("redis")._value.get() == 1
    assert any("unavailable" in r.getMessage() for r in caplog.records)
