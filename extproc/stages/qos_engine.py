"""Stage `qos-engine`: the request's priority class passed to the engine, at request body.

What: for a request whose backend (chosen by `dispatch`) is listed in `spec.qos.enginePriority`, the
backend request gets the class's engine priority (`extproc/qos/priority.engine_body`): vLLM's
`priority` field on OpenAI-API backends (`openai` routes: the client's body, parsed by `openai-parse`,
with the class's value in place of any the client sent; `llm` routes: the request `encode-request`
made), the KServe v2 `parameters.priority` (Triton) on `tensor` routes. A backend whose declared or
probed dialect says it honours `priority` (`backends.dialects`, `dialect.priority: honoured`) counts
as listed. It runs last in the request
body phase, so its body (which includes `openai-parse`'s own change, made to the same parsed
document) is the one sent. Routes that never read the body (`kserve`, `passthrough`, bodiless
requests) cannot pass a priority; backends not listed get nothing (vLLM refuses a non-zero priority
unless started with `--scheduling-policy priority`).
Cost: nothing unless the backend is listed; then one JSON encode (plus a decode on llm/tensor routes).
"""

from __future__ import annotations

from extproc.qos.engine import QosConfig
from extproc.qos.priority import PRIORITY_ATTR, engine_body
from extproc.types import HttpMessage, Mutate, RequestState, Verdict


class QosEngine:
    name = "qos-engine"

    def __init__(self, qos: QosConfig):
        self.qos = qos

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        target = state.target
        cls = state.attrs.get(PRIORITY_ATTR)
        if cls is None or target is None:
            return None
        if target.name not in self.qos.engine_backends and \
                getattr(getattr(target, "dialect", None), "priority", None) != "honoured":
            return None
        req = state.request
        body = engine_body(target.kind, cls, req.body if req is not None else None, state.backend_request)
        if body is None:
            return None
        if state.backend_request is not None:
            state.backend_request = body
        return Mutate(set_headers=(("content-length", str(len(body))),), body=body)


__all__ = ["QosEngine"]
