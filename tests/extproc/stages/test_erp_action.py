"""Stage `erp-action` on a compiled erp route (examples/erp/order-to-cash.bpmn) against the real test ERP
service (tests/e2e/erp_service.py, in a thread on a free port): the chat request it builds (exactly the
enabled service tasks as tools), refusals before the model is asked, the model's action checked against
the instance's position and the action's schema, run on the service and the instance advanced, and each
refusal's answer (409 naming the position and the enabled actions, 422, 502) with the ERP data unchanged."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from extproc.config.loader import load_file
from extproc.stack import free_port
from extproc.stages.erp_action import ErpAction
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState
from tests.e2e.erp_service import serve
from tests.extproc.erp_gateway import erp_route, write_erp_gateway

OPERATIONS = """\
          Task_CheckCredit: {path: '/orders/{instance}/credit-check'}
          Task_ReserveStock:
            path: '/orders/{instance}/reservations'
            parameters:
              type: object
              properties: {warehouse: {type: string, enum: [north, south]}, quantity: {type: integer, minimum: 1}}
              required: [warehouse, quantity]
              additionalProperties: false
          Task_RejectOrder: {path: '/orders/{instance}/rejection'}
          Task_ShipOrder: {path: '/orders/{instance}/shipments'}
          Task_CreateInvoice: {path: '/orders/{instance}/invoices'}
          Task_CloseOrder: {path: '/orders/{instance}/close'}"""
BRIEF_OPERATIONS = """\
          Task_CheckCredit: {path: '/orders/{instance}/credit-check'}
          Task_ReserveStock: {path: '/orders/{instance}/reservations'}
          Task_RejectOrder: {path: '/orders/{instance}/rejection'}
          Task_ShipOrder: {path: '/orders/{instance}/shipments'}
          Task_CreateInvoice: {path: '/orders/{instance}/invoices'}
          Task_CloseOrder: {path: '/orders/{instance}/close'}"""


def gateway(folder, port: int):
    """g.yaml in `folder` (beside o2c.bpmn): the erp routes /erp and /erp-brief, the ERP service on `port`."""
    service = f"http://127.0.0.1:{port}"
    return write_erp_gateway(
        folder, erp_route("/erp", service, OPERATIONS, extra="      policy: {maxBodyBytes: 300}\n"),
        erp_route("/erp-brief", service, BRIEF_OPERATIONS, extra="      transform: '{\"order\": $.instance, \"did\": "
                  "$.action, \"next\": $.enabled, \"asked\": $.input.message}'\n"))


@pytest.fixture(scope="module")
def erp():
    port = free_port()
    server = serve(port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{port}"
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def snap(tmp_path_factory, erp):
    d = tmp_path_factory.mktemp("erp")
    return load_file(gateway(d, erp.server_port))


def order(erp, **fields) -> str:
    r = httpx.post(f"{erp.url}/orders", json=fields, timeout=5)
    r.raise_for_status()
    return r.json()["id"]


def instance(erp, oid: str) -> dict:
    return httpx.get(f"{erp.url}/instances/{oid}", timeout=5).json()


def calls(erp, oid: str) -> list:
    return [c for c in httpx.get(f"{erp.url}/calls", timeout=5).json() if f"/{oid}/" in c["path"]]


def state(snap, route="erp") -> RequestState:
    return RequestState(snapshot=snap, route=snap.routes[route], started=0.0, request_id="req-1")


def tool_call(name: str, args) -> bytes:
    return orjson.dumps({"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": name, "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()}}]}}],
        "usage": {"prompt_tokens": 80, "completion_tokens": 12}})


async def ask(stage, st, doc) -> Mutate | Reject:
    body = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return await stage.on_request_body(st, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True))


async def respond(stage, st, body: bytes, status: int = 200, details: str | None = "via_upstream"):
    st.response_status, st.response_details = status, details
    head = stage.on_response_headers(st, HttpMessage(Phase.RESPONSE_HEADERS, headers={":status": str(status)}))
    if head is not None:
        return head
    return await stage.on_response_body(st, HttpMessage(Phase.RESPONSE_BODY, body=body, end_of_stream=True))


async def act(snap, erp, oid, name, args, route="erp", message="go"):
    stage, st = ErpAction(), state(snap, route)
    v = await ask(stage, st, {"instance": oid, "message": message})
    assert isinstance(v, Mutate), v
    return await respond(stage, st, tool_call(name, args)), v


async def test_the_request_offers_exactly_the_enabled_service_tasks(snap, erp):
    oid = order(erp)
    stage, st = ErpAction(), state(snap)
    v = await ask(stage, st, {"instance": oid, "message": "New order from acme"})
    assert isinstance(v, Mutate)
    headers = dict(v.set_headers)
    assert headers[":path"] == "/v1/chat/completions" and headers["content-length"] == str(len(v.body))
    chat = orjson.loads(v.body)
    assert [t["function"]["name"] for t in chat["tools"]] == ["check_credit"]
    assert chat["tool_choice"] == "required" and chat["temperature"] == 0 and chat["model"] == "m"
    system, user = chat["messages"]
    assert "Check credit (Task_CheckCredit, serviceTask)" in system["content"]
    assert user == {"role": "user", "content": "New order from acme"}
    assert st.request.model == "m" and st.backend_request == v.body
    # after the credit check the exclusive gateway's branches: both service tasks, their branch named
    await respond(stage, st, tool_call("check_credit", {}))
    stage, st = ErpAction(), state(snap)
    chat = orjson.loads((await ask(stage, st, {"instance": oid})).body)
    tools = {t["function"]["name"]: t["function"] for t in chat["tools"]}
    assert set(tools) == {"reserve_stock", "reject_order"}
    assert tools["reserve_stock"]["description"].endswith("(the process branch: credit approved)")
    assert tools["reserve_stock"]["parameters"]["required"] == ["warehouse", "quantity"]


async def test_an_action_runs_on_the_erp_service_and_advances_the_instance(snap, erp):
    oid = order(erp, amount=200)
    out, _ = await act(snap, erp, oid, "check_credit", {})
    assert isinstance(out, Mutate) and dict(out.set_headers)[":status"] == "200"
    assert dict(out.set_headers)["x-adapter-erp-action"] == "check_credit"
    doc = orjson.loads(out.body)
    assert doc == {"instance": oid, "action": "check_credit", "task": "Task_CheckCredit", "arguments": {},
                   "result": {"status": 200, "ok": True, "content_type": "application/json",
                              "body": {"approved": True, "limit": 1000}},
                   "position": ["Gateway_Credit"], "enabled": ["reserve_stock", "reject_order"], "ended": False}
    assert instance(erp, oid) == {"position": ["Gateway_Credit"], "version": 1, "history": ["Task_CheckCredit"]}
    out, _ = await act(snap, erp, oid, "reserve_stock", {"warehouse": "north", "quantity": 3})
    doc = orjson.loads(out.body)
    assert doc["result"]["status"] == 201 and doc["result"]["body"] == {"warehouse": "north", "quantity": 3}
    assert sorted(doc["position"]) == ["Task_CreateInvoice", "Task_ShipOrder"]
    assert calls(erp, oid)[-1] == {"method": "POST", "path": f"/orders/{oid}/reservations",
                                   "body": {"warehouse": "north", "quantity": 3}}


async def test_an_action_not_enabled_now_is_409_naming_the_position_and_the_enabled_actions(snap, erp):
    oid = order(erp)
    out, _ = await act(snap, erp, oid, "ship_order", {})
    assert isinstance(out, Reject) and (out.status, out.code) == (409, "action_not_enabled")
    assert out.fields["position"] == ["Task_CheckCredit"] and out.fields["enabled"] == ["check_credit"]
    assert out.fields["action"] == "ship_order" and "Ship order (Task_ShipOrder, serviceTask)" in out.message
    assert calls(erp, oid) == [] and instance(erp, oid)["version"] == 0  # nothing ran, nothing moved


@pytest.mark.parametrize("name, args, status, code", [
    ("delete_everything", {}, 422, "unknown_action"),
    ("reserve_stock", {"warehouse": "attic", "quantity": 0}, 422, "invalid_action_arguments"),
    ("reserve_stock", '{"warehouse": ', 422, "malformed_action"),
])
async def test_the_models_bad_choices_are_refused_and_nothing_runs(snap, erp, name, args, status, code):
    oid = order(erp)
    await act(snap, erp, oid, "check_credit", {})
    before = instance(erp, oid)
    out, _ = await act(snap, erp, oid, name, args)
    assert isinstance(out, Reject) and (out.status, out.code) == (status, code), out
    assert out.fields["enabled"] == ["reserve_stock", "reject_order"] and out.fields["instance"] == oid
    if code == "invalid_action_arguments":
        assert [e["pointer"] for e in out.fields["errors"]] == ["/quantity", "/warehouse"]
    assert instance(erp, oid) == before and len(calls(erp, oid)) == 1  # only the credit check ran


async def test_the_services_own_refusal_is_422_with_its_answer_and_the_instance_stays(snap, erp):
    oid = order(erp, amount=5000)  # over the limit: the service refuses the reservation
    await act(snap, erp, oid, "check_credit", {})
    out, _ = await act(snap, erp, oid, "reserve_stock", {"warehouse": "south", "quantity": 1})
    assert isinstance(out, Reject) and (out.status, out.code) == (422, "erp_action_refused")
    assert out.fields["service_status"] == 409
    assert out.fields["detail"] == {"error": "credit not approved for this order"}
    assert instance(erp, oid)["position"] == ["Gateway_Credit"]
    out, _ = await act(snap, erp, oid, "reject_order", {"reason": "credit refused"})
    doc = orjson.loads(out.body)
    assert doc["ended"] is True and doc["position"] == [] and doc["enabled"] == []


async def test_a_service_5xx_is_502_without_its_body(snap, erp):
    oid = order(erp, fail_close=True, position=["Task_CloseOrder"])
    out, _ = await act(snap, erp, oid, "close_order", {})
    assert isinstance(out, Reject) and (out.status, out.code) == (502, "erp_unavailable")
    assert "secret" not in orjson.dumps(out.fields).decode() + out.message and "req-1" in out.message
    assert instance(erp, oid)["version"] == 0


async def test_an_instance_moved_meanwhile_is_409_instance_changed(snap, erp):
    oid = order(erp)
    stage, st = ErpAction(), state(snap)
    assert isinstance(await ask(stage, st, {"instance": oid}), Mutate)
    httpx.post(f"{erp.url}/instances/{oid}/advance", json={"version": 0, "task": "x", "position": ["Task_CheckCredit"]},
               timeout=5).raise_for_status()  # someone else moved it while the model thought
    out = await respond(stage, st, tool_call("check_credit", {}))
    assert isinstance(out, Reject) and (out.status, out.code) == (409, "instance_changed")
    assert out.fields["result"]["status"] == 200  # the action ran: its result is reported


async def test_an_instance_waiting_for_a_person_is_409_before_the_model_is_asked(snap, erp):
    oid = order(erp, position=["Task_ConfirmPayment"])
    v = await ask(ErpAction(), state(snap), {"instance": oid})
    assert isinstance(v, Reject) and (v.status, v.code) == (409, "no_enabled_action")
    assert v.fields["waiting_for"] == ["Confirm payment received (Task_ConfirmPayment, userTask)"]
    assert v.fields["enabled"] == [] and v.fields["position"] == ["Task_ConfirmPayment"]


@pytest.mark.parametrize("body, status, code", [
    (b'{"instance": ', 400, "malformed_json"),
    (b'{"message": "x"}', 400, "missing_instance"),
    (b'{"instance": "a/b"}', 400, "missing_instance"),
    (b'{"instance": "SO-1", "message": 3}', 400, "invalid_message"),
    (b'{"instance": "SO-nope"}', 404, "unknown_instance"),
    (b'{"instance": "SO-1", "message": "' + b"x" * 400 + b'"}', 413, "body_too_large"),
])
async def test_bad_requests_are_refused_before_the_model(snap, erp, body, status, code):
    v = await ask(ErpAction(), state(snap), body)
    assert isinstance(v, Reject) and (v.status, v.code) == (status, code)


async def test_an_unknown_position_or_an_unreachable_service_is_502(snap, erp, tmp_path):
    oid = order(erp, position=["Task_Gone"])
    v = await ask(ErpAction(), state(snap), {"instance": oid})
    assert isinstance(v, Reject) and (v.status, v.code) == (502, "erp_bad_state") and "Task_Gone" in v.message
    down = load_file(gateway(tmp_path, free_port()))
    v = await ask(ErpAction(), state(down), {"instance": "SO-1"})
    assert isinstance(v, Reject) and (v.status, v.code) == (502, "erp_unavailable")


async def test_no_tool_call_and_backend_errors(snap, erp):
    oid = order(erp)
    stage, st = ErpAction(), state(snap)
    await ask(stage, st, {"instance": oid})
    text = orjson.dumps({"choices": [{"message": {"role": "assistant", "content": "I would check credit."}}]})
    out = await respond(stage, st, text)
    assert isinstance(out, Reject) and (out.status, out.code) == (422, "no_action_chosen")
    assert out.fields["model_text"] == "I would check credit."
    stage, st = ErpAction(), state(snap)
    await ask(stage, st, {"instance": oid})
    out = await respond(stage, st, b'{"error": "/srv/model internals"}', status=500)
    assert isinstance(out, Reject) and (out.status, out.code) == (502, "backend_error")
    assert "internals" not in out.message
    stage, st = ErpAction(), state(snap)
    await ask(stage, st, {"instance": oid})
    assert await respond(stage, st, b"upstream connect error", status=503, details="upstream_reset") == \
        Mutate(skip_body=True)  # Envoy's own reply: as it is
    assert calls(erp, oid) == []


async def test_the_route_transform_shapes_the_answer(snap, erp):
    oid = order(erp)
    out, _ = await act(snap, erp, oid, "check_credit", {}, route="erp-brief", message="check it")
    assert orjson.loads(out.body) == {"order": oid, "did": "check_credit", "next": ["reserve_stock", "reject_order"],
                                      "asked": "check it"}
