"""Stage `encode-request` on compiled routes: the backend adapter's request replaces the body, with
`:path` (only when the adapter names one), `content-type` and an exact `content-length`; the model
metadata `model-metadata` found is used (datatypes and shapes checked); an input error is a 400 naming
the field."""

from __future__ import annotations

import orjson
import pytest

from extproc.config.loader import load_text
from extproc.stages.encode_request import EncodeRequest
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState

SNAP = load_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: enc}
spec:
  backends:
    - {name: svc, kind: rest, endpoints: ["127.0.0.1:9004"]}
    - {name: ort, kind: onnxruntime, protocol: http, endpoints: ["127.0.0.1:9"]}
  routes:
    - {path: /orders, name: rest, kind: rest, target: svc}
    - {path: /score, name: score, kind: tensor, target: ort, model: m, request: '{"x": [$.x]}'}
""")
BODY = HttpMessage(Phase.REQUEST_BODY, body=b"ignored: the stage reads state.input_doc", end_of_stream=True)
META = {"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]}


def state(route: str, doc, metadata=None) -> RequestState:
    st = RequestState(snapshot=SNAP, route=SNAP.routes[route], started=0.0, input_doc=doc)
    if metadata is not None:
        st.attrs["model_metadata"] = metadata
    return st


def test_a_tensor_request_uses_the_models_metadata():
    st = state("score", {"x": [1, 2]}, META)
    v = EncodeRequest().on_request_body(st, BODY)
    sent = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})
    assert v == Mutate(set_headers=((":path", "/v2/models/m/infer"), ("content-type", "application/json"),
                                    ("content-length", str(len(sent)))), body=sent)
    assert st.backend_request == sent


def test_without_metadata_the_datatype_is_inferred():
    v = EncodeRequest().on_request_body(state("score", {"x": [1, 2]}), BODY)
    assert orjson.loads(v.body)["inputs"][0]["datatype"] == "INT64"


def test_an_input_the_model_refuses_is_a_400_naming_it():
    st = state("score", {"x": [1, 2, 3]}, META)
    v = EncodeRequest().on_request_body(st, BODY)
    assert isinstance(v, Reject) and (v.status, v.code) == (400, "invalid_tensor")
    assert v.message == "input x: shape [1, 3] does not match the model's [-1, 2] (-1 is any size)"
    assert v.fields == {"path": "x"} and st.backend_request is None


def test_a_missing_request_field_is_a_400_naming_its_path():
    v = EncodeRequest().on_request_body(state("score", {"y": 1}), BODY)
    assert isinstance(v, Reject) and (v.status, v.code, v.fields) == (400, "missing_input_field", {"path": "$.x"})
    assert v.message == "request field $.x is required by this route"


@pytest.mark.parametrize("doc", [{"id": 7, "note": "é"}, [1, 2]])
def test_a_rest_request_keeps_the_clients_path(doc):
    st = state("rest", doc)
    v = EncodeRequest().on_request_body(st, BODY)
    sent = orjson.dumps(doc)
    assert v == Mutate(set_headers=(("content-type", "application/json"), ("content-length", str(len(sent)))),
                       body=sent)
    assert st.backend_request == sent
