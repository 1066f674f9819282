"""`adapterctl logs [-f] [--level=debug] [--route R] [--tenant T] [--json]`: every worker's request records in one stream.

What: asks the processor supervisor (`GET /config` on its admin port: `--admin URL`, else the
`--config FILE`'s `spec.processor.adminPort`, else 9902) where the workers keep their shared state
(`state_dir`), then, with `-f`, writes its follow file there (`logs.follow.<pid>`, removed at exit) (extproc/requestlog.py: the workers
start writing one JSON record per finished request to `requests-<worker>.jsonl`, at `--level`) and
keeps it fresh every 2 s until Ctrl-C, while reading every worker's file from its end as records come
(a worker restarted or a file rotated is picked up: files are re-listed each second). Without `-f`:
the last `--lines` records already written (while someone followed). `--route` and `--tenant` keep
only those requests; `--json` prints the records as they are, one per line, else one pretty line each
(time, worker, route, tenant, status and outcome, duration and TTFT, backend and endpoint, the canary
arm and how it was chosen) with the debug parts (the client's document, the backend request, the
stages, the profile's explanation) indented below it.
Exit codes: 0 done (Ctrl-C while following), 1 the supervisor answered without a state directory,
3 the supervisor cannot be reached.
Cost: a file read per second per worker; nothing on the request path while nobody follows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from extproc.requestlog import FOLLOW_FILE, LOG_GLOB

HEARTBEAT_S = 2.0


def register(sub: Any) -> None:
    s = sub.add_parser("logs", help="live structured logs of every worker's requests (-f, --level=debug)",
                       description=__doc__.split("\n\n")[1] if "\n\n" in __doc__ else None)
    s.add_argument("-f", "--follow", action="store_true", help="stream records as requests finish (until Ctrl-C)")
    s.add_argument("--level", choices=["info", "debug"], default="info",
                   help="debug adds the client's document, the backend request and the stages (truncated, "
                   "secrets redacted)")
    s.add_argument("--route", help="only this route's requests")
    s.add_argument("--tenant", help="only this tenant's requests")
    s.add_argument("--json", action="store_true", help="one JSON record per line")
    s.add_argument("--lines", type=int, default=50, help="without -f: how many of the last records")
    s.add_argument("--admin", metavar="URL", help="the processor admin URL (default: http://127.0.0.1:PORT with "
                   "PORT the --config file's spec.processor.adminPort, else 9902)")
    s.add_argument("--config", metavar="FILE", help="the AdapterGateway file, for the default admin port")
    s.add_argument("--for", dest="duration", type=float, help=argparse.SUPPRESS)  # tests: follow this long
    s.set_defaults(fn=cmd_logs)


def _admin_url(args: Any) -> str:
    """`--admin`, else the `--config` file's admin port (as `adapterctl reload` reads it), else 9902."""
    from extproc.cli import _default_admin

    return (args.admin or _default_admin(args.config)).rstrip("/")


def state_dir(admin: str) -> str | None:
    import httpx

    r = httpx.get(f"{admin}/config", timeout=5)
    r.raise_for_status()
    return r.json().get("state_dir")


def keep(rec: dict[str, Any], route: str | None, tenant: str | None) -> bool:
    return (route is None or rec.get("route") == route) and (tenant is None or rec.get("tenant") == tenant)


def pretty(rec: dict[str, Any]) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(rec.get("ts", 0))) + f".{int((rec.get('ts', 0) % 1) * 1000):03d}"
    parts = [t, f"w{rec.get('worker')}", str(rec.get("route")), f"tenant={rec.get('tenant') or '-'}",
             f"{rec.get('status')} {rec.get('outcome')}", f"{rec.get('duration_ms')}ms"]
    if rec.get("ttft_ms") is not None:
        parts.append(f"ttft={rec['ttft_ms']}ms")
    if rec.get("model"):
        parts.append(f"model={rec['model']}")
    if rec.get("backend"):
        parts.append(f"backend={rec['backend']}")
    if rec.get("endpoint") or rec.get("served"):
        parts.append(f"endpoint={rec.get('served') or rec.get('endpoint')}")
    if rec.get("variant"):
        a = rec.get("assignment") or {}
        parts.append(f"variant={rec['variant']} ({a.get('how')}{' ' + a['source'] if a.get('source') else ''})")
    if rec.get("error"):
        parts.append(f"error={rec['error']}")
    parts.append(f"id={rec.get('request_id')}")
    lines = [" ".join(parts)]
    for key in ("decision", "input", "backend_request", "stages"):
        if rec.get(key) is not None:
            lines.append(f"    {key}: {json.dumps(rec[key], ensure_ascii=False)}")
    return "\n".join(lines)


class Tail:
    """Every worker's log file in `directory`: those there at the first poll from their end (`from_end`)
    or start, files that appear later from their start; rotation (a new inode) starts over."""

    def __init__(self, directory: str, from_end: bool = True):
        self.dir = Path(directory)
        self.from_end = from_end  # for the files there at the first poll; files that appear later: from 0
        self.pos: dict[Path, tuple[int, int]] = {}  # path -> (inode, offset)
        self.buf: dict[Path, bytes] = {}
        self.polled = False

    def poll(self) -> Iterator[dict[str, Any]]:
        for p in sorted(self.dir.glob(LOG_GLOB)):
            try:
                st = p.stat()
            except OSError:
                continue
            ino, off = self.pos.get(p, (st.st_ino, st.st_size if self.from_end else 0))
            if p not in self.pos and self.polled:
                off = 0  # a worker's file that appeared while following: all of it is new
            if ino != st.st_ino or st.st_size < off:  # rotated or replaced: the new file from its start
                ino, off = st.st_ino, 0
                self.buf.pop(p, None)
            if st.st_size > off:
                with open(p, "rb") as f:
                    f.seek(off)
                    data = f.read(st.st_size - off)
                off += len(data)
                data = self.buf.pop(p, b"") + data
                *lines, rest = data.split(b"\n")
                if rest:
                    self.buf[p] = rest
                for line in lines:
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except ValueError:
                            continue
            self.pos[p] = (ino, off)
        self.polled = True


def follow_path(directory: str) -> str:
    return os.path.join(directory, f"{FOLLOW_FILE}.{os.getpid()}")


def _write_follow(directory: str, level: str) -> None:
    path = follow_path(directory)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"level": level, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def cmd_logs(args: Any) -> int:
    admin = _admin_url(args)
    try:
        directory = state_dir(admin)
    except Exception as e:  # noqa: BLE001 - any transport or HTTP error: say which supervisor
        print(f"adapterctl logs: the processor supervisor at {admin} cannot be reached ({e})", file=sys.stderr)
        return 3
    if not directory:
        print(f"adapterctl logs: the supervisor at {admin} names no state directory (an older processor?)",
              file=sys.stderr)
        return 1
    out = sys.stdout

    def show(rec: dict[str, Any]) -> None:
        if keep(rec, args.route, args.tenant):
            out.write((json.dumps(rec, ensure_ascii=False) if args.json else pretty(rec)) + "\n")
            out.flush()

    if not args.follow:
        recs = [r for r in Tail(directory, from_end=False).poll() if keep(r, args.route, args.tenant)]
        recs.sort(key=lambda r: r.get("ts", 0))
        for r in recs[-args.lines:]:
            show(r)
        if not recs:
            print("adapterctl logs: no records yet (workers write them only while someone follows: use -f)",
                  file=sys.stderr)
        return 0
    tail = Tail(directory, from_end=True)
    list(tail.poll())  # start at the end of what is there
    _write_follow(directory, args.level)
    beat = time.monotonic()
    stop = time.monotonic() + args.duration if args.duration else None
    try:
        while stop is None or time.monotonic() < stop:
            for rec in tail.poll():
                show(rec)
            if time.monotonic() - beat >= HEARTBEAT_S:
                _write_follow(directory, args.level)  # the workers stop writing when this goes stale
                beat = time.monotonic()
            time.sleep(0.2)
        for rec in tail.poll():
            show(rec)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            os.unlink(follow_path(directory))  # the workers stop at their next check (within a second)
        except OSError:
            pass
    return 0


__all__ = ["register", "cmd_logs", "Tail", "pretty", "keep"]
