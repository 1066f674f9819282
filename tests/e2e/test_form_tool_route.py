"""Form and multipart tool calls end to end: through Envoy and the processor to a real server.

The service is aiohttp (tests/form_echo.py) answering with what its own parsers read from the
body Envoy forwarded: the uspto search (the OAI example, a urlencoded body) and an upload operation
(multipart: a text field, an array, a base64 binary argument sent as bytes with its part type).
An operation with callbacks is callable through the same route.
"""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import pytest

from tests.conftest import REPO
from tests.form_echo import EchoServer

pytestmark = pytest.mark.e2e

UPLOAD = """\
openapi: 3.0.3
info: {title: uploads, version: "1"}
paths:
  /files:
    post:
      operationId: upload
      requestBody:
        required: true
        content:
          multipart/form-data:
            schema:
              type: object
              required: [file]
              properties:
                note: {type: string}
                tags: {type: array, items: {type: string}}
                file: {type: string, format: binary}
            encoding:
              file: {contentType: image/png}
      responses: {"200": {description: ok}}
  /streams:
    post:
      operationId: subscribe
      parameters: [{name: callbackUrl, in: query, required: true, schema: {type: string}}]
      responses: {"201": {description: ok}}
      callbacks:
        onData:
          "{$request.query.callbackUrl}/data":
            post: {responses: {"202": {description: ok}}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.e2e.conftest import make_stack

    echo = EchoServer()
    echo.start()
    d = tmp_path_factory.mktemp("forms")
    shutil.copy(REPO / "tests" / "fixtures" / "openapi" / "v3.0" / "uspto.yaml", d / "uspto.yaml")
    (d / "upload.yaml").write_text(UPLOAD)
    cfg = d / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: forms}}
spec:
  backends: [{{name: echo, kind: rest, endpoints: ["127.0.0.1:{echo.port}"]}}]
  routes:
    - {{path: /tools/uspto, kind: tool, target: echo, openapi: uspto.yaml}}
    - {{path: /tools/upload, kind: tool, target: echo, openapi: upload.yaml}}
""")
    st = make_stack(cfg)
    try:
        st.start()
        yield st
    finally:
        st.stop()
        echo.stop()


def body_of(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    assert r.headers["x-adapter-tool-status"] in ("200", "201"), r.text
    return json.loads(r.json()["content"])["body"]


def test_a_urlencoded_tool_call_reaches_the_service_as_a_form(stack):
    r = httpx.post(f"{stack.url}/tools/uspto", timeout=10, json={
        "type": "tool_use", "id": "t1", "name": "perform-search",
        "input": {"dataset": "oa_citations", "version": "v1", "criteria": "title:\"a & b\" 中", "rows": 5}})
    echo = body_of(r)
    assert echo["path"] == "/ds-api/oa_citations/v1/records"
    assert echo["content_type"] == "application/x-www-form-urlencoded"
    assert echo["fields"] == [["criteria", "title:\"a & b\" 中"], ["rows", "5"]]


def test_a_multipart_tool_call_reaches_the_service_with_its_parts(stack):
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
    r = httpx.post(f"{stack.url}/tools/upload", timeout=10, json={
        "id": "c1", "type": "function", "function": {"name": "upload", "arguments": json.dumps(
            {"note": "héllo", "tags": ["a", "b"], "file": base64.b64encode(png).decode()})}})
    echo = body_of(r)
    assert echo["content_type"].startswith("multipart/form-data; boundary=")
    got = [(p["name"], p["filename"], p["content_type"], base64.b64decode(p["data"])) for p in echo["parts"]]
    assert got == [("note", None, "text/plain; charset=utf-8", "héllo".encode()),
                   ("tags", None, "text/plain; charset=utf-8", b"a"),
                   ("tags", None, "text/plain; charset=utf-8", b"b"),
                   ("file", "file", "image/png", png)]


def test_bad_base64_is_a_400_naming_the_field(stack):
    r = httpx.post(f"{stack.url}/tools/upload", timeout=10,
                   json={"name": "upload", "arguments": {"file": "not base64"}})
    assert r.status_code == 400 and [e["pointer"] for e in r.json()["error"]["errors"]] == ["/file"]


def test_an_operation_with_callbacks_is_callable(stack):
    r = httpx.post(f"{stack.url}/tools/upload", timeout=10,
                   json={"type": "tool_use", "id": "t2", "name": "subscribe",
                         "input": {"callbackUrl": "https://me.example/cb"}})
    echo = body_of(r)
    assert echo["path"] == "/streams?callbackUrl=https%3A%2F%2Fme.example%2Fcb"
