"""encode-request and decode-response render with a bundle arm's templates (`variant_route`): the arm
in `state.variant` picks the route of that bundle version; no arm, or a backend arm, keeps the route."""

from __future__ import annotations

import json

import orjson

from extproc.config.loader import load_text
from extproc.stages.decode_response import DecodeResponse
from extproc.stages.encode_request import EncodeRequest, variant_route
from extproc.types import HttpMessage, Phase, RequestState
from tests.canary.adapter_bundles import make_bundle

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: variants}
spec:
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9001"], models: [m]}
  routes:
    - {path: /s, name: split, kind: llm, target: llm, transform: '{"summary": $.output.text, "v": "file"}'}
  bundles: [{path: split-1.zip}, {path: split-2.zip}]
  rollouts:
    - name: ro
      route: split
      arms: [{name: v1, bundle: split@1}, {name: v2, bundle: split@2, weight: 50}]
"""


def run(snap, variant):
    state = RequestState(snapshot=snap, route=snap.routes["split"], started=0.0, variant=variant)
    state.input_doc = {"query": "q"}
    encoded = EncodeRequest().on_request_body(state, HttpMessage(Phase.REQUEST_BODY, body=b"{}"))
    sent = orjson.loads(encoded.body)
    answer = {"choices": [{"message": {"content": json.dumps({"text": "hi"})}}]}
    state.response_status = 200
    out = DecodeResponse().on_response_body(state, HttpMessage(Phase.RESPONSE_BODY, body=orjson.dumps(answer)))
    return sent, orjson.loads(out.body)


def test_each_arm_renders_with_its_bundle_and_no_arm_with_the_route(tmp_path):
    for version, tag in (("1", "s1"), ("2", "s2")):
        make_bundle(tmp_path, version, name="split", route="split", tag=tag)
    (tmp_path / "gw.yaml").write_text(CONFIG)
    snap = load_text(CONFIG, str(tmp_path / "gw.yaml"))
    assert run(snap, "ro/v1")[1] == {"summary": "hi", "v": "s1"}
    sent, out = run(snap, "ro/v2")
    assert out == {"summary": "hi", "v": "s2"}
    assert sent["response_format"]["json_schema"]["schema"]["required"] == ["text"]  # the arm's derived schema
    assert run(snap, None)[1] == {"summary": "hi", "v": "file"}
    route = snap.routes["split"]
    state = RequestState(snapshot=snap, route=route, started=0.0, variant="ro/unknown")
    assert variant_route(state) is route
