"""Gateway-wide in-flight requests, tokens and pending prefill per endpoint: per-worker counter slots in
shared memory, summed by readers.

What: `InflightTable(directory, worker, workers)` gives each worker process its own file
`inflight2-<worker>.bin` (mmap, `SLOTS` open-addressed slots of seven little-endian u64: key,
requests started, finished, tokens started, finished, prefill tokens started, done) that only it
writes. `started(ep, tokens, prefill)` counts a request dispatched to `ep` with its estimated
tokens (prompt plus what it may generate: what it will hold in the engine's KV cache) and its
prefill tokens (the prompt tokens the engine must compute before the first token: the uncached
part where a prefix scorer knows it, else the whole prompt); `prefilled(ep, prefill)` says the
first token came (the prefill is done); `finished(ep, tokens, prefill)` ends the request (with the
prefill still pending if no first token came). Readers sum over every worker's file in the
directory (the list of files is refreshed once a second, so a worker added or restarted is seen
within a second): `get(ep)` / `counts(eps)` the requests in flight, `loads(eps)` (requests,
tokens, pending prefill tokens) per endpoint. Keys are the first 8 bytes of blake2b("ip:port"),
the same in every process (never Python's salted `hash()`). The file name carries the layout
(`inflight2`: seven words; the first layout had three), so processes of two versions during a
rolling restart never misread each other's files (each counts only its own version's).
Why: with one process per core each worker sees about 1/N of the traffic, so an endpoint's load
must be summed over workers; one writer per file needs no lock, and the sum is exact up to the
writes in flight at the instant of reading (staleness bound: none beyond memory visibility; a
request's own increment is visible to the next read in any process). A worker that restarts
re-opens its file with zeroed counters... of its own requests only, which all ended with it.
Without a directory (tests, single process) the table is private to the process.
Cost: `started`/`prefilled`/`finished` about 0.5 us (the endpoint's key and slot offset are cached
after the first use; words written in place); `get` about 0.5 us per worker; `counts(endpoints)`
and `loads(endpoints)` read each worker's table once for all of them (about 0.3 us per endpoint and
worker). Memory: 4096 slots x 56 bytes = 224 KiB per worker file.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
import time
from pathlib import Path

SLOTS = 4096
_SLOT = struct.Struct("<QQQQQQQ")  # key, started, finished, tokens in, tokens out, prefill in, prefill out
_SIZE = SLOTS * _SLOT.size
_PREFIX = "inflight2-"  # the layout's name: a new layout gets a new prefix


def endpoint_key(endpoint: str) -> int:
    """A stable non-zero 64-bit key for "ip:port" (0 marks an empty slot)."""
    return int.from_bytes(hashlib.blake2b(endpoint.encode(), digest_size=8).digest(), "little") or 1


class _Table:
    __slots__ = ("buf", "path", "ino", "checked", "offsets", "words")

    def __init__(self, buf: mmap.mmap | bytearray, path: Path | None, ino: int = 0):
        self.buf = buf
        self.path = path
        self.ino = ino
        self.checked = time.monotonic()
        self.offsets: dict[int, int] = {}  # key -> its slot's offset (a slot never moves nor empties)
        # the table as u64 words for the readers (native order: little-endian hosts only, else None)
        self.words = memoryview(buf).cast("Q") if sys.byteorder == "little" else None

    def find(self, key: int, insert: bool) -> int:
        """Byte offset of `key`'s slot, or -1 when absent (and not inserting, or the table is full)."""
        off = self.offsets.get(key)
        if off is not None:
            return off
        off = self._probe(key, insert)
        if off >= 0:
            self.offsets[key] = off
        return off

    def _probe(self, key: int, insert: bool) -> int:
        i = key % SLOTS
        for _ in range(SLOTS):
            off = i * _SLOT.size
            k = int.from_bytes(self.buf[off:off + 8], "little")
            if k == key:
                return off
            if k == 0:
                if not insert:
                    return -1
                _SLOT.pack_into(self.buf, off, key, 0, 0, 0, 0, 0, 0)
                return off
            i = (i + 1) % SLOTS
        return -1


class InflightTable:
    def __init__(self, directory: str | os.PathLike | None = None, worker: int = 0, reader: bool = False):
        """`reader`: a process that only reads (`adapterctl status`): it creates no file of its own and
        sums every worker's (its own table is private and stays empty)."""
        self.worker = -1 if reader else worker
        self.directory = Path(directory) if directory else None
        self._own = _Table(bytearray(_SIZE), None) if reader else self._open(worker, create=True)
        self._peers: dict[int, _Table] = {}
        self._peer_ids: tuple[int, ...] = ()
        self._listed = 0.0
        self._keys: dict[str, int] = {}  # endpoint -> endpoint_key (bounded by the endpoints ever named)

    def _open(self, index: int, create: bool) -> _Table | None:
        if self.directory is None:
            return _Table(bytearray(_SIZE), None) if create else None
        path = self.directory / f"{_PREFIX}{index}.bin"
        try:
            if create:
                self.directory.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                with open(tmp, "wb") as f:
                    f.truncate(_SIZE)
                os.replace(tmp, path)  # a restarted worker starts from zero: its old requests ended with it
            fd = os.open(path, os.O_RDWR if create else os.O_RDONLY)
        except OSError:
            return None
        try:
            ino = os.fstat(fd).st_ino
            buf = mmap.mmap(fd, _SIZE, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        return _Table(buf, path, ino)

    def key(self, endpoint: str) -> int:
        k = self._keys.get(endpoint)
        if k is None:
            k = self._keys[endpoint] = endpoint_key(endpoint)
        return k

    def _add(self, endpoint: str, a: int, x: int, b: int = 0, y: int = 0, c: int = 0, z: int = 0) -> None:
        """Adds x, y, z to the words a, b, c of the endpoint's slot in this worker's table (0: none)."""
        table = self._own
        off = table.find(self.key(endpoint), insert=True)
        if off < 0:
            return
        words = table.words
        if words is not None:
            i = off >> 3
            words[i + a] += x
            if b:
                words[i + b] += y
            if c:
                words[i + c] += z
            return
        values = list(_SLOT.unpack_from(table.buf, off))
        for f, v in ((a, x), (b, y), (c, z)):
            if f:
                values[f] += v
        _SLOT.pack_into(table.buf, off, *values)

    def started(self, endpoint: str, tokens: int = 0, prefill: int = 0) -> None:
        """A request dispatched to `endpoint`, with its estimated tokens and prefill tokens (>= 0)."""
        self._add(endpoint, 1, 1, 3 if tokens > 0 else 0, tokens, 5 if prefill > 0 else 0, prefill)

    def prefilled(self, endpoint: str, prefill: int) -> None:
        """The first token of a request there came: its `prefill` tokens are no longer pending."""
        if prefill > 0:
            self._add(endpoint, 6, prefill)

    def finished(self, endpoint: str, tokens: int = 0, prefill: int = 0) -> None:
        """A request there ended: its tokens leave, and its prefill if no first token said so before."""
        self._add(endpoint, 2, 1, 4 if tokens > 0 else 0, tokens, 6 if prefill > 0 else 0, prefill)

    def _peer_indexes(self) -> tuple[int, ...]:
        now = time.monotonic()
        if self.directory is not None and now - self._listed >= 1.0:
            self._listed = now
            ids = []
            for p in self.directory.glob(f"{_PREFIX}*.bin"):
                n = p.stem.removeprefix(_PREFIX)
                if n.isdigit() and int(n) != self.worker:
                    ids.append(int(n))
            self._peer_ids = tuple(sorted(ids))
        return self._peer_ids

    def _tables(self):
        yield self._own
        for i in self._peer_indexes():
            t = self._peers.get(i)
            if t is None or (t.path is not None and not _same_file(t)):
                t = self._open(i, create=False)
                if t is None:
                    continue
                self._peers[i] = t
            yield t

    def get(self, endpoint: str) -> int:
        """In-flight requests to `endpoint` over every worker (never negative)."""
        key = self.key(endpoint)
        total = 0
        for t in self._tables():
            off = t.find(key, insert=False)
            if off >= 0:
                _, started, finished, *_rest = _SLOT.unpack_from(t.buf, off)
                total += started - finished
        return max(total, 0)

    def counts(self, endpoints) -> dict[str, int]:
        """`get` of each endpoint, reading every worker's table once (what a scorer of N candidates calls)."""
        return {e: v[0] for e, v in self.loads(endpoints).items()}

    def loads(self, endpoints) -> dict[str, tuple[int, int, int]]:
        """(requests, tokens, pending prefill tokens) in flight to each endpoint over every worker, each
        never negative; every worker's table read once."""
        key = self.key
        keys = [(e, key(e)) for e in endpoints]
        totals = {e: [0, 0, 0] for e in endpoints}
        unpack = _SLOT.unpack_from
        for t in self._tables():
            offsets, words = t.offsets, t.words
            for e, k in keys:
                off = offsets.get(k)
                if off is None:
                    off = t.find(k, False)
                    if off < 0:
                        continue
                acc = totals[e]
                if words is not None:
                    i = off >> 3
                    acc[0] += words[i + 1] - words[i + 2]
                    acc[1] += words[i + 3] - words[i + 4]
                    acc[2] += words[i + 5] - words[i + 6]
                else:
                    _, s0, f0, s1, f1, s2, f2 = unpack(t.buf, off)
                    acc[0] += s0 - f0
                    acc[1] += s1 - f1
                    acc[2] += s2 - f2
        return {e: (max(a, 0), max(b, 0), max(c, 0)) for e, (a, b, c) in totals.items()}

    def own(self, endpoint: str) -> int:
        off = self._own.find(self.key(endpoint), insert=False)
        if off < 0:
            return 0
        _, started, finished, *_rest = _SLOT.unpack_from(self._own.buf, off)
        return started - finished


def _same_file(t: _Table) -> bool:
    """A peer's file is replaced when that worker restarts: re-map it then (checked once a second)."""
    now = time.monotonic()
    if now - t.checked < 1.0:
        return True
    t.checked = now
    try:
        return os.stat(t.path).st_ino == t.ino  # type: ignore[arg-type]
    except OSError:
        return False


__all__ = ["InflightTable", "endpoint_key", "SLOTS"]
