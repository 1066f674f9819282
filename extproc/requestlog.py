"""Live per-request logs for `adapterctl logs -f`: one JSON record per finished request, while someone follows.

What: `RequestLog(state_dir, worker)` is a lifecycle observer in every worker. It writes nothing until a
follower is there: `adapterctl logs -f` (extproc/logs_cli.py) writes its follow file `logs.follow.<pid>`
in the workers' shared state directory (`ADAPTER_STATE_DIR`, which the supervisor's `GET /config` names
as `state_dir`) and touches it every 2 s; a worker that sees it fresh (modified within `FRESH_S` = 6 s;
checked at most once a second) appends one JSON line per request that ends to its own file
`requests-<worker>.jsonl` there, at the highest level a fresh follow file asks (one writer per file; rotated to `.1` past `MAX_BYTES` = 8 MiB, so a
follower that leaves behind a stale file costs at most 16 MiB per worker). When the follower stops
touching the file, the workers stop within seconds.
A record (level `info`): time, worker, request id, route and kind, tenant, outcome and HTTP status (the
client's: the processor's own answer, else Envoy's / the stream's), duration and TTFT in ms, model,
backend, the endpoint picked (`endpoint`) and the one that served (`served`), the canary arm
(`variant`) and how it was chosen (`assignment`: hash / forced / random, the key's source, reasons a
source was not used), the scheduling profile's explanation when the profile has `explain: true`
(candidates, what each filter kept, every scorer's scores, the pick: the "why"), usage, and the
processor's error code. At level `debug` (the follow file says so: `--level=debug`) also the client's
document as the route parsed it (`input`) and the backend request the processor produced
(`backend_request`), each truncated to `BODY_LIMIT` = 2 KiB, and the route's pipeline stages (`stages`:
the mapping steps in order).
Secrets: values under keys that name credentials (authorization, api-key / api_key, password, secret,
token, cookie, in any case and nesting) are replaced by "[redacted]" before anything is written; a body
that is not JSON is written only as its first `BODY_LIMIT` bytes with the same patterns cut out
(`"key": "value"` and `key=value` forms).
Why: `adapterctl logs -f --level=debug` is the brief's protocol-conversion debugging flow; one stream
of every worker's requests without a log pipeline, and no cost when nobody looks.
Cost: without a follower, one `time.monotonic()` and a compare per request (the file is stat'ed at most
once a second); with one, a dict, a JSON encode and one write(2) per request (tens of microseconds).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import orjson

FOLLOW_FILE = "logs.follow"  # one per follower: logs.follow.<pid>; the highest level asked for wins
LOG_GLOB = "requests-*.jsonl"
FRESH_S = 6.0
CHECK_S = 1.0
MAX_BYTES = 8 * 1024 * 1024
BODY_LIMIT = 2048
_SECRET_KEY = re.compile(r"(authorization|api[-_]?key|password|passwd|secret|token|cookie)", re.I)
_SECRET_TEXT = re.compile(rb'(?i)("?(?:authorization|api[-_]?key|password|passwd|secret|[a-z_]*token|cookie)"?\s*[:=]\s*)'
                          rb'("[^"]*"|[^\s,&}]+)')
REDACTED = "[redacted]"


def log_path(state_dir: str | os.PathLike, worker: int) -> Path:
    return Path(state_dir) / f"requests-{worker}.jsonl"


def redact(doc: Any, depth: int = 0) -> Any:
    """`doc` with the values of credential-named keys replaced (JSON values; recursion bounded)."""
    if depth > 32:
        return "[too deep]"
    if isinstance(doc, dict):
        return {k: (REDACTED if isinstance(k, str) and _SECRET_KEY.search(k) else redact(v, depth + 1))
                for k, v in doc.items()}
    if isinstance(doc, list):
        return [redact(v, depth + 1) for v in doc]
    return doc


def body_view(data: bytes | None) -> Any:
    """A body for the log: its JSON, redacted, if it parses and is small; else its first BODY_LIMIT bytes
    as text with credential-looking pairs cut out. None for no body."""
    if data is None:
        return None
    if len(data) <= BODY_LIMIT:
        try:
            return redact(orjson.loads(data))
        except orjson.JSONDecodeError:
            pass
    cut = _SECRET_TEXT.sub(lambda m: m.group(1) + b'"' + REDACTED.encode() + b'"', data[:BODY_LIMIT])
    text = cut.decode("utf-8", "replace")
    return text + ("…" if len(data) > BODY_LIMIT else "")


def doc_view(doc: Any) -> Any:
    """A parsed document for the log: redacted, and cut when its JSON is longer than BODY_LIMIT."""
    if doc is None:
        return None
    safe = redact(doc)
    data = orjson.dumps(safe, default=str)
    return safe if len(data) <= BODY_LIMIT else data[:BODY_LIMIT].decode("utf-8", "replace") + "…"


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


def record(state: Any, outcome: Any, worker: int, level: str) -> dict[str, Any]:
    """The log record of one finished request."""
    route = state.route
    c = state.completion
    req = state.request
    duration = c.duration if c is not None and c.duration is not None else time.monotonic() - state.started
    out: dict[str, Any] = {
        "ts": round(time.time(), 3), "worker": worker, "request_id": state.request_id,
        "route": route.name if route is not None else None, "kind": getattr(route, "kind", None),
        "tenant": state.tenant, "outcome": getattr(outcome, "value", str(outcome)),
        "status": state.reply_status or (c.status if c is not None else None) or state.response_status,
        "duration_ms": _ms(duration),
        "ttft_ms": _ms(state.first_body - state.started) if state.first_body is not None else None,
        "model": req.model if req is not None else None, "backend": state.backend, "endpoint": state.endpoint,
        "served": (c.upstream if c is not None else None) or state.served, "variant": state.variant,
    }
    a = state.attrs.get("canary.assignment")
    if a is not None:
        out["assignment"] = {"arm": a.arm, "how": a.how, "source": a.source, "reasons": list(a.reasons)}
    decision = state.attrs.get("decision")
    if decision is not None:
        out["decision"] = decision
    usage = state.usage
    if usage is not None:
        out["usage"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
    code = getattr(state, "reply_code", None)
    if code:
        out["error"] = code
    if level == "debug":
        out["input"] = doc_view(state.input_doc if state.input_doc is not None else
                                (req.body if req is not None else None))
        out["backend_request"] = body_view(state.backend_request)
        pipeline = getattr(route, "pipeline", None) if route is not None else None
        out["stages"] = [getattr(s, "name", type(s).__name__) for s in getattr(pipeline, "stages", ())]
    return out


class RequestLog:
    """The lifecycle observer writing this worker's records while a follower is there."""

    def __init__(self, state_dir: str | os.PathLike, worker: int, clock=time.monotonic):
        self.dir = Path(state_dir)
        self.worker = worker
        self.path = log_path(state_dir, worker)
        self._clock = clock
        self._checked = -1e9
        self._level: str | None = None  # None: nobody follows
        self._file: Any = None

    def settings(self) -> str | None:
        """The level a follower asked for (`info` / `debug`), None when nobody follows (checked once a second)."""
        now = self._clock()
        if now - self._checked < CHECK_S:
            return self._level
        self._checked = now
        level = None
        wall = time.time()
        for follow in self.dir.glob(FOLLOW_FILE + ".*"):
            try:
                if wall - follow.stat().st_mtime > FRESH_S:
                    continue
                asked = orjson.loads(follow.read_bytes()).get("level", "info")
            except (OSError, orjson.JSONDecodeError, AttributeError):
                continue
            if asked == "debug":
                level = "debug"
                break
            level = "info"
        self._level = level
        if self._level is None and self._file is not None:
            self.close()
        return self._level

    def __call__(self, state: Any, outcome: Any) -> None:
        level = self.settings()
        if level is None:
            return
        line = orjson.dumps(record(state, outcome, self.worker, level), default=str) + b"\n"
        f = self._file
        if f is None:
            f = self._file = open(self.path, "ab", buffering=0)  # one write per record: a follower sees it now
        f.write(line)
        if f.tell() > MAX_BYTES:
            self.close()
            os.replace(self.path, self.path.with_suffix(".jsonl.1"))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["RequestLog", "record", "redact", "body_view", "FOLLOW_FILE", "LOG_GLOB", "FRESH_S", "log_path"]
