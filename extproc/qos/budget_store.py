"""Where tenant budgets are counted: one machine's workers (`memory`) or every replica (`redis`).

What: a store does the check-and-charge of `extproc/qos/budget.py` atomically and applies
reconciliations. Both keep, per tenant and window (UTC minute, UTC day): the window's index, requests,
tokens and the tokens' peak (what remaining is computed from, so it never goes up within a window).
- `MemoryStore(directory)`: a file `budget1.bin` in the gateway's state directory, mapped by every
  worker process (`SLOTS` open-addressed slots of nine little-endian 64-bit words: key = blake2b(tenant),
  then per window index, requests, tokens, peak). Unlike the in-flight table (one writer per file,
  readers sum) a budget needs check-then-charge to be atomic across workers, or N workers could each
  admit the last request of a window: every operation holds `flock(LOCK_EX)` on the file for its few
  microseconds, so the workers of one machine share one exact budget. The file outlives worker
  restarts (counts stay with their windows); without a directory (tests, one process) it is private.
- `RedisStore(url)`: the same state in two hashes per tenant and window (`<prefix>:{<tenant>}:m:<index>`
  and `...:d:<index>`, fields r, t, p; they expire with their window), checked and charged by one Lua
  script (atomic on the server), so replicas sharing a Redis share one exact budget. Window indexes
  come from each replica's clock: replicas must keep their clocks in sync (NTP) for windows to agree.
  One round trip per admission (redis.asyncio, `timeout` bounds it) and one per reconciliation
  (scheduled off the request path).
Redis down (a connection error or a timeout): `BudgetState` applies `budgetStore.failureMode`: `open`
(default) admits without budget headers, `closed` answers 503 `budget_store_unavailable`
(Retry-After 1); either way it logs once per outage, counts
`adapter_processor_budget_store_errors_total{store}`, sets `adapter_processor_budget_store_up{store}` to 0 and
does not try Redis again for `RETRY_S` (so an outage costs no timeouts on the request path). Requests
admitted while it was down are not reconciled (their windows were never charged).
Cost: memory store about 20 us per charge with the file and its flock (measured on this 2-core machine at
load average 9-10; a quiet one should take less, not measured); redis one local round trip per charge
(awaited: the worker serves other streams meanwhile).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

from extproc.qos.budget import DAY, MINUTE, Decision, Limits, WindowState, reset_after, window_indexes

log = logging.getLogger(__name__)

SLOTS = 4096
_SLOT = struct.Struct("<Qqqqqqqqq")  # key, (index, requests, tokens, peak) x (minute, day)
_SIZE = SLOTS * _SLOT.size
FILE_NAME = "budget1.bin"  # the layout's name: a new layout gets a new name
RETRY_S = 1.0  # after a Redis failure, requests skip Redis for this long
MAX_CONNECTIONS = 32  # Redis connections per worker


def tenant_key(tenant: str) -> int:
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little") or 1


def _check(limits: Limits, counts: list[list[int]], tokens: int) -> tuple[tuple[int, str] | None, bool]:
    """(refused (window, unit) or None, too_large) for charging 1 request and `tokens` onto `counts`
    ([[requests, tokens, peak], [same]] for minute, day)."""
    for i in (0, 1):
        req_limit, tok_limit = limits.window(i)
        if tok_limit is not None and tokens > tok_limit:
            return (i, "tokens"), True
    for i in (0, 1):
        req_limit, tok_limit = limits.window(i)
        if req_limit is not None and counts[i][0] + 1 > req_limit:
            return (i, "requests"), False
        if tok_limit is not None and counts[i][1] + tokens > tok_limit:
            return (i, "tokens"), False
    return None, False


def _windows(counts: list[list[int]], now: float) -> tuple[WindowState, WindowState]:
    return (WindowState(counts[0][0], counts[0][1], counts[0][2], reset_after(now, 0)),
            WindowState(counts[1][0], counts[1][1], counts[1][2], reset_after(now, 1)))


class MemoryStore:
    kind = "memory"

    def __init__(self, directory: str | os.PathLike | None = None):
        self.path = Path(directory) / FILE_NAME if directory else None
        self._fd = -1
        self._offsets: dict[str, int] = {}
        if self.path is None:
            self.buf: Any = bytearray(_SIZE)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_size < _SIZE:  # first worker creates it; nobody ever truncates a live one
                os.ftruncate(fd, _SIZE)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        self._fd = fd
        self.buf = mmap.mmap(fd, _SIZE, access=mmap.ACCESS_WRITE)

    def close(self) -> None:
        if self._fd >= 0:
            self.buf.close()
            os.close(self._fd)
            self._fd = -1

    def _lock(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _slot(self, tenant: str, insert: bool) -> int:
        off = self._offsets.get(tenant)
        if off is not None:
            return off
        key = tenant_key(tenant)
        i = key % SLOTS
        for _ in range(SLOTS):
            off = i * _SLOT.size
            k = int.from_bytes(self.buf[off:off + 8], "little")
            if k == key or (k == 0 and insert):
                if k == 0:
                    _SLOT.pack_into(self.buf, off, key, 0, 0, 0, 0, 0, 0, 0, 0)
                self._offsets[tenant] = off
                return off
            if k == 0:
                return -1
            i = (i + 1) % SLOTS
        return -1

    def _counts(self, off: int, idx: tuple[int, int]) -> list[list[int]]:
        v = _SLOT.unpack_from(self.buf, off)
        out = []
        for i in (0, 1):
            index, r, t, p = v[1 + 4 * i: 5 + 4 * i]
            out.append([r, t, p] if index == idx[i] else [0, 0, 0])
        return out

    def _write(self, off: int, key: int, idx: tuple[int, int], counts: list[list[int]]) -> None:
        _SLOT.pack_into(self.buf, off, key, idx[0], *counts[0], idx[1], *counts[1])

    def charge_sync(self, tenant: str, limits: Limits, tokens: int, now: float) -> Decision:
        idx = window_indexes(now)
        self._lock()
        try:
            off = self._slot(tenant, insert=True)
            if off < 0:  # table full (4096 tenants with budgets on one machine): admit, uncounted
                raise OSError("budget table full")
            counts = self._counts(off, idx)
            refused, too_large = _check(limits, counts, tokens)
            if refused is None:
                for c in counts:
                    c[0] += 1
                    c[1] += tokens
                    c[2] = max(c[2], c[1])
                self._write(off, tenant_key(tenant), idx, counts)
        finally:
            self._unlock()
        return Decision(refused is None, _windows(counts, now), idx, refused, too_large)

    def adjust_sync(self, tenant: str, idx: tuple[int, int], delta: int) -> None:
        if not delta:
            return
        self._lock()
        try:
            off = self._slot(tenant, insert=False)
            if off < 0:
                return
            v = list(_SLOT.unpack_from(self.buf, off))
            for i in (0, 1):
                base = 1 + 4 * i
                if v[base] == idx[i]:  # the window it was charged in is still the stored one
                    v[base + 2] = max(0, v[base + 2] + delta)
                    v[base + 3] = max(v[base + 3], v[base + 2])
            _SLOT.pack_into(self.buf, off, *v)
        finally:
            self._unlock()

    def read_sync(self, tenant: str, now: float) -> tuple[WindowState, WindowState]:
        idx = window_indexes(now)
        self._lock()
        try:
            off = self._slot(tenant, insert=False)
            counts = self._counts(off, idx) if off >= 0 else [[0, 0, 0], [0, 0, 0]]
        finally:
            self._unlock()
        return _windows(counts, now)

    async def charge(self, tenant: str, limits: Limits, tokens: int, now: float) -> Decision:
        return self.charge_sync(tenant, limits, tokens, now)

    async def adjust(self, tenant: str, idx: tuple[int, int], delta: int) -> None:
        self.adjust_sync(tenant, idx, delta)

    async def read(self, tenant: str, now: float) -> tuple[WindowState, WindowState]:
        return self.read_sync(tenant, now)


# KEYS: minute hash, day hash. ARGV: minute requests limit, minute tokens limit, day requests limit,
# day tokens limit (-1: none), tokens, minute ttl, day ttl. Returns {admitted, refused window (0 minute,
# 1 day, -1 none), refused unit (0 requests, 1 tokens), too_large, mr, mt, mp, dr, dt, dp}.
_CHARGE = """
local lim = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
local tokens = tonumber(ARGV[5])
local c = {}
for w = 1, 2 do
  local v = redis.call('HMGET', KEYS[w], 'r', 't', 'p')
  c[w] = {tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0}
end
local function out(ok, w, u, big)
  return {ok, w, u, big, c[1][1], c[1][2], c[1][3], c[2][1], c[2][2], c[2][3]}
end
for w = 1, 2 do
  local tl = lim[2 * w]
  if tl >= 0 and tokens > tl then return out(0, w - 1, 1, 1) end
end
for w = 1, 2 do
  local rl, tl = lim[2 * w - 1], lim[2 * w]
  if rl >= 0 and c[w][1] + 1 > rl then return out(0, w - 1, 0, 0) end
  if tl >= 0 and c[w][2] + tokens > tl then return out(0, w - 1, 1, 0) end
end
for w = 1, 2 do
  c[w][1] = redis.call('HINCRBY', KEYS[w], 'r', 1)
  c[w][2] = redis.call('HINCRBY', KEYS[w], 't', tokens)
  if c[w][2] > c[w][3] then
    c[w][3] = c[w][2]
    redis.call('HSET', KEYS[w], 'p', c[w][3])
  end
  redis.call('EXPIRE', KEYS[w], tonumber(ARGV[5 + w]))
end
return out(1, -1, 0, 0)
"""

# KEYS: minute hash, day hash (of the windows the request was charged in). ARGV: delta tokens.
_ADJUST = """
for w = 1, 2 do
  if redis.call('EXISTS', KEYS[w]) == 1 then
    local t = redis.call('HINCRBY', KEYS[w], 't', tonumber(ARGV[1]))
    if t < 0 then t = 0; redis.call('HSET', KEYS[w], 't', 0) end
    local p = tonumber(redis.call('HGET', KEYS[w], 'p')) or 0
    if t > p then redis.call('HSET', KEYS[w], 'p', t) end
  end
end
return 1
"""


def redis_keys(prefix: str, tenant: str, idx: tuple[int, int]) -> list[str]:
    """The minute's and the day's hash of `tenant` for window indexes `idx`."""
    tag = f"{prefix}:{{{tenant}}}"  # one hash slot per tenant (Redis Cluster)
    return [f"{tag}:m:{idx[0]}", f"{tag}:d:{idx[1]}"]


class RedisStore:
    kind = "redis"

    def __init__(self, url: str, prefix: str = "adapter-gateway:budget", timeout: float = 0.25):
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        # a bounded pool (requests wait up to `timeout` for a connection): concurrent admissions of one worker
        # share MAX_CONNECTIONS connections instead of opening one each
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=MAX_CONNECTIONS, timeout=timeout,
                                                        socket_timeout=timeout, socket_connect_timeout=timeout)
        self.client = aioredis.Redis(connection_pool=pool)
        self._charge = self.client.register_script(_CHARGE)
        self._adjust = self.client.register_script(_ADJUST)

    def keys(self, tenant: str, idx: tuple[int, int]) -> list[str]:
        return redis_keys(self.prefix, tenant, idx)

    async def charge(self, tenant: str, limits: Limits, tokens: int, now: float) -> Decision:
        idx = window_indexes(now)
        lim = [-1 if v is None else v for v in (*limits.minute, *limits.day)]
        # keep a window's hash a while past its end, so a late reconciliation still finds it
        ttl_m = int(reset_after(now, 0)) + MINUTE
        ttl_d = int(reset_after(now, 1)) + MINUTE
        r = await self._charge(keys=self.keys(tenant, idx), args=[*lim, tokens, ttl_m, ttl_d])
        ok, w, u, big, mr, mt, mp, dr, dt, dp = (int(x) for x in r)
        refused = None if ok else (w, "tokens" if u else "requests")
        counts = [[mr, mt, mp], [dr, dt, dp]]
        return Decision(bool(ok), _windows(counts, now), idx, refused, bool(big))

    async def adjust(self, tenant: str, idx: tuple[int, int], delta: int) -> None:
        if delta:
            await self._adjust(keys=self.keys(tenant, idx), args=[delta])

    async def read(self, tenant: str, now: float) -> tuple[WindowState, WindowState]:
        idx = window_indexes(now)
        counts = []
        for k in self.keys(tenant, idx):
            v = await self.client.hmget(k, "r", "t", "p")
            counts.append([int(x) if x is not None else 0 for x in v])
        return _windows(counts, now)

    def close(self) -> None:
        pass  # the connection pool closes with the process (an aclose would need the loop)


class StoreUnavailable(Exception):
    """The budget store could not be reached (Redis down or slow); the caller applies failureMode."""


class BudgetState:
    """A worker's budget store, its health and its metrics; lives in the runtime (`Runtime.cache`),
    rebuilt only when `spec.budgetStore` changes."""

    def __init__(self, spec: Any, directory: str | os.PathLike | None = None, metrics: Any = None):
        self.spec = spec  # extproc.config.schema.BudgetStoreSpec
        self.failure_mode = spec.failure_mode
        self.store: Any = (RedisStore(spec.url, spec.key_prefix, spec.timeout) if spec.kind == "redis"
                           else MemoryStore(directory))
        self.metrics = metrics if metrics is not None else BudgetMetrics()
        self.down_until = 0.0  # monotonic: skip the store until then
        self.down = False
        self._tasks: set[asyncio.Task] = set()
        self._tenants: dict[str, TenantBudgetView] = {}

    def tenant(self, tenant: str, budget: Any) -> "TenantBudgetView":
        """The tenant's limits and metric children, built once per tenant and budget object (a reload
        that changes the budget builds them again)."""
        view = self._tenants.get(tenant)
        if view is None or view.budget is not budget:
            view = self._tenants[tenant] = TenantBudgetView(tenant, budget, self.metrics)
        return view

    def _failed(self, exc: BaseException) -> None:
        self.metrics.store_errors.labels(self.store.kind).inc()
        self.down_until = time.monotonic() + RETRY_S
        if not self.down:
            self.down = True
            self.metrics.store_up.labels(self.store.kind).set(0)
            log.warning("budget store %s unavailable (%s: %s); failureMode=%s: %s for %.0fs, then retrying",
                        self.store.kind, type(exc).__name__, exc, self.failure_mode,
                        "admitting requests uncounted" if self.failure_mode == "open" else "refusing budgeted requests",
                        RETRY_S)

    def _ok(self) -> None:
        if self.down:
            self.down = False
            self.metrics.store_up.labels(self.store.kind).set(1)
            log.warning("budget store %s reachable again; budgets enforced", self.store.kind)

    async def charge(self, tenant: str, limits: Limits, tokens: int, now: float | None = None) -> Decision:
        """The store's decision, or StoreUnavailable."""
        if self.down and time.monotonic() < self.down_until:
            raise StoreUnavailable(f"{self.store.kind} store down")
        try:
            d = await self.store.charge(tenant, limits, tokens, time.time() if now is None else now)
        except Exception as exc:  # redis.RedisError, OSError, timeouts: the store is unusable now
            self._failed(exc)
            raise StoreUnavailable(str(exc)) from exc
        self._ok()
        return d

    def reconcile(self, tenant: str, idx: tuple[int, int], delta: int) -> None:
        """Apply `delta` tokens to the windows `idx` (off the request path for Redis)."""
        if not delta:
            return
        if isinstance(self.store, MemoryStore):
            try:
                self.store.adjust_sync(tenant, idx, delta)
            except OSError as exc:
                self._failed(exc)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.metrics.store_errors.labels(self.store.kind).inc()
            return
        task = loop.create_task(self._adjust(tenant, idx, delta))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adjust(self, tenant: str, idx: tuple[int, int], delta: int) -> None:
        try:
            await self.store.adjust(tenant, idx, delta)
        except Exception as exc:
            self._failed(exc)

    async def drain(self) -> None:
        """Wait for scheduled reconciliations (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        self.store.close()


class TenantBudgetView:
    """What admission needs per tenant, made once: its `Limits` and its labelled metric children."""

    __slots__ = ("budget", "limits", "admitted", "rejected", "too_large", "down_admitted", "down_rejected",
                 "estimated", "used", "remaining")

    def __init__(self, tenant: str, budget: Any, metrics: "BudgetMetrics"):
        self.budget = budget
        self.limits = Limits.of(budget)
        d = metrics.decisions
        self.admitted, self.rejected, self.too_large = (d.labels(tenant, r) for r in ("admitted", "rejected",
                                                                                       "too_large"))
        self.down_admitted = d.labels(tenant, "store_down_admitted")
        self.down_rejected = d.labels(tenant, "store_down_rejected")
        self.estimated = metrics.tokens.labels(tenant, "estimated")
        self.used = metrics.tokens.labels(tenant, "used")
        self.remaining = {u: metrics.remaining.labels(tenant, u) for u in ("requests", "tokens")}


class BudgetMetrics:
    """The budget metrics, on a registry of their own (in multiprocess mode every process's values go to
    the shared metrics directory whatever the registry, and the supervisor serves them merged)."""

    def __init__(self, registry: Any = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        reg = registry if registry is not None else CollectorRegistry()
        ns = "adapter_processor"
        self.decisions = Counter(f"{ns}_budget_decisions", "token-budget admission decisions",
                                 ["tenant", "result"], registry=reg)
        self.tokens = Counter(f"{ns}_budget_tokens", "tokens charged to budgets (estimated at admission, "
                              "then the reconciliation's difference)", ["tenant", "kind"], registry=reg)
        self.remaining = Gauge(f"{ns}_budget_remaining", "remaining budget after the last admission, binding "
                               "window", ["tenant", "unit"], registry=reg, multiprocess_mode="livemostrecent")
        self.store_errors = Counter(f"{ns}_budget_store_errors", "budget store operations that failed",
                                    ["store"], registry=reg)
        self.store_up = Gauge(f"{ns}_budget_store_up", "1 while the budget store answers, 0 during an outage",
                              ["store"], registry=reg, multiprocess_mode="livemostrecent")


def budgets_view(snap: Any, state_dir: str | None, now: float | None = None) -> dict[str, Any]:
    """`adapterctl status`: per tenant with a budget, its limits and this minute's and today's counts, read
    from the store the config names (the workers' shared file in `state_dir`, or Redis with a 1 s timeout)."""
    from extproc.qos.budget import Limits, header_values

    now = time.time() if now is None else now
    spec = snap.spec.spec.budget_store
    tenants = [t for t in snap.tenants if getattr(t, "budget", None) is not None]
    out: dict[str, Any] = {"store": spec.kind, "tenants": {}}
    if not tenants:
        return out
    read: Any
    if spec.kind == "redis":
        import redis

        client = redis.Redis.from_url(spec.url, socket_timeout=1, socket_connect_timeout=1)

        def read(tenant: str) -> tuple[WindowState, WindowState]:
            keys = redis_keys(spec.key_prefix, tenant, window_indexes(now))
            counts = [[int(x) if x is not None else 0 for x in client.hmget(k, "r", "t", "p")] for k in keys]
            return _windows(counts, now)
    else:
        path = Path(state_dir) / FILE_NAME if state_dir else None
        if path is None or not path.exists():
            out["note"] = "no worker has counted a budgeted request yet"
            store = MemoryStore()
        else:
            store = MemoryStore(state_dir)

        def read(tenant: str) -> tuple[WindowState, WindowState]:
            return store.read_sync(tenant, now)
    for t in tenants:
        limits = Limits.of(t.budget)
        try:
            m, d = read(t.id)
        except Exception as e:  # noqa: BLE001 - the store may be down; status still shows the rest
            out["tenants"][t.id] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        out["tenants"][t.id] = {
            "minute": {"requests": m.requests, "tokens": m.tokens, "limits": list(limits.minute)},
            "day": {"requests": d.requests, "tokens": d.tokens, "limits": list(limits.day)},
            "headers": header_values(limits, (m, d))}
    return out


__all__ = ["MemoryStore", "RedisStore", "BudgetState", "BudgetMetrics", "StoreUnavailable", "FILE_NAME", "DAY",
           "MINUTE", "budgets_view"]
