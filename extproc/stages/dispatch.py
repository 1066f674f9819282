"""Stage `dispatch`: the one place a request is sent to a backend: variant, then endpoint, then Envoy.

What: from the parsed request (`state.request`, or the route's default when there is none) the
route's targets that serve its model are the candidates (404 `model_not_found`, in the route's
dialect, when none does); the variant slot chooses among them: the route's first candidate, or, on
a route with a rollout (`spec.rollouts`), the backend of the arm `canary.assign.decide` assigns
(sticky by a trusted key, `state.variant` = "<rollout>/<arm>", also sent as dynamic metadata
`adapter.variant`, from which Envoy's route adds the `x-adapter-variant` response header); the
route's picker plugin or scheduling profile, if any, names an endpoint of that backend and its fallbacks (`extproc/scheduling/`). When a profile's filters leave no
endpoint the request is refused in the route's dialect: 503 `no_capacity`, or 429 `overloaded`
with `Retry-After: 1` when the request is sheddable (priority < 0, the GIE rule). The reply sets `x-adapter-backend` and
`x-adapter-route-target` (Envoy matches the (route, backend) entry that carries the route's
policy) with `clear_route_cache`, and, when an endpoint was picked, the endpoint-picker protocol's
`x-gateway-destination-endpoint: ip:port[,ip:port...]` header plus the same list in dynamic
metadata `envoy.lb` (Envoy's override-host load balancer honours it; without a pick Envoy
balances). The pick is counted in flight until the request's `on_done`.
`DispatchAtHeaders` runs at request headers (routes that never read the body, and bodiless
requests of routes that do: `only_without_body`); `DispatchAtBody` after the body was parsed.
Why: one dispatch point instead of a `route_to` call in every stage: canaries and schedulers
change one function, and every route kind gets them.
Cost: one backend scan (a route has a handful of targets) plus the picker's own cost; with a rollout,
`decide` (a blake2b of the key and a scan of the arms, about 2 us).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from canary.assign import RequestFacts, decide
from extproc.config.snapshot import (BACKEND_HEADER, DESTINATION_HEADER, LB_METADATA_NAMESPACE, ROUTE_TARGET_HEADER,
                                     VARIANT_HEADER, VARIANT_METADATA_KEY, VARIANT_METADATA_NAMESPACE)
from extproc.codec import claims_dict
from extproc.errors import reject
from extproc.scheduling import PREFILL_ATTR, NoCapacity
from extproc.types import HttpMessage, Mutate, Outcome, Reject, RequestState, Verdict

RETRY_AFTER_S = 1  # Retry-After of a sheddable request refused because no endpoint is left
ASSIGNMENT_ATTR = "canary.assignment"  # state.attrs: the canary.assign.Assignment (arm, how, source, reasons)
FALLBACK_ATTR = "canary.fallback"  # state.attrs: the arm chosen whose backend did not serve the model
CLAIMS_ATTR = "jwt.claims"  # state.attrs: the verified JWT payload Envoy forwarded (extproc/codec.py `_claims`)


def dispatch(state: RequestState, *headers: tuple[str, str], body: bytes | None = None) -> Verdict:
    """Choose backend and endpoint for this request; the routing reply, with `headers` and `body` added."""
    route = state.route
    model = state.request.model if state.request is not None else None
    candidates = route.backends_for_model(model)
    if not candidates:
        served = ", ".join(route.models) or "none"
        if state.request is not None and state.request.api == "kserve.v2":
            message = f"Request for unknown model: '{model}' is not found (served through this gateway: {served})"
        else:
            message = f"The model `{model}` does not exist on this gateway (served: {served})."
        return reject(404, "model_not_found", message, param="model")
    backend = candidates[0]
    metadata: tuple = ()
    endpoints = None  # an endpoint arm's endpoints (None: all of the backend's)
    if route.rollout is not None:  # the variant slot: the rollout's arm, when its backend serves the model
        backend = choose_variant(state, route.rollout, candidates)
        if state.variant is not None:
            metadata = ((VARIANT_METADATA_NAMESPACE, {VARIANT_METADATA_KEY: state.variant}),)
            if route.rollout.arm_endpoints:
                endpoints = route.rollout.arm_endpoints.get(state.variant.partition("/")[2])
    state.backend = backend.name
    state.target = backend
    set_headers = (*headers, (BACKEND_HEADER, backend.name), (ROUTE_TARGET_HEADER, route.name))
    if endpoints is not None and (route.picker is None or state.runtime is None):
        # an endpoint arm without a picker: its endpoints, the least loaded first (the rest as fallbacks)
        picks = _least_loaded(state, endpoints)
        value = ",".join(picks)
        if state.runtime is not None:
            dispatched(state, picks[0])
        set_headers += ((DESTINATION_HEADER, value),)
        metadata += ((LB_METADATA_NAMESPACE, {DESTINATION_HEADER: value}),)
    elif route.picker is not None and backend.pickable and state.runtime is not None:
        try:
            picks = state.runtime.plugin(route.picker).pick(state, backend, endpoints or backend.endpoint_ids)
        except NoCapacity as e:
            refusal = no_capacity(e)
            if state.variant is not None:  # the arm was chosen: the refusal names it (Envoy's route adds
                refusal = replace(refusal, headers=((VARIANT_HEADER, state.variant),))  # none to it)
            return refusal
        if picks:
            value = ",".join(picks)
            dispatched(state, picks[0])
            set_headers += ((DESTINATION_HEADER, value),)
            metadata += ((LB_METADATA_NAMESPACE, {DESTINATION_HEADER: value}),)
    return Mutate(set_headers=set_headers, body=body, clear_route_cache=True, dynamic_metadata=metadata)


def _least_loaded(state: RequestState, endpoints: tuple[str, ...]) -> tuple[str, ...]:
    """`endpoints` ordered by gateway-wide in-flight requests, fewest first (ties: in config order)."""
    if state.runtime is None or len(endpoints) < 2:
        return endpoints
    counts = state.runtime.inflight.counts(endpoints)
    return tuple(sorted(endpoints, key=counts.__getitem__))


def choose_variant(state: RequestState, ro: Any, candidates: tuple) -> Any:
    """The backend of the arm `canary.assign.decide` chooses for this request (forced by a trusted
    header, else sticky by its key, else weighted random), and `state.variant` = "<rollout>/<arm>".
    The key comes from the headers the stream kept at request headers (`state.attrs`, only the
    rollout's `headers`), the verified JWT payload Envoy's jwt_authn forwarded (`CLAIMS_ATTR`, on
    configs with a rollout keyed on a claim) and the tenant admission resolved.
    When the arm's backend does not serve the request's model, the request goes to `candidates[0]`
    (counted in `adapter_processor_variant_fallbacks_total`) and names the arm of that backend, if one
    is (the baseline first), else no arm."""
    attrs = state.attrs
    headers = {h: attrs[h] for h in ro.headers if h in attrs}
    claims = claims_dict(attrs.get(CLAIMS_ATTR)) if ro.uses_claims else None
    a = decide(ro.rollout, ro.policy, RequestFacts(headers, claims, state.tenant))
    attrs[ASSIGNMENT_ATTR] = a
    state.variant_unit = a.unit
    want = ro.arm_backends[a.arm]
    for b in candidates:
        if b.name == want:
            state.variant = a.variant
            return b
    backend = candidates[0]
    attrs[FALLBACK_ATTR] = a.arm
    served = next((arm for arm in ro.arms if ro.arm_backends[arm] == backend.name), None)
    state.variant = f"{ro.name}/{served}" if served is not None else None
    return backend


def no_capacity(e: NoCapacity) -> Reject:
    """The refusal of a decision whose filters left nothing (the endpoint-picker protocol's 429 / 503)."""
    where = (f"scheduling profile {e.profile!r} left no endpoint of backend {e.backend!r} "
             f"({e.candidates} before filter {e.filter!r})")
    if e.sheddable:
        return reject(429, "overloaded", f"{where}; the request is sheddable (priority {e.priority}): retry later",
                      retry_after=RETRY_AFTER_S, profile=e.profile, backend=e.backend)
    return reject(503, "no_capacity", f"{where} to serve this request", profile=e.profile, backend=e.backend)


def dispatched(state: RequestState, endpoint: str) -> None:
    """The pick goes to `endpoint`: it counts in the gateway-wide in-flight table with its estimated
    tokens (prompt + max_tokens: what it holds in the engine's KV cache) and prefill tokens (pending
    until the first response body, `prefilled`); `release` takes both back at the end."""
    state.endpoint = endpoint
    req = state.request
    prompt = req.prompt_tokens_estimate() if req is not None else 0
    tokens = prompt + ((req.max_tokens or 0) if req is not None else 0)
    prefill = state.attrs.get(PREFILL_ATTR, prompt)
    state.inflight = (tokens, prefill)
    state.runtime.inflight.started(endpoint, tokens, prefill)


def prefilled(state: RequestState) -> None:
    """The first response body of a picked request: its prefill is done (the stream calls this)."""
    held = state.inflight
    if held is not None and held[1] and state.endpoint is not None and state.runtime is not None:
        state.runtime.inflight.prefilled(state.endpoint, held[1])
        state.inflight = (held[0], 0)


def release(state: RequestState, outcome: Outcome) -> None:
    """The lifecycle observer that ends a pick's in-flight count, tokens and any prefill still pending
    (the runtime registers it)."""
    if state.endpoint is not None and state.runtime is not None:
        tokens, prefill = state.inflight or (0, 0)
        state.runtime.inflight.finished(state.endpoint, tokens, prefill)
        state.inflight = None


class DispatchAtHeaders:
    name = "dispatch"

    def __init__(self, only_without_body: bool = False):
        self.only_without_body = only_without_body

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        if self.only_without_body and not msg.end_of_stream:
            return None  # the body comes next: dispatch reads the model from it
        return dispatch(state)


class DispatchAtBody:
    name = "dispatch"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        return dispatch(state)


def backend_of(state: RequestState) -> Any:
    """The backend dispatch chose (stages after dispatch adapt the request to it)."""
    return state.target if state.target is not None else state.route.backend


__all__ = ["dispatch", "DispatchAtHeaders", "DispatchAtBody", "release", "backend_of", "no_capacity", "choose_variant",
           "ASSIGNMENT_ATTR", "FALLBACK_ATTR"]
