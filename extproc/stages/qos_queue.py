"""Stage `qos-queue`: admission to a backend pool's adaptive concurrency limit, waiting in the gateway queue.

What (routes of configs with `spec.qos.admission` whose targets include a listed pool; right before
`dispatch`, in the same phase, so the endpoint is picked when the request is admitted, with the load
as it is then): the pool is the first of the request's candidate backends (those serving its model)
that has admission; the request's class is `state.attrs["qos.class"]` (set by `qos-admit`), its token
estimate prompt characters / 4 + max_tokens, its size the request body's bytes. `Admission.acquire`
(`extproc/qos/queue.py`) admits it at once, or makes the stream wait in the pool's queue (the hook is a
coroutine: the ext_proc stream does not answer the phase until the request is admitted), or refuses it
in the route's error dialect: 429 `overloaded` with Retry-After for sheddable classes, 503
`queue_full` / `queue_timeout` for the others. `on_done` releases the slot (its TTFT, admission to the
first streamed body, feeds the pool's limiter, `extproc/qos/limiter.py`). On a route with `serverTiming` the
time spent in `Admission.acquire` (its wait in the queue included) is recorded as the request's `queue`
component (`state.attrs[extproc.attribution.QUEUE_ATTR]` = (phase, seconds); docs/attribution.md).
`QosQueueAtHeaders` runs where dispatch runs at request headers (kinds that never read the body, and
bodiless requests of kinds that do: `only_without_body`), `QosQueueAtBody` where it runs at the body.
With a canary rollout the pool is the first candidate with admission, which may not be the arm's.
Cost: routes without a pool get no stage; with one, see `Admission.acquire` (admitted at once: a few us).
"""

from __future__ import annotations

import time
from typing import Any

from extproc.attribution import QUEUE_ATTR, TIMING_ATTR
from extproc.qos.priority import PRIORITY_ATTR
from extproc.qos.queue import SLOT_ATTR, Admission, AdmissionConfig, estimate_tokens
from extproc.types import HttpMessage, Outcome, Phase, RequestState, Verdict


class _QosQueue:
    name = "qos-queue"

    def __init__(self, admission: AdmissionConfig, default_class: Any):
        self.admission = admission
        self.default_class = default_class
        self._own: Admission | None = None  # without a runtime (unit tests)

    def runtime(self, state: RequestState) -> Admission:
        adm = getattr(state.runtime, "admission", None) if state.runtime is not None else None
        if adm is None:
            if self._own is None:
                self._own = Admission()
                self._own.configure(self.admission)
            adm = self._own
        return adm

    async def admit(self, state: RequestState, body: bytes | None, phase: Phase) -> Verdict | None:
        if SLOT_ATTR in state.attrs:
            return None
        route = state.route
        if route is None:
            return None
        adm = self.runtime(state)
        req = state.request
        pool = None
        for b in route.backends_for_model(req.model if req is not None else None):
            pool = adm.pools.get(b.name)
            if pool is not None:
                break
        if pool is None:
            return None
        cls = state.attrs.get(PRIORITY_ATTR) or self.default_class
        if TIMING_ATTR not in state.attrs:  # no serverTiming on the route: nothing to attribute
            return await adm.acquire(pool, state, cls, estimate_tokens(req), len(body) if body else 0)
        t0 = time.perf_counter()
        try:
            return await adm.acquire(pool, state, cls, estimate_tokens(req), len(body) if body else 0)
        finally:
            state.attrs[QUEUE_ATTR] = (phase, time.perf_counter() - t0)

    def on_done(self, state: RequestState, outcome: Outcome) -> None:
        if SLOT_ATTR in state.attrs:
            self.runtime(state).release(state)


class QosQueueAtHeaders(_QosQueue):
    def __init__(self, admission: AdmissionConfig, default_class: Any, only_without_body: bool = False):
        super().__init__(admission, default_class)
        self.only_without_body = only_without_body

    async def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        if self.only_without_body and not msg.end_of_stream:
            return None  # the body comes next: admitted there, with its model and size
        return await self.admit(state, None, Phase.REQUEST_HEADERS)


class QosQueueAtBody(_QosQueue):
    async def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        return await self.admit(state, msg.body, Phase.REQUEST_BODY)


__all__ = ["QosQueueAtHeaders", "QosQueueAtBody"]
