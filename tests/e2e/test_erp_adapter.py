"""The ERP action adapter end to end: examples/erp-adapter.yaml (its BPMN file, examples/erp/order-to-cash.bpmn)
through the real Envoy and processor, a tool-calling chat server as the model (tests/e2e/chat_tools_service.py:
the first offered tool, or the call a `CALL name {args}` line asks for) and the test ERP service
(tests/e2e/erp_service.py, a real HTTP server with an in-memory order store): an order taken from receipt
to closing, the tools offered being exactly the enabled service tasks at each step, and the refusals (an
action not enabled now, bad arguments, the service's own refusal and 5xx, an instance waiting for a person)
as errors in the route's dialect, with the order and its instance unchanged."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from extproc.stack import free_port, stop_process, wait_http
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
ROUTE = "/v1/erp/order-to-cash"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.e2e.conftest import make_stack

    d = tmp_path_factory.mktemp("erp")
    (d / "erp").mkdir()
    shutil.copy(REPO / "examples" / "erp" / "order-to-cash.bpmn", d / "erp" / "order-to-cash.bpmn")
    chat_port, erp_port = free_port(), free_port()
    text = (REPO / "examples" / "erp-adapter.yaml").read_text()
    model = '      kind: vllm\n      endpoints: ["vllm-tools:8000"]\n'
    assert model in text and "http://127.0.0.1:8081" in text
    text = text.replace(model, f'      kind: openai\n      endpoints: ["127.0.0.1:{chat_port}"]\n'
                               "      dialect: {negotiate: false, preset: openai}\n")
    (d / "gateway.yaml").write_text(text.replace("http://127.0.0.1:8081", f"http://127.0.0.1:{erp_port}"))
    chat = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "chat_tools_service.py"), str(chat_port)])
    erp = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "erp_service.py"), str(erp_port)])
    st = make_stack(d / "gateway.yaml")
    try:
        wait_http(f"http://127.0.0.1:{chat_port}/health", 20, chat)
        wait_http(f"http://127.0.0.1:{erp_port}/health", 20, erp)
        st.start()
        st.chat_url, st.erp_url = f"http://127.0.0.1:{chat_port}", f"http://127.0.0.1:{erp_port}"
        yield st
    finally:
        st.stop()
        stop_process(chat)
        stop_process(erp)


def new_order(stack, **fields) -> str:
    r = httpx.post(f"{stack.erp_url}/orders", json=fields, timeout=5)
    r.raise_for_status()
    return r.json()["id"]


def say(stack, oid: str, message: str) -> httpx.Response:
    return httpx.post(f"{stack.url}{ROUTE}", json={"instance": oid, "message": message}, timeout=10)


def offered(stack) -> list[str]:
    """The tool names the model was offered in the gateway's last chat request."""
    last = httpx.get(f"{stack.chat_url}/requests", timeout=5).json()[-1]
    return [t["function"]["name"] for t in last["tools"]]


def erp_state(stack, oid: str) -> tuple[dict, dict]:
    return (httpx.get(f"{stack.erp_url}/orders/{oid}", timeout=5).json(),
            httpx.get(f"{stack.erp_url}/instances/{oid}", timeout=5).json())


def test_an_order_from_receipt_to_close(stack):
    oid = new_order(stack, amount=300)
    r = say(stack, oid, "A new order came in.")  # the model takes the first (only) offered tool
    assert r.status_code == 200, r.text
    assert offered(stack) == ["check_credit"] and r.headers["x-adapter-erp-action"] == "check_credit"
    doc = r.json()
    assert doc["result"]["body"] == {"approved": True, "limit": 1000}
    assert doc["position"] == ["Gateway_Credit"] and doc["enabled"] == ["reserve_stock", "reject_order"]

    r = say(stack, oid, 'Credit is fine.\nCALL reserve_stock {"warehouse": "north", "quantity": 3}')
    assert r.status_code == 200, r.text
    assert offered(stack) == ["reserve_stock", "reject_order"]
    assert sorted(r.json()["enabled"]) == ["create_invoice", "ship_order"]

    r = say(stack, oid, 'CALL create_invoice {"due_days": 30}')
    assert r.status_code == 200 and r.json()["result"]["body"]["number"] == f"INV-{oid}", r.text
    r = say(stack, oid, 'CALL ship_order {"carrier": "dhl"}')
    assert r.status_code == 200, r.text
    assert offered(stack) == ["ship_order"]  # the invoice branch waits at the join
    assert r.json()["position"] == ["Task_ConfirmPayment"] and r.json()["enabled"] == []

    # a person confirms the payment (a user task: not the model's), then the model can close the order
    r = say(stack, oid, "Is it paid?")
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "no_enabled_action" and err["waiting_for"] == [
        "Confirm payment received (Task_ConfirmPayment, userTask)"]
    _, inst = erp_state(stack, oid)
    httpx.post(f"{stack.erp_url}/instances/{oid}/advance", timeout=5, json={
        "version": inst["version"], "task": "Task_ConfirmPayment", "position": ["Task_CloseOrder"]}).raise_for_status()
    r = say(stack, oid, "Payment arrived.")
    assert r.status_code == 200 and r.json()["action"] == "close_order" and r.json()["ended"] is True, r.text
    order, inst = erp_state(stack, oid)
    assert order["status"] == "closed" and order["shipment"]["carrier"] == "dhl"
    assert inst["position"] == [] and inst["history"] == ["Task_CheckCredit", "Task_ReserveStock",
                                                          "Task_CreateInvoice", "Task_ShipOrder",
                                                          "Task_ConfirmPayment", "Task_CloseOrder"]


def test_an_action_not_enabled_now_is_a_409_naming_the_state_and_the_enabled_actions(stack):
    oid = new_order(stack)
    r = say(stack, oid, 'CALL ship_order {"carrier": "ups"}')  # the model names a task of a later state
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert (err["code"], err["action"], err["position"], err["enabled"]) == (
        "action_not_enabled", "ship_order", ["Task_CheckCredit"], ["check_credit"])
    assert err["route"] == "v1-erp-order-to-cash" and err["request_id"]
    order, inst = erp_state(stack, oid)
    assert order["status"] == "received" and inst["version"] == 0  # nothing ran


@pytest.mark.parametrize("args, pointers", [
    ({"warehouse": "attic", "quantity": 3}, ["/warehouse"]),
    ({"quantity": "3", "extra": 1}, ["/extra", "/quantity", "/warehouse"]),
])
def test_arguments_that_break_the_actions_schema_are_a_422_naming_the_fields(stack, args, pointers):
    oid = new_order(stack)
    assert say(stack, oid, "check").status_code == 200
    r = say(stack, oid, f"CALL reserve_stock {json.dumps(args)}")
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_action_arguments" and sorted({e["pointer"] for e in err["errors"]}) == pointers
    order, inst = erp_state(stack, oid)
    assert "reservation" not in order and inst["position"] == ["Gateway_Credit"]


def test_the_services_refusal_and_its_5xx(stack):
    oid = new_order(stack, amount=9000)  # over the credit limit: the service refuses to reserve
    assert say(stack, oid, "check").json()["result"]["body"]["approved"] is False
    r = say(stack, oid, 'CALL reserve_stock {"warehouse": "south", "quantity": 1}')
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "erp_action_refused" and err["service_status"] == 409
    assert err["detail"] == {"error": "credit not approved for this order"}
    r = say(stack, oid, 'CALL reject_order {"reason": "credit limit exceeded"}')
    assert r.status_code == 200 and r.json()["ended"] is True, r.text
    assert erp_state(stack, oid)[0]["status"] == "rejected"

    oid = new_order(stack, fail_close=True, position=["Task_CloseOrder"])
    r = say(stack, oid, "close it")
    assert r.status_code == 502 and r.json()["error"]["code"] == "erp_unavailable", r.text
    assert "secret" not in r.text and "Traceback" not in r.text
    assert erp_state(stack, oid)[1]["version"] == 0


def test_an_unknown_instance_is_a_404(stack):
    r = say(stack, "SO-missing", "hello")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_instance", r.text
