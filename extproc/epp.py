"""EPP mode: the processor as the endpoint picker (EPP) of a Gateway API InferencePool gateway.

What: with `spec.epp` in the config, every ext_proc stream that carries no `x-adapter-route`
metadata (a gateway configured by Gateway API sends none) is served here, per the GIE
endpoint-picker protocol (`docs/proposals/004-endpoint-picker-protocol`, v1.0.0):
- the candidates are the pool's endpoints (`spec.epp.pool`), restricted to the subset hint when
  the gateway sends one (`metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`: a list of `ip:port`, or one comma-separated string
  as Envoy's header-to-metadata filter writes it; an entry without a port allows every port of that
  IP); a hint that leaves none is a 503;
- the body (OpenAI chat/completions/...) is read for the model, prompt and priority
  (`extproc/request.py`), `model` is rewritten when `spec.epp.modelRewrites` names it, and the
  profile (`spec.epp.profile`) picks: the reply sets `x-gateway-destination-endpoint:
  ip:port[,ip:port...]` (the pick, then its fallbacks) and the same value in dynamic metadata
  `envoy.lb`; no endpoint left is 503 `no_capacity`, or 429 `overloaded` (Retry-After) for a
  sheddable request (priority < 0), as immediate responses in the OpenAI error format;
- body modes, as Envoy announces them in `protocol_config` (Envoy >= 1.35): FULL_DUPLEX_STREAMED
  (what kgateway, Istio and Envoy AI Gateway configure for an InferencePool, request and response):
  the chunks are accumulated, the headers reply waits for the end of the body (the pick needs it),
  then the body goes back as `streamed_response` chunks of at most 62 KiB; response chunks are sent
  back as they come (tokens stream through). BUFFERED (GIE's example Envoy config, Envoy AI
  Gateway's `processing-body-mode: buffered`): headers are answered at once, the pick rides on the
  body reply (its header mutation applies to the request headers). Without `protocol_config` the
  protocol's streaming mode is assumed;
- the response: `x-gateway-destination-endpoint-served` (`envoy.lb` filter metadata, when the
  gateway forwards it) or the `upstream.address` attribute names the endpoint that served.
The pick is counted in flight (`runtime.inflight`) until the request ends (the lifecycle, from what
the stream sees: there is no access-log feedback from a gateway's Envoy).
Why: one processor, two deployments: behind our own Envoy (routes, adapters) or as the EPP that
Envoy Gateway, kgateway, Istio or GKE call for an InferencePool, with the same scheduling profiles.
Not done: leader election (replicas pick independently; readiness is SERVING on every replica),
InferenceObjective criticality (priority comes from the body), response-body usage accounting.
Cost: one JSON parse (plus one encode when the model is rewritten) and the profile's decision per
request; per response chunk one reply (the price of FULL_DUPLEX_STREAMED).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

import orjson

from extproc import codec
from extproc.config.snapshot import DESTINATION_HEADER, LB_METADATA_NAMESPACE
from extproc.errors import reject
from extproc.request import parse_json_body, parse_openai
from extproc.scheduling import NoCapacity
from extproc.stages.dispatch import dispatched, no_capacity
from extproc.types import CONTINUE, HINT_HEADERS, Mutate, Outcome, Phase, Reject, RequestState

log = logging.getLogger(__name__)

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
CHUNK = 62 * 1024  # streamed body replies: Envoy recommends <= 64 KiB per chunk (GIE uses 62 KiB)
STREAMING = "FULL_DUPLEX_STREAMED"

_RH, _RB, _RT = Phase.REQUEST_HEADERS, Phase.REQUEST_BODY, Phase.REQUEST_TRAILERS
_SH, _SB, _ST = Phase.RESPONSE_HEADERS, Phase.RESPONSE_BODY, Phase.RESPONSE_TRAILERS


def subset_of(value: Any) -> tuple[str, ...] | None:
    """The subset hint's entries (None: no hint). A list, or a comma-separated string, or both."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    return tuple(p.strip() for v in items if isinstance(v, str) for p in v.split(",") if p.strip())


def restrict(endpoints: tuple[str, ...], subset: tuple[str, ...] | None) -> tuple[str, ...]:
    """The pool's endpoints the hint allows, in pool order (`ip` alone allows every port of it)."""
    if subset is None:
        return endpoints
    allowed = set(subset)
    return tuple(e for e in endpoints if e in allowed or e.rpartition(":")[0].strip("[]") in allowed)


def decide(state: RequestState, headers: Any, raw: bytes,
           subset: tuple[str, ...] | None) -> tuple[Any, bytes | None]:
    """(verdict, rewritten body or None): the pick as a Mutate (header + `envoy.lb` metadata), or a Reject."""
    epp = state.snapshot.epp
    pool = epp.pool
    path = headers.get(":path", "").split("?", 1)[0]
    out = None
    body: Any = parse_json_body(raw, allow_empty=True)
    if isinstance(body, Reject):
        return body, None
    if body is None:
        body = {}
    if not isinstance(body, dict):
        return reject(400, "invalid_request", "request body must be a JSON object"), None
    target = epp.model_rewrites.get(body.get("model")) if isinstance(body.get("model"), str) else None
    if target is not None:
        body["model"] = target
        out = orjson.dumps(body)
    state.request = parse_openai(path, body, state.tenant)
    state.backend = pool.name
    state.target = pool
    candidates = restrict(pool.endpoint_ids, subset)
    if not candidates:
        return reject(503, "no_capacity", f"the gateway's subset hint ({', '.join(subset or ()) or 'empty'}) names "
                      f"no endpoint of pool {pool.name!r} ({', '.join(pool.endpoint_ids)})",
                      backend=pool.name), None
    try:
        picks = state.runtime.plugin(state.route.picker).pick(state, pool, candidates)
    except NoCapacity as e:
        return no_capacity(e), None
    if not picks:  # a picker that names none here (pinned outside the subset): the first candidate
        picks = candidates[:1]
    value = ",".join(picks)
    dispatched(state, picks[0])
    return Mutate(set_headers=((DESTINATION_HEADER, value),), clear_route_cache=True,
                  dynamic_metadata=((LB_METADATA_NAMESPACE, {DESTINATION_HEADER: value}),)), out


async def serve(service: Any, snap: Any, requests: AsyncIterator[Any], request_id: str | None) -> AsyncIterator[Any]:
    """One EPP stream: the replies to Envoy's messages (several per message in streaming mode)."""
    route = snap.epp.route
    state = RequestState(snapshot=snap, route=route, started=time.monotonic(), request_id=request_id or "",
                         runtime=service.runtime)
    lifecycle = service.runtime.lifecycle
    lifecycle.start(state)
    m, pending, child = service.metrics, service._pending, service._child
    m.streams_active.inc()
    busy = 0.0
    how = "end"
    headers: Any = {}
    body = bytearray()
    subset: tuple[str, ...] | None = None
    req_streaming = resp_streaming = True
    picked = False
    try:
        async for req in requests:
            if service.recorder is not None:
                service.recorder("epp", state.request_id, req)
            t0 = time.perf_counter()
            msg = codec.decode(req)
            phase = msg.phase
            replies: list[Any] = []
            verdict: Any = CONTINUE
            if phase is _RH:
                headers = msg.headers or {}
                for name in HINT_HEADERS:  # routing hints the scheduling plugins read at the pick
                    if name in headers:
                        state.attrs[name] = headers[name]
                subset = subset_of(codec.filter_metadata(req, SUBSET_NAMESPACE, SUBSET_KEY))
                modes = codec.body_modes(req)
                if modes is not None:
                    req_streaming, resp_streaming = modes[0] == STREAMING, modes[1] == STREAMING
                if msg.end_of_stream:  # no body (GET): pick now
                    verdict, _ = decide(state, headers, b"", subset)
                    picked = True
                    replies.append(codec.encode(_RH, verdict, route.dialect, route.name, state.request_id))
                elif not req_streaming:  # BUFFERED: Envoy sends the body only after this reply
                    replies.append(codec.encode(_RH, CONTINUE))
                # streaming: the headers reply waits for the body, which the pick needs
            elif phase is _RB or (phase is _RT and not picked):
                if phase is _RB:
                    body += msg.body
                if len(body) > route.max_body_bytes:
                    verdict = reject(413, "body_too_large", f"request body exceeds {route.max_body_bytes} bytes, "
                                     "the EPP's limit (spec.epp.maxBodyBytes)", limit=route.max_body_bytes)
                    replies.append(codec.encode(phase, verdict, route.dialect, route.name, state.request_id))
                elif msg.end_of_stream or phase is _RT:
                    raw = bytes(body)
                    verdict, out = decide(state, headers, raw, subset)
                    picked = True
                    if isinstance(verdict, Reject) or not req_streaming:
                        if out is not None and not isinstance(verdict, Reject):  # BUFFERED: a body mutation
                            verdict = Mutate(set_headers=verdict.set_headers + (("content-length", str(len(out))),),
                                             body=out, clear_route_cache=True,
                                             dynamic_metadata=verdict.dynamic_metadata)
                        replies.append(codec.encode(phase, verdict, route.dialect, route.name, state.request_id))
                    else:
                        out = raw if out is None else out
                        replies.append(codec.encode(_RH, verdict))
                        last = len(out) and (len(out) - 1) // CHUNK
                        for i in range(last + 1):  # an empty body is one empty chunk
                            replies.append(codec.streamed_body(_RB, out[i * CHUNK:(i + 1) * CHUNK],
                                                               i == last and phase is _RB))
                        if phase is _RT:
                            replies.append(codec.encode(_RT, CONTINUE))
                    body = bytearray()
                elif not req_streaming:
                    replies.append(codec.encode(_RB, CONTINUE))
            elif phase is _RT:
                replies.append(codec.encode(_RT, CONTINUE))
            else:  # the response
                if state.first_byte is None:
                    state.first_byte = time.monotonic()
                    attrs = msg.attributes or {}
                    state.served = (codec.filter_metadata(req, LB_METADATA_NAMESPACE, SERVED_KEY)
                                    or attrs.get("upstream.address") or state.served)
                if phase is _SH:
                    state.response_status = int((msg.headers or {}).get(":status", "0") or 0)
                    replies.append(codec.encode(_SH, CONTINUE))
                elif phase is _SB:
                    replies.append(codec.streamed_body(_SB, msg.body, msg.end_of_stream) if resp_streaming
                                   else codec.encode(_SB, CONTINUE))
                    if msg.end_of_stream:
                        state.complete = True
                else:
                    replies.append(codec.encode(_ST, CONTINUE))
                    state.complete = True
            if picked and not isinstance(verdict, Reject):
                state.complete = True  # the stream saw what the EPP needs; the response is optional
            dt = time.perf_counter() - t0
            busy += dt
            pending.observe(child(m.phase_duration, route.name, phase.value), dt)
            if isinstance(verdict, Reject):
                state.reply_status, state.reply_code = verdict.status, verdict.code
                pending.inc(child(m.errors, route.name, verdict.code))
                state.observed = Outcome.REJECTED
                state.complete = True
            for r in replies:
                yield r
            if isinstance(verdict, Reject):
                return
    except (asyncio.CancelledError, GeneratorExit):  # Envoy reset the side stream: a normal end
        how = "cancelled"
        raise
    except Exception:
        how = "error"
        log.exception("EPP stream failed")
        raise
    finally:
        m.streams_active.dec()
        pending.observe(child(m.request_duration, route.name), busy)
        lifecycle.stream_ended(state, how)


__all__ = ["serve", "decide", "subset_of", "restrict", "SUBSET_NAMESPACE", "SUBSET_KEY", "SERVED_KEY"]
