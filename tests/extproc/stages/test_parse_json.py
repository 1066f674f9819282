"""Stage `parse-json`: the client's JSON becomes `state.input_doc` and the typed `state.request` (the
route's model, the tenant, the document when it is an object); 413 over the route's limit, 400 for
bodies that are empty or not JSON, with nothing parsed into the state."""

from __future__ import annotations

import pytest

from extproc.config.loader import load_text
from extproc.request import InferenceRequest
from extproc.stages.parse_json import ParseJson
from extproc.types import HttpMessage, Phase, Reject, RequestState

SNAP = load_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: pj}
spec:
  backends: [{name: llm, endpoints: ["127.0.0.1:9"], models: [m7]}]
  routes: [{path: /r, kind: llm, policy: {maxBodyBytes: 40}}]
""")


def run(data: bytes, tenant: str | None = None):
    st = RequestState(snapshot=SNAP, route=SNAP.routes["r"], started=0.0, tenant=tenant)
    return st, ParseJson().on_request_body(st, HttpMessage(Phase.REQUEST_BODY, body=data, end_of_stream=True))


def test_an_object_becomes_the_input_and_the_request_with_the_routes_model():
    st, v = run(b'{"q": "hi", "n": [1, 2]}', tenant="acme")
    assert v is None and st.input_doc == {"q": "hi", "n": [1, 2]}
    assert st.request == InferenceRequest(api="document", model="m7", tenant="acme", body={"q": "hi", "n": [1, 2]})


def test_json_that_is_not_an_object_is_input_without_a_request_body():
    st, v = run(b"[1, 2]")
    assert v is None and st.input_doc == [1, 2]
    assert st.request == InferenceRequest(api="document", model="m7", tenant=None, body=None)


@pytest.mark.parametrize("data, status, code", [(b"", 400, "empty_body"), (b"{x", 400, "malformed_json"),
                                                 (b"[" + b" " * 40, 413, "body_too_large")])
def test_refusals_leave_the_state_unparsed(data, status, code):
    st, v = run(data)
    assert isinstance(v, Reject) and (v.status, v.code) == (status, code)
    assert st.input_doc is None and st.request is None
