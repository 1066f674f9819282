"""Stage `kserve-parse`: the model of a KServe v2 request from its path, with the tenant, for dispatch."""

from __future__ import annotations

import pytest

from extproc.config.loader import load_text
from extproc.request import InferenceRequest
from extproc.stages.kserve_dispatch import KServeParse
from extproc.types import HttpMessage, Phase, RequestState

SNAP = load_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: ks}
spec:
  backends: [{name: tri, kind: triton, endpoints: ["127.0.0.1:9"], models: [fraud]}]
  routes: [{path: /v2, match: prefix, name: kserve, kind: kserve, target: tri}]
""")


def parse(headers, tenant: str | None = None) -> RequestState:
    st = RequestState(snapshot=SNAP, route=SNAP.routes["kserve"], started=0.0, tenant=tenant)
    assert KServeParse().on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers=headers)) is None
    return st


@pytest.mark.parametrize("path, model", [("/v2/models/fraud/infer", "fraud"),
                                         ("/v2/models/fraud/versions/2/infer?x=1", "fraud"),
                                         ("/v2/health/ready", None), ("/inference.GRPCInferenceService/ModelInfer", None)])
def test_the_model_comes_from_the_path(path, model):
    st = parse({":path": path, ":method": "POST"}, tenant="acme")
    assert st.request == InferenceRequest(api="kserve.v2", model=model, tenant="acme", body=None)


@pytest.mark.parametrize("headers", [None, {}, {":method": "GET"}])
def test_no_path_names_no_model(headers):
    assert parse(headers).request == InferenceRequest(api="kserve.v2", model=None, tenant=None, body=None)
