"""Gateway-wide in-flight requests per endpoint: per-worker counter slots in shared memory, summed by readers.

What: `InflightTable(directory, worker, workers)` gives each worker process its own file
`inflight-<worker>.bin` (mmap, `SLOTS` open-addressed slots of (key, started, finished) as three
little-endian u64) that only it writes; `started(ep)` / `finished(ep)` bump its own counters and
`get(ep)` sums `started - finished` over every worker's file in the directory (the list of files
is refreshed once a second, so a worker added or restarted is seen within a second). Keys are the first 8 bytes of
blake2b("ip:port"), the same in every process (never Python's salted `hash()`).
Why: with one process per core each worker sees about 1/N of the traffic, so an endpoint's load
must be summed over workers; one writer per file needs no lock, and the sum is exact up to the
writes in flight at the instant of reading (staleness bound: none beyond memory visibility; a
request's own increment is visible to the next read in any process). A worker that restarts
re-opens its file with zeroed counters... of its own requests only, which all ended with it.
Without a directory (tests, single process) the table is private to the process.
Cost: `started`/`finished` about 0.5 us (the endpoint's key and slot offset are cached after the
first use: one struct read and write); `get` about 0.5 us per worker; `counts(endpoints)` reads
each worker's table once for all of them (about 0.3 us per endpoint and worker).
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
_SLOT = struct.Struct("<QQQ")
_SIZE = SLOTS * _SLOT.size


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
                _SLOT.pack_into(self.buf, off, key, 0, 0)
                return off
            i = (i + 1) % SLOTS
        return -1


class InflightTable:
    def __init__(self, directory: str | os.PathLike | None = None, worker: int = 0):
        self.worker = worker
        self.directory = Path(directory) if directory else None
        self._own = self._open(worker, create=True)
        self._peers: dict[int, _Table] = {}
        self._peer_ids: tuple[int, ...] = ()
        self._listed = 0.0
        self._keys: dict[str, int] = {}  # endpoint -> endpoint_key (bounded by the endpoints ever named)

    def _open(self, index: int, create: bool) -> _Table | None:
        if self.directory is None:
            return _Table(bytearray(_SIZE), None) if create else None
        path = self.directory / f"inflight-{index}.bin"
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

    def _bump(self, endpoint: str, field: int) -> None:
        table = self._own
        off = table.find(self.key(endpoint), insert=True)
        if off < 0:
            return
        pos = off + 8 * field
        value = int.from_bytes(table.buf[pos:pos + 8], "little") + 1
        table.buf[pos:pos + 8] = value.to_bytes(8, "little")

    def started(self, endpoint: str) -> None:
        self._bump(endpoint, 1)

    def finished(self, endpoint: str) -> None:
        self._bump(endpoint, 2)

    def _peer_indexes(self) -> tuple[int, ...]:
        now = time.monotonic()
        if self.directory is not None and now - self._listed >= 1.0:
            self._listed = now
            ids = []
            for p in self.directory.glob("inflight-*.bin"):
                n = p.stem.removeprefix("inflight-")
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
                _, started, finished = _SLOT.unpack_from(t.buf, off)
                total += started - finished
        return max(total, 0)

    def counts(self, endpoints) -> dict[str, int]:
        """`get` of each endpoint, reading every worker's table once (what a scorer of N candidates calls)."""
        key = self.key
        keys = [(e, key(e)) for e in endpoints]
        totals = dict.fromkeys(endpoints, 0)
        unpack = _SLOT.unpack_from
        for t in self._tables():
            offsets, words = t.offsets, t.words
            for e, k in keys:
                off = offsets.get(k)
                if off is None:
                    off = t.find(k, False)
                    if off < 0:
                        continue
                if words is not None:
                    i = off >> 3
                    totals[e] += words[i + 1] - words[i + 2]
                else:
                    _, started, finished = unpack(t.buf, off)
                    totals[e] += started - finished
        for e, n in totals.items():
            if n < 0:
                totals[e] = 0
        return totals

    def own(self, endpoint: str) -> int:
        off = self._own.find(self.key(endpoint), insert=False)
        if off < 0:
            return 0
        _, started, finished = _SLOT.unpack_from(self._own.buf, off)
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
