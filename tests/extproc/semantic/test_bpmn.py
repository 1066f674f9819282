"""BPMN process files (extproc/semantic/bpmn.py): the example order-to-cash file parsed, what is enabled at each
position (exclusive choices, parallel splits and joins, user tasks, the end), advancing, unsafe or broken
files refused naming the file and element, and the route config's operations mapped to tools with load
errors naming the field."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_file
from extproc.semantic.bpmn import BpmnError, advance, enabled, initial_position, normalize, parse_bpmn
from tests.extproc.erp_gateway import EXAMPLE, erp_route, write_erp_gateway

NS = 'xmlns="http://www.omg.org/spec/BPMN/20100524/MODEL"'


@pytest.fixture(scope="module")
def o2c():
    return parse_bpmn(EXAMPLE.read_bytes(), "order-to-cash.bpmn")


def doc(body: str, extra: str = "") -> bytes:
    return f'<?xml version="1.0"?>{extra}<definitions {NS}><process id="P" isExecutable="true">{body}</process>' \
           f'</definitions>'.encode()


def test_the_example_file_parses_into_nodes_and_flows(o2c):
    assert o2c.id == "Process_OrderToCash" and o2c.name == "Order to cash"
    assert o2c.starts == ("StartEvent_OrderReceived",)
    assert [n.id for n in o2c.service_tasks()] == ["Task_CheckCredit", "Task_RejectOrder", "Task_ReserveStock",
                                                   "Task_ShipOrder", "Task_CreateInvoice", "Task_CloseOrder"]
    assert o2c.nodes["Task_ReviewCredit"].kind == "userTask"
    assert o2c.flows["Flow_Approved"].condition == "${credit.approved}"
    assert o2c.nodes["Task_ReserveStock"].incoming == ("Flow_Approved", "Flow_Reviewed")


def test_a_walk_through_order_to_cash(o2c):
    pos = initial_position(o2c)
    assert pos == ("Task_CheckCredit",)
    assert list(enabled(o2c, pos).tasks) == ["Task_CheckCredit"]
    pos = advance(o2c, pos, "Task_CheckCredit")
    assert pos == ("Gateway_Credit",)  # the exclusive choice is open: the action taken decides it
    now = enabled(o2c, pos)
    assert list(now.tasks) == ["Task_ReserveStock", "Task_RejectOrder"]  # the user-task branch is a person's
    assert now.branch_text == {"Task_ReserveStock": "credit approved", "Task_RejectOrder": "credit refused"}
    pos = advance(o2c, pos, "Task_ReserveStock")
    assert sorted(pos) == ["Task_CreateInvoice", "Task_ShipOrder"]  # the parallel split: one token per branch
    assert set(enabled(o2c, pos).tasks) == {"Task_CreateInvoice", "Task_ShipOrder"}
    pos = advance(o2c, pos, "Task_CreateInvoice")
    now = enabled(o2c, pos)
    assert list(now.tasks) == ["Task_ShipOrder"] and now.waiting == ("Gateway_Fulfilled",)  # the join waits
    pos = advance(o2c, pos, "Task_ShipOrder")
    assert pos == ("Task_ConfirmPayment",)  # the join fired; a person confirms the payment
    now = enabled(o2c, pos)
    assert not now.tasks and now.waiting == ("Task_ConfirmPayment",)
    assert advance(o2c, ("Task_CloseOrder",), "Task_CloseOrder") == ()  # the end event: no token left


def test_the_rejected_branch_ends_the_instance(o2c):
    assert advance(o2c, ("Gateway_Credit",), "Task_RejectOrder") == ()  # ran, then the end event
    now = enabled(o2c, ())
    assert not now.tasks and not now.waiting


def test_a_task_not_enabled_cannot_advance_and_unknown_positions_are_named(o2c):
    with pytest.raises(BpmnError, match="Task_ShipOrder.*not enabled at the instance's position Task_CheckCredit"):
        advance(o2c, ("Task_CheckCredit",), "Task_ShipOrder")
    with pytest.raises(BpmnError, match="'Nope'.*not in process 'Process_OrderToCash'"):
        normalize(o2c, ["Nope"])


def test_a_parallel_split_reached_through_a_choice_gives_the_other_branches_tokens():
    p = parse_bpmn(doc("""
      <startEvent id="s"/><sequenceFlow id="f0" sourceRef="s" targetRef="x"/>
      <exclusiveGateway id="x"/><sequenceFlow id="f1" sourceRef="x" targetRef="par"/>
      <sequenceFlow id="f2" sourceRef="x" targetRef="c"/>
      <parallelGateway id="par"/><sequenceFlow id="f3" sourceRef="par" targetRef="a"/>
      <sequenceFlow id="f4" sourceRef="par" targetRef="u"/>
      <serviceTask id="a"/><userTask id="u"/><serviceTask id="c"/>"""), "t.bpmn")
    assert initial_position(p) == ("x",)
    assert list(enabled(p, ("x",)).tasks) == ["a", "c"]
    assert advance(p, ("x",), "a") == ("u",)  # a's branch ended (no outgoing flow); u got the split's token


@pytest.mark.parametrize("data, element, reason", [
    (b"<definitions", None, "not well-formed"),
    (b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x "y">]><definitions ' + NS.encode() + b"/>", None,
     "unsafe XML"),
    (b'<definitions xmlns="urn:other"><process id="P"/></definitions>', None, "BPMN 2.0"),
    (doc('<startEvent id="s"/><serviceTask id="t"/><sequenceFlow id="f" sourceRef="s" targetRef="gone"/>'), "f",
     "refers to 'gone'"),
    (doc('<serviceTask id="t"/>'), "P", "no start event"),
    (doc('<startEvent id="s"/><serviceTask id="t"/>'), "t", "unreachable"),
    (doc('<startEvent id="s"/><scriptTask id="run"/><sequenceFlow id="f" sourceRef="s" targetRef="run"/>'), "run",
     "runs code"),
    (doc('<startEvent id="s"/><serviceTask id="s"/>'), "s", "duplicate id"),
    (doc('<startEvent id="s"/><exclusiveGateway id="a"/><exclusiveGateway id="b"/>'
         '<sequenceFlow id="f0" sourceRef="s" targetRef="a"/><sequenceFlow id="f1" sourceRef="a" targetRef="b"/>'
         '<sequenceFlow id="f2" sourceRef="b" targetRef="a"/>'), "a", "loop of gateways"),
])
def test_bad_files_are_refused_naming_the_element_and_why(data, element, reason):
    with pytest.raises(BpmnError) as e:
        parse_bpmn(data, "bad.bpmn")
    assert e.value.element == element and reason in str(e.value) and str(e.value).startswith("bad.bpmn")


def test_a_billion_laughs_file_is_refused_not_expanded():
    bomb = (b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;">]>'
            b"<definitions " + NS.encode() + b"><process id='P'><documentation>&lol2;</documentation></process>"
            b"</definitions>")
    with pytest.raises(BpmnError, match="unsafe XML"):
        parse_bpmn(bomb, "bomb.bpmn")


def test_the_process_is_chosen_by_id_when_there_are_several():
    two = f'<definitions {NS}><process id="A"><startEvent id="s"/></process>' \
          f'<process id="B"><startEvent id="t"/></process></definitions>'.encode()
    with pytest.raises(BpmnError, match="2 executable processes .*processId"):
        parse_bpmn(two, "two.bpmn")
    assert parse_bpmn(two, "two.bpmn", "B").starts == ("t",)
    with pytest.raises(BpmnError, match="no <process> with this id; the file has 'A', 'B'"):
        parse_bpmn(two, "two.bpmn", "C")


def gateway(tmp_path, operations: str, timeout: str = "300ms"):
    """g.yaml in `tmp_path`: the one erp route /erp with `operations` (lines), beside o2c.bpmn."""
    return write_erp_gateway(tmp_path, erp_route("/erp", "http://127.0.0.1:9002", operations, timeout=timeout))


def lines(ops: dict) -> str:
    return "\n".join(f"          {k}: {v}" for k, v in ops.items())


GOOD = {
    "Task_CheckCredit": "{path: '/orders/{instance}/credit-check'}",
    "Task_ReserveStock": "{path: '/orders/{instance}/reservations/{warehouse}', parameters: {type: object, "
                         "properties: {warehouse: {type: string}, quantity: {type: integer}}, "
                         "required: [warehouse, quantity]}}",
    "Task_RejectOrder": "{method: DELETE, path: '/orders/{instance}', parameters: {type: object, "
                        "properties: {reason: {type: string}}}}",
    "Task_ShipOrder": "{path: '/orders/{instance}/shipments'}",
    "Task_CreateInvoice": "{path: '/orders/{instance}/invoices'}",
    "Task_CloseOrder": "{path: '/orders/{instance}/close', tool: finish}",
}


def load(tmp_path, ops: dict):
    return load_file(gateway(tmp_path, lines(ops)))


def test_operations_become_tools_built_like_tool_routes(tmp_path):
    from extproc.semantic.toolcall import build_request

    erp = load(tmp_path, GOOD).routes["erp"].erp
    assert dict(erp.task_of) == {"check_credit": "Task_CheckCredit", "reserve_stock": "Task_ReserveStock",
                                 "reject_order": "Task_RejectOrder", "ship_order": "Task_ShipOrder",
                                 "create_invoice": "Task_CreateInvoice", "finish": "Task_CloseOrder"}
    reserve = erp.tools["Task_ReserveStock"]
    assert reserve.description == "Reserve stock. Reserve the ordered quantity in a warehouse."
    req = build_request(reserve, {"warehouse": "north 1", "quantity": 2, "instance": "SO/1"})
    assert (req.method, req.target, req.body) == ("POST", "/orders/SO%2F1/reservations/north%201",
                                                  b'{"quantity":2}')
    req = build_request(erp.tools["Task_RejectOrder"], {"reason": "no stock", "instance": "SO-1"})
    assert (req.method, req.target, req.body) == ("DELETE", "/orders/SO-1?reason=no%20stock", None)


@pytest.mark.parametrize("change, where, reason", [
    ({"Task_ShipOrder": None}, "routes[0].erp.operations", "service task Ship order (Task_ShipOrder, serviceTask) "
                                                             "of o2c.bpmn has no operation"),
    ({"Task_ReviewCredit": "{path: /x}"}, "routes[0].erp.operations.Task_ReviewCredit",
     "'Task_ReviewCredit' is a userTask of process 'Process_OrderToCash'"),
    ({"Task_CheckCredit": "{path: '/o/{instance}/{who}'}"}, "routes[0].erp.operations.Task_CheckCredit.path",
     "placeholder {who} needs a required property"),
    ({"Task_CheckCredit": "{path: /o, parameters: {type: array}}"},
     "routes[0].erp.operations.Task_CheckCredit.parameters.type", "an object schema"),
    ({"Task_CheckCredit": "{path: /o, parameters: {type: object, properties: {n: {type: 7}}}}"},
     "routes[0].erp.operations.Task_CheckCredit.parameters", "not a valid JSON Schema"),
    ({"Task_CheckCredit": "{path: /o, parameters: {properties: {instance: {type: string}}}}"},
     "routes[0].erp.operations.Task_CheckCredit.parameters.properties.instance", "the client's instance id"),
    ({"Task_CheckCredit": "{path: /o, tool: finish}"}, "routes[0].erp.operations.Task_CloseOrder.tool",
     "also service task 'Task_CheckCredit'"),
])
def test_bad_operations_are_load_errors_naming_the_field(tmp_path, change, where, reason):
    ops = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        load(tmp_path, ops)
    assert where in str(e.value) and reason in str(e.value), str(e.value)


def test_a_broken_bpmn_file_is_a_load_error_naming_the_file_and_element(tmp_path):
    gateway(tmp_path, "          Task_CheckCredit: {path: /x}")
    text = EXAMPLE.read_text().replace('targetRef="Task_ShipOrder"', 'targetRef="Task_Ship"')
    (tmp_path / "o2c.bpmn").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_file(tmp_path / "g.yaml")
    assert "routes[0].erp.process" in str(e.value) and "o2c.bpmn, element 'Flow_4': the sequence flow refers to " \
           "'Task_Ship'" in str(e.value)
    (tmp_path / "o2c.bpmn").unlink()
    with pytest.raises(ConfigError, match="cannot read the BPMN file"):
        load_file(tmp_path / "g.yaml")


def test_the_erp_calls_must_fit_in_one_processor_message(tmp_path):
    gateway(tmp_path, lines(GOOD), timeout="600ms")
    with pytest.raises(ConfigError, match=r"routes\[0\]\.erp\.timeout.*twice it must stay below"):
        load_file(tmp_path / "g.yaml")
