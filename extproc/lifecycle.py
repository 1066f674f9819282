"""The request lifecycle: `on_start` when a stream opens, `on_done(state, outcome)` exactly once.

What: `Lifecycle` (one per worker, in the `Runtime`) registers each request when its ext_proc stream
opens and fires the route pipeline's `on_done` hooks and the runtime's observers (metrics,
in-flight release) exactly once, with a typed `Outcome`, when the request's end is known:
- routes whose pipeline reads a response phase (llm, tensor, tool, rest, openai) and requests the
  processor answered itself: when the stream ends. The first response message carries the status
  and the endpoint that served (the filter's `response_attributes`: `response.code`,
  `upstream.address`), its arrival is the time to first byte, and a stream that ends before the
  phases the pipeline asked for were seen is a client that went away (`source` `stream`);
- routes whose stream ends at request headers (passthrough, kserve), with feedback on (the
  default): when both the stream has ended and Envoy's access-log entry for the request's token
  has arrived (`extproc/feedback.py`: gRPC ALS, one logger per worker filtered on the metadata
  `adapter.worker` that only these requests carry, with `adapter.token`). The entry brings the
  final status, response flags (client reset, upstream timeout), the endpoint that served,
  upstream timings and time to first byte. If it does not come within the route timeout plus
  `FEEDBACK_GRACE` after the stream ended, `on_done` fires from what the stream saw (`deadline`);
- feedback off (`processor.feedback: stream`), or Envoy never got the token (a stream reset before
  the first reply): when the stream ends, from what the stream saw.
Why: SLO windows, canary judgement, concurrency permits and in-flight counters all need one
reliable end per request, including the requests the processor never sees end (GIE's in-flight
load releases "when a response completes or the request is aborted"); mitmproxy's rule that a flow
gets either an error or a response event, never both.
Cost: a dict insert and pop per request, one timer sweep every 250 ms; the derivation is a few
comparisons. Only headers-only routes cost an access-log entry (`extproc/feedback.py`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from extproc.types import Outcome, RequestState

log = logging.getLogger(__name__)

FEEDBACK_GRACE = 2.0  # seconds after the route timeout an access-log entry may still arrive
ORPHAN_TTL = 30.0  # entries whose request is not (yet) known are kept this long

# Envoy response flags (access-log names) that mean the client went away before the answer was done.
CANCEL_FLAGS = frozenset({"downstream_connection_termination", "downstream_remote_reset"})
# the backend failed the request (no answer, or an answer cut off): a backend error, or truncated
UPSTREAM_FAILURE_FLAGS = frozenset({"upstream_remote_reset", "upstream_connection_termination",
                                    "upstream_connection_failure", "upstream_protocol_error", "local_reset",
                                    "no_healthy_upstream", "upstream_overflow"})
TIMEOUT_FLAGS = frozenset({"upstream_request_timeout", "stream_idle_timeout", "duration_timeout",
                           "upstream_max_stream_duration_reached"})


@dataclass(slots=True)
class Completion:
    """What Envoy's access log reported at the end of a request (times in seconds from its start)."""

    status: int  # 0 when no response was sent (client reset first)
    upstream: str | None = None  # "ip:port" of the endpoint that served
    cluster: str | None = None
    flags: frozenset[str] = frozenset()
    first_upstream_byte: float | None = None  # time to the first byte from the upstream (TTFB/TTFT)
    last_downstream_byte: float | None = None  # time to the last byte sent to the client
    duration: float | None = None
    source: str = "envoy"  # "envoy" (its access log) or "stream" (what the ext_proc stream saw)


def derive_outcome(state: RequestState, completion: Completion | None) -> Outcome:
    """The request's outcome from what the stream saw and, when it came, Envoy's access-log entry."""
    if completion is not None:
        if completion.flags & CANCEL_FLAGS:
            return Outcome.CANCELLED
        if completion.flags & TIMEOUT_FLAGS or completion.status == 504:
            return Outcome.TIMEOUT
        # 101: an upgraded socket (websocket routes), whose normal end is a closed connection
        if completion.flags & UPSTREAM_FAILURE_FLAGS and completion.status != 101:
            return Outcome.TRUNCATED if 0 < completion.status < 400 else Outcome.BACKEND_ERROR
    if state.observed is not None:
        return state.observed
    if completion is None and state.stream_end in ("cancelled", "end") and state.reply_status is None \
            and not state.complete and not state.delivered:
        # the stream ended (reset or closed) before the processor saw the end it asked for: Envoy
        # abandoned the request, which it does when the client goes away; unless the answer's in-band
        # end had gone out (`delivered`): the openai SDK closes its connection at `data: [DONE]`, often
        # before the backend's end of body reaches Envoy, and that client got the whole answer
        return Outcome.CANCELLED
    status = completion.status if completion is not None else None
    if not status:
        status = state.reply_status or state.response_status
    if not status:
        if state.stream_end == "error":
            return Outcome.BACKEND_ERROR
        return Outcome.CANCELLED if completion is not None else Outcome.OK
    if status == 504:
        return Outcome.TIMEOUT
    if status >= 500:
        return Outcome.BACKEND_ERROR
    if status >= 400:
        return Outcome.REJECTED
    return Outcome.OK


Observer = Callable[[RequestState, Outcome], None]


class Lifecycle:
    """Per worker: requests whose `on_done` has not fired yet, and the rules that fire it once."""

    def __init__(self, worker: int = 0, feedback: bool = False, observers: Iterable[Observer] = (),
                 boot: str | None = None):
        # tokens are "<worker>.<boot>-<n>": a restarted worker (same index, new process) never takes
        # an entry meant for its predecessor's requests
        self.worker = str(worker)
        self.boot = f"{self.worker}.{boot if boot is not None else format(os.getpid(), 'x')}"
        self.feedback = feedback
        self.observers: list[Observer] = list(observers)
        self._next = 1
        self._open: dict[str, RequestState] = {}  # token -> state, until done
        self._waiting: dict[str, float] = {}  # token -> deadline (stream ended, waiting for Envoy)
        self._orphans: dict[str, tuple[float, Completion]] = {}  # entries that came before their stream
        self.done_count = 0
        self.late_entries = 0  # access-log entries for requests already done (deadline passed)
        # entries of requests whose first reply carried adapter.timing (latency attribution,
        # extproc/attribution.py: AttributionObserver.envoy_entry), called with (token, entry)
        self.timing_sink: Callable[[str, Any], None] | None = None

    def metadata(self, state: RequestState) -> dict[str, dict[str, Any]]:
        """Dynamic metadata for the stream's first reply: how Envoy's access log finds this worker."""
        state.token_sent = True
        return {"adapter": {"worker": self.worker, "token": state.token}}

    def start(self, state: RequestState) -> None:
        state.token = f"{self.boot}-{self._next}"
        self._next += 1
        self._open[state.token] = state
        if state.route is not None and state.route.pipeline is not None:
            state.route.pipeline.start(state)

    def stream_ended(self, state: RequestState, how: str, now: float | None = None) -> None:
        """The ext_proc stream is over (`how`: end, cancelled, error)."""
        if state.outcome is not None or state.stream_end is not None:
            return
        state.stream_end = how
        if not (self.feedback and state.token_sent):
            self._finish(state)
            return
        orphan = self._orphans.pop(state.token, None)
        if orphan is not None:
            state.completion = orphan[1]
        if state.completion is not None:
            self._finish(state)
            return
        timeout = state.route.timeout if state.route is not None else 0.0
        self._waiting[state.token] = (now if now is not None else time.monotonic()) + timeout + FEEDBACK_GRACE

    def completed(self, token: str, completion: Completion, now: float | None = None) -> str:
        """Envoy's access-log entry for `token` arrived: "matched", "late" (its request was already
        finished) or "orphan" (a token this worker does not know, kept `ORPHAN_TTL` in case its stream
        is registered later)."""
        state = self._open.get(token)
        if state is None:
            boot, _, n = token.rpartition("-")
            if boot != self.boot or (n.isdigit() and int(n) < self._next):
                # already finished (the deadline passed), or a previous process's request
                self.late_entries += 1
                return "late"
            self._orphans[token] = ((now if now is not None else time.monotonic()) + ORPHAN_TTL, completion)
            return "orphan"
        state.completion = completion
        if state.stream_end is not None:
            self._waiting.pop(token, None)
            self._finish(state)
        return "matched"

    def sweep(self, now: float | None = None) -> int:
        """Finish requests whose access-log entry is overdue; drop old orphans. Returns how many finished."""
        now = time.monotonic() if now is None else now
        overdue = [t for t, deadline in self._waiting.items() if deadline <= now]
        for token in overdue:
            del self._waiting[token]
            state = self._open.get(token)
            if state is not None:
                state.attrs["_completion_source"] = "deadline"
                self._finish(state)
        for token in [t for t, (exp, _) in self._orphans.items() if exp <= now]:
            del self._orphans[token]
        return len(overdue)

    def _finish(self, state: RequestState) -> None:
        if state.outcome is not None:  # exactly once, whatever calls this twice
            return
        self._open.pop(state.token, None)
        outcome = derive_outcome(state, state.completion)
        state.outcome = outcome
        if state.completion is None and state.first_byte is not None:
            # a route that reads the response learned its end from the stream
            state.completion = Completion(
                status=state.response_status or 0, upstream=state.served,
                first_upstream_byte=state.first_byte - state.started, source="stream",
                duration=time.monotonic() - state.started)
        self.done_count += 1
        if state.route is not None and state.route.pipeline is not None:
            state.route.pipeline.done(state, outcome)
        for observer in self.observers:
            try:
                observer(state, outcome)
            except Exception:
                log.exception("lifecycle observer %r failed", observer)

    def close(self) -> None:
        """The worker stops: every request not yet done ends now, from what is known."""
        self._waiting.clear()
        for state in list(self._open.values()):
            state.attrs["_completion_source"] = "shutdown"
            self._finish(state)

    @property
    def open_count(self) -> int:
        return len(self._open)


__all__ = ["Lifecycle", "Completion", "derive_outcome", "FEEDBACK_GRACE"]
