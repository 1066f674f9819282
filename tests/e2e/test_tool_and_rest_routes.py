"""Tool calls and legacy-contract mapping end to end, through Envoy, against a real REST service."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from extproc.stack import free_port, wait_http
from tests.conftest import DATA, REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.e2e.conftest import make_stack

    port = free_port()
    service = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "petstore_service.py"), str(port)])
    cfg = tmp_path_factory.mktemp("tools") / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: tools}}
spec:
  backends: [{{name: petstore, kind: rest, endpoints: ["127.0.0.1:{port}"]}}]
  routes:
    - {{path: /tools/petstore, kind: tool, target: petstore, openapi: {DATA / "openapi" / "petstore.yaml"}}}
    - {{path: /orders, kind: rest, target: petstore, mapping: {DATA / "contract" / "rest-mapping.yaml"}}}
""")
    st = make_stack(cfg)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 20, service)
        st.start()
        yield st
    finally:
        st.stop()
        service.terminate()
        service.wait(5)


def call(stack, doc) -> httpx.Response:
    return httpx.post(f"{stack.url}/tools/petstore", json=doc, timeout=10)


def test_openai_tool_call_becomes_the_service_request_and_a_tool_message(stack):
    r = call(stack, {"id": "call_1", "type": "function",
                     "function": {"name": "showPetById", "arguments": json.dumps({"petId": "1"})}})
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["role"] == "tool" and msg["tool_call_id"] == "call_1"
    result = json.loads(msg["content"])
    assert result["status"] == 200 and result["body"] == {"id": 1, "name": "Rex", "tag": "dog"}


def test_anthropic_and_mcp_calls_with_query_and_body(stack):
    r = call(stack, {"type": "tool_use", "id": "tu_1", "name": "listPets", "input": {"limit": 1}})
    block = r.json()
    assert block["type"] == "tool_result" and json.loads(block["content"])["body"] == [
        {"id": 1, "name": "Rex", "tag": "dog"}]  # ?limit=1 reached the service
    r = call(stack, {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                     "params": {"name": "createPets", "arguments": {"id": 3, "name": "Kit"}}})
    rpc = r.json()
    assert rpc["id"] == 7 and rpc["result"]["isError"] is False
    assert rpc["result"]["structuredContent"] == {"id": 3, "name": "Kit"}  # POSTed as the JSON body


def test_service_errors_come_back_as_tool_results(stack):
    r = call(stack, {"name": "showPetById", "arguments": {"petId": "404"}})
    assert r.status_code == 200 and r.headers["x-adapter-tool-status"] == "404"
    assert r.json()["isError"] is True


def test_bad_arguments_are_a_400_naming_the_field_and_nothing_reaches_the_service(stack):
    r = call(stack, {"name": "createPets", "arguments": {"id": "three", "name": "Kit"}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert any(e["pointer"] == "/id" for e in err["errors"]), err
    unknown = call(stack, {"name": "deletePets", "arguments": {}})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_tool"


def test_rest_route_maps_the_adapter_schema_to_the_legacy_contract_and_back(stack):
    r = httpx.post(f"{stack.url}/orders", json={"orderId": "A-7", "createdAt": "2026-11-30T00:00:00Z",
                                               "status": "open"}, timeout=10)
    assert r.status_code == 201, r.text  # the service saw only legacy fields (it asserts so)
    assert r.json() == {"orderId": "A-7", "createdAt": "2026-11-30T00:00:00Z", "status": "closed"}
    bad = httpx.post(f"{stack.url}/orders", json={"orderId": "A-8", "createdAt": "yesterday", "status": "open"},
                     timeout=10)
    assert bad.status_code == 400 and "createdAt" in bad.text
