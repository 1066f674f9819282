"""Opt-in allocation tracing for a worker (debugging memory growth; off by default).

What: with `ADAPTER_TRACEMALLOC=N` (N >= 1: frames kept per allocation) in a worker's environment,
`install(loop, directory, index)` starts `tracemalloc` and makes SIGUSR2 write a snapshot
(`tracemalloc.Snapshot.dump`, after a `gc.collect()`) to `<directory>/tracemalloc-<index>-<pid>-<seq>.snap`, where the
directory is `ADAPTER_TRACEMALLOC_DIR`, else the worker's state dir, else the temp dir. Compare two
snapshots with `compare(a, b)`; next to each, `<file>.json` holds glibc's `mallinfo2()` (the C
allocations tracemalloc does not see) and Python's allocated block count. Compare two (top lines by size grown) or perf/memprobe.py. Without the variable
`install` returns at once: no tracing, no handler, nothing on the request path.
Why: the workers have no HTTP server of their own (metrics go through the supervisor's), and a
signal plus a file is the smallest hook that lets a probe diff a live worker's heap.
Cost: off, none. On, tracemalloc slows allocation-heavy code about 2x and keeps its traces in memory:
debug runs only. A dump is synchronous in the loop (tens of ms to a second).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import signal
import sys
import tempfile
from typing import Any

ENV = "ADAPTER_TRACEMALLOC"
DIR_ENV = "ADAPTER_TRACEMALLOC_DIR"


def frames_from_env(environ: Any = os.environ) -> int:
    """Frames to keep per allocation, 0 when tracing is off (unset, empty, 0 or not a number)."""
    try:
        return max(int(environ.get(ENV, "0") or 0), 0)
    except ValueError:
        return 0


def install(loop: Any, directory: str | None, index: int, environ: Any = os.environ) -> str | None:
    """Start tracing and the SIGUSR2 dump if the environment asks for it; the dump directory, or None."""
    frames = frames_from_env(environ)
    if not frames:
        return None
    import tracemalloc

    out = environ.get(DIR_ENV) or directory or tempfile.gettempdir()
    os.makedirs(out, exist_ok=True)
    tracemalloc.start(frames)
    seq = itertools.count()

    def dump() -> None:
        gc.collect()  # what is left is retained, not cyclic garbage waiting for a collection
        path = os.path.join(out, f"tracemalloc-{index}-{os.getpid()}-{next(seq)}.snap")
        with open(path + ".json", "w", encoding="utf-8") as f:  # what tracemalloc cannot see: C allocations
            json.dump({"mallinfo": mallinfo(), "pyblocks": sys.getallocatedblocks(),
                       "tracemalloc_overhead": tracemalloc.get_tracemalloc_memory()}, f)
        tracemalloc.take_snapshot().dump(path + ".tmp")
        os.replace(path + ".tmp", path)  # a reader never sees half a file

    loop.add_signal_handler(signal.SIGUSR2, dump)
    return out


def mallinfo() -> dict[str, int] | None:
    """glibc's `mallinfo2()` (bytes): `uordblks` in use by malloc (C extensions' and Python's arenas),
    `fordblks` free inside the heap (fragmentation), `hblkhd` in mmap'd blocks; None off glibc."""
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = Info
    info = fn()
    return {n: int(getattr(info, n)) for n, _ in Info._fields_}


def compare(before: str, after: str, top: int = 15, key: str = "lineno") -> list[str]:
    """The `top` allocation sites that grew most from snapshot file `before` to `after`, one line each
    (size and count change, then the site), tracemalloc's own and importlib's frames left out."""
    import tracemalloc

    skip = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            tracemalloc.Filter(False, "<unknown>")]
    a = tracemalloc.Snapshot.load(before).filter_traces(skip)
    b = tracemalloc.Snapshot.load(after).filter_traces(skip)
    out = []
    for s in b.compare_to(a, key)[:top]:
        out.append(str(s))
        if key == "traceback":  # the whole stack, innermost last
            out.extend("    " + line for line in s.traceback.format(most_recent_first=False)[-12:])
    return out


__all__ = ["DIR_ENV", "ENV", "compare", "frames_from_env", "install"]
