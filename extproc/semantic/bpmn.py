"""BPMN 2.0 process files: parsed once at config load, then which service tasks an instance may run now.

What: `parse_bpmn(data, source)` reads a BPMN 2.0 XML file with `defusedxml` (no entities, no DTD,
no external references: the file is untrusted input; nothing in it is evaluated or executed) into
an immutable `Process`: flow nodes by id, sequence flows, each service task's name and
documentation. `compile_process` checks it (every flow joins known nodes, a start event exists,
no loop made only of gateways, no script or business-rule task: their code is not run here).

**Instance state** is a *position*: the ids of the elements where the instance's tokens wait, one
per token (a multiset: a parallel join waiting for two branches holds two). A token waits at an
activity not yet done (a service task: the model may run it; a user task, receive task, manual
task, call activity or sub-process: a person or another system completes it), at an exclusive,
inclusive or event-based gateway with more than one way out (the choice is not made yet: the task
chosen decides it), at a parallel join (until every incoming branch has arrived) or at an
intermediate catch event. A token at a start event (a new instance) moves on at once.

**Enabled now** (`enabled(process, position)`): a service task a token waits at, and every service
task reachable from a token waiting at an undecided gateway through further gateways (a parallel
split on the way: every branch). Condition expressions on sequence flows are *not evaluated* (that
would mean running expressions from the file): every branch of an exclusive gateway is enabled and
the chosen task takes its branch; the flow's name and condition text go into the tool description
for the model. An inclusive gateway is treated as exclusive (one branch per action).

**Advance** (`advance(process, position, task)`): the token the task was reached from is consumed,
the other branches of parallel splits on the way get tokens, and new tokens go from the task's
outgoing flows to where they wait next (end events consume them); a parallel join with as many
tokens as incoming flows fires. An empty position means the instance has ended.

**Actions** (`compile_erp`, from the route's `erp.operations`: service task id -> method, path,
parameters): each service task becomes an `extproc.semantic.tools.Tool` (the tool-route machinery:
`openai_tools` offers it, `toolcall.check_arguments` validates a call, `toolcall.build_request`
builds the REST request): `{instance}` in the path is the client's instance id, `{name}` a required
argument; the other arguments are the JSON body (POST, PUT, PATCH) or the query (GET, DELETE).
Every service task needs an operation and every operation a service task (load error otherwise).

Errors: `BpmnError(source, element, reason)`; the message names the file, the element id and why.
Cost: parsing O(file size) at load; `enabled` and `advance` walk only the gateways between a token
and the next tasks (a few dict lookups each).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping
from urllib.parse import quote

from defusedxml import DefusedXmlException
from defusedxml.ElementTree import ParseError, fromstring
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from extproc.semantic.tools import BodyBinding, ParamBinding, Tool

BPMN_NS = "http://www.omg.org/spec/BPMN/20100524/MODEL"

SERVICE = frozenset({"serviceTask", "sendTask"})  # tasks the model may run (each mapped to a REST call)
WAITING = frozenset({"userTask", "manualTask", "receiveTask", "task", "callActivity", "subProcess",
                     "adHocSubProcess", "transaction", "intermediateCatchEvent"})  # done by someone else
CHOICE = frozenset({"exclusiveGateway", "inclusiveGateway", "eventBasedGateway"})
PASS = frozenset({"startEvent", "intermediateThrowEvent"})  # a token moves through at once
UNSUPPORTED = {"scriptTask": "a script task runs code from the file, which this gateway never does",
               "businessRuleTask": "a business-rule task evaluates a decision table, which this gateway does not",
               "complexGateway": "a complex gateway's activation condition is an expression this gateway does not "
                                 "evaluate"}
KINDS = SERVICE | WAITING | CHOICE | PASS | {"parallelGateway", "endEvent", "boundaryEvent"} | set(UNSUPPORTED)


class BpmnError(ValueError):
    """A BPMN file this gateway cannot use: where (`source`, `element` id) and why."""

    def __init__(self, source: str, element: str | None, reason: str) -> None:
        self.source, self.element, self.reason = source, element, reason
        where = f"{source}" + (f", element {element!r}" if element else "")
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Flow:
    id: str
    source: str
    target: str
    name: str = ""
    condition: str = ""  # the conditionExpression's text, shown to the model, never evaluated


@dataclass(frozen=True)
class Node:
    id: str
    kind: str  # the BPMN element's local name: serviceTask, userTask, exclusiveGateway, ...
    name: str = ""
    documentation: str = ""
    incoming: tuple[str, ...] = ()  # flow ids
    outgoing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Process:
    id: str
    name: str
    source: str
    nodes: Mapping[str, Node]
    flows: Mapping[str, Flow]
    starts: tuple[str, ...]

    def service_tasks(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes.values() if n.kind in SERVICE)

    def describe(self, node_id: str) -> str:
        """`Name (id, kind)` for messages."""
        n = self.nodes.get(node_id)
        if n is None:
            return repr(node_id)
        return f"{n.name} ({n.id}, {n.kind})" if n.name else f"{n.id} ({n.kind})"


@dataclass(frozen=True)
class Route:
    """How a token reaches an enabled task: the token it consumes and the gateways passed."""

    token: str
    via: tuple[tuple[str, str], ...] = ()  # (gateway id, flow id taken), in order


@dataclass(frozen=True)
class Enabled:
    tasks: Mapping[str, Route]  # service task id -> how it is reached (first token that reaches it)
    waiting: tuple[str, ...]  # element ids of tokens waiting for someone else (user tasks, joins, events)
    branch_text: Mapping[str, str] = field(default_factory=dict)  # task id -> the flow names/conditions taken


def _local(tag: str) -> tuple[str, str]:
    if tag.startswith("{"):
        ns, _, name = tag[1:].partition("}")
        return ns, name
    return "", tag


def _text(el) -> str:
    return " ".join("".join(el.itertext()).split()) if el is not None else ""


def parse_bpmn(data: bytes, source: str = "<bpmn>", process_id: str | None = None) -> Process:
    """The process `process_id` (or the only executable one) of a BPMN 2.0 XML document, checked.

    Raises `BpmnError` naming the file, the element and the reason.
    """
    try:
        root = fromstring(data, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except (ParseError, DefusedXmlException) as e:
        raise BpmnError(source, None, f"not well-formed or unsafe XML: {e}") from None
    ns, name = _local(root.tag)
    if ns != BPMN_NS or name != "definitions":
        raise BpmnError(source, None, f"the root element must be BPMN 2.0 <definitions xmlns=\"{BPMN_NS}\">, "
                        f"not <{name}> in {ns or 'no namespace'}")
    processes = [el for el in root if _local(el.tag) == (BPMN_NS, "process")]
    if process_id is not None:
        chosen = [p for p in processes if p.get("id") == process_id]
        if not chosen:
            raise BpmnError(source, process_id, "no <process> with this id; the file has "
                            + (", ".join(repr(p.get("id")) for p in processes) or "none"))
    else:
        chosen = [p for p in processes if p.get("isExecutable", "true") != "false"] or processes
        if len(chosen) != 1:
            raise BpmnError(source, None, f"{len(chosen)} executable processes "
                            f"({', '.join(repr(p.get('id')) for p in chosen) or 'none'}): name one with processId")
    return _compile(chosen[0], source)


def _compile(proc, source: str) -> Process:
    pid = proc.get("id") or "process"
    raw_nodes: dict[str, tuple[str, str, str]] = {}
    flows: dict[str, Flow] = {}
    for el in proc:
        ns, kind = _local(el.tag)
        if ns != BPMN_NS or kind in ("documentation", "extensionElements", "laneSet", "textAnnotation",
                                     "association", "dataObject", "dataObjectReference", "dataStoreReference",
                                     "property", "ioSpecification"):
            continue
        eid = el.get("id")
        if not eid:
            raise BpmnError(source, None, f"a <{kind}> in process {pid!r} has no id")
        if eid in raw_nodes or eid in flows:
            raise BpmnError(source, eid, "duplicate id")
        if kind == "sequenceFlow":
            src, dst = el.get("sourceRef"), el.get("targetRef")
            if not src or not dst:
                raise BpmnError(source, eid, "a sequence flow needs sourceRef and targetRef")
            cond = el.find(f"{{{BPMN_NS}}}conditionExpression")
            flows[eid] = Flow(eid, src, dst, el.get("name", ""), _text(cond))
            continue
        if kind in UNSUPPORTED:
            raise BpmnError(source, eid, f"<{kind}> is not supported: {UNSUPPORTED[kind]}")
        if kind not in KINDS:
            if kind.endswith(("Event", "Gateway", "Task")):
                raise BpmnError(source, eid, f"<{kind}> is not supported")
            continue  # data associations and other non-flow elements
        doc = el.find(f"{{{BPMN_NS}}}documentation")
        raw_nodes[eid] = (kind, el.get("name", ""), _text(doc))
    incoming: dict[str, list[str]] = {n: [] for n in raw_nodes}
    outgoing: dict[str, list[str]] = {n: [] for n in raw_nodes}
    for f in flows.values():
        for end, table in ((f.source, outgoing), (f.target, incoming)):
            if end not in raw_nodes:
                raise BpmnError(source, f.id, f"the sequence flow refers to {end!r}, which is not a flow node "
                                f"of process {pid!r}")
            table[end].append(f.id)
    nodes = {nid: Node(nid, k, nm, doc, tuple(incoming[nid]), tuple(outgoing[nid]))
             for nid, (k, nm, doc) in raw_nodes.items()}
    starts = tuple(n.id for n in nodes.values() if n.kind == "startEvent" and not n.incoming)
    if not starts:
        raise BpmnError(source, pid, "the process has no start event")
    for n in nodes.values():  # an activity with no way out ends its branch (an implicit end, as BPMN allows)
        if n.kind != "startEvent" and n.kind != "boundaryEvent" and not n.incoming:
            raise BpmnError(source, n.id, f"{n.kind} {n.name!r} has no incoming sequence flow: unreachable")
    process = Process(pid, proc.get("name", ""), source, MappingProxyType(nodes), MappingProxyType(flows), starts)
    _check_gateway_loops(process)
    return process


def _check_gateway_loops(p: Process) -> None:
    """Refuse a cycle of gateways and events with no task on it (a token would circle for ever)."""
    through = CHOICE | PASS | {"parallelGateway", "intermediateThrowEvent"}
    state: dict[str, int] = {}

    def visit(nid: str) -> None:
        state[nid] = 1
        for fid in p.nodes[nid].outgoing:
            t = p.flows[fid].target
            if p.nodes[t].kind not in through:
                continue
            if state.get(t) == 1:
                raise BpmnError(p.source, t, "a loop of gateways/events with no task on it")
            if t not in state:
                visit(t)
        state[nid] = 2

    for nid, n in p.nodes.items():
        if n.kind in through and nid not in state:
            visit(nid)


# --------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------


def _settle(p: Process, nid: str) -> list[str]:
    """Where a token entering `nid` comes to wait (several after a parallel split, none at an end)."""
    n = p.nodes[nid]
    if n.kind == "endEvent":
        return []
    if n.kind in PASS or (n.kind in CHOICE and len(n.outgoing) == 1) or (
            n.kind == "parallelGateway" and len(n.incoming) <= 1):
        return [t for fid in n.outgoing for t in _settle(p, p.flows[fid].target)]
    return [nid]  # an activity, an undecided gateway, a parallel join, a catch event


def _merge(p: Process, tokens: list[str]) -> list[str]:
    """Fire every parallel join that holds a token per incoming flow."""
    while True:
        counts = Counter(tokens)
        ready = next((j for j, c in counts.items() if p.nodes[j].kind == "parallelGateway"
                      and len(p.nodes[j].incoming) > 1 and c >= len(p.nodes[j].incoming)), None)
        if ready is None:
            return tokens
        need = len(p.nodes[ready].incoming)
        rest = []
        for t in tokens:
            if t == ready and need:
                need -= 1
            else:
                rest.append(t)
        tokens = rest + [t for fid in p.nodes[ready].outgoing for t in _settle(p, p.flows[fid].target)]


def normalize(p: Process, position: Iterable[str]) -> tuple[str, ...]:
    """A position with tokens moved on from start events (and joins fired); unknown ids raise BpmnError."""
    tokens: list[str] = []
    for t in position:
        if t not in p.nodes:
            raise BpmnError(p.source, t, f"the instance's position names an element that is not in process {p.id!r}")
        tokens.extend(_settle(p, t) if p.nodes[t].kind == "startEvent" else [t])
    return tuple(_merge(p, tokens))


def initial_position(p: Process) -> tuple[str, ...]:
    return normalize(p, p.starts[:1])


def enabled(p: Process, position: Iterable[str]) -> Enabled:
    """The service tasks that may run now from `position` (see the module docstring)."""
    tasks: dict[str, Route] = {}
    texts: dict[str, str] = {}
    waiting: list[str] = []
    for token in normalize(p, position):
        n = p.nodes[token]
        if n.kind in SERVICE:
            tasks.setdefault(token, Route(token))
        elif n.kind in CHOICE:
            found = _walk(p, token, token, (), tasks, texts)
            if not found:
                waiting.append(token)
        else:
            waiting.append(token)
    return Enabled(MappingProxyType(tasks), tuple(dict.fromkeys(waiting)), MappingProxyType(texts))


def _walk(p: Process, token: str, gw: str, via: tuple, tasks: dict, texts: dict) -> bool:
    found = False
    for fid in p.nodes[gw].outgoing:
        f = p.flows[fid]
        t = p.nodes[f.target]
        step = via + ((gw, fid),)
        if t.kind in SERVICE:
            if t.id not in tasks:
                tasks[t.id] = Route(token, step)
                texts[t.id] = "; ".join(x for x in (p.flows[s].name or p.flows[s].condition for _, s in step) if x)
            found = True
        elif t.kind in CHOICE or t.kind == "intermediateThrowEvent" or (
                t.kind == "parallelGateway" and len(t.incoming) <= 1):
            found = _walk(p, token, t.id, step, tasks, texts) or found
    return found


def advance(p: Process, position: Iterable[str], task: str) -> tuple[str, ...]:
    """The position after `task` (enabled now) has run; BpmnError if it is not enabled."""
    pos = list(normalize(p, position))
    route = enabled(p, pos).tasks.get(task)
    if route is None:
        raise BpmnError(p.source, task, "not enabled at the instance's position " + ", ".join(pos))
    pos.remove(route.token)
    for gw, taken in route.via:  # the other branches of parallel splits passed on the way
        g = p.nodes[gw]
        if g.kind == "parallelGateway":
            pos.extend(t for fid in g.outgoing if fid != taken for t in _settle(p, p.flows[fid].target))
    pos.extend(t for fid in p.nodes[task].outgoing for t in _settle(p, p.flows[fid].target))
    return tuple(_merge(p, pos))


# --------------------------------------------------------------------------
# Action mapping: service tasks -> REST calls (the route config's `erp.operations`)
# --------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class ErpRoute:
    """An erp route's compiled `erp` block: the process and one `Tool` per service task."""

    process: Process
    tools: Mapping[str, Tool]  # service task id -> its tool (a REST call on the ERP service)
    task_of: Mapping[str, str]  # tool name -> service task id
    service: str  # the ERP service's base URL, no trailing slash
    instance_path: str  # with {instance}
    timeout: float
    instance_field: str
    message_field: str
    instance_re: re.Pattern
    max_tokens: int

    def instance_target(self, instance: str) -> str:
        return self.instance_path.replace("{instance}", quote(instance, safe=""))

    def tool_name(self, task: str) -> str:
        return self.tools[task].name


def _tool_name(node: Node) -> str:
    base = re.sub(r"[^A-Za-z0-9]+", "_", node.name).strip("_").lower() if node.name else ""
    return (base or re.sub(r"[^A-Za-z0-9_-]+", "_", node.id))[:64]


def compile_erp(spec, path: Path, message_timeout: float) -> tuple[ErpRoute | None, list[tuple[tuple, str]]]:
    """`(ErpRoute, [])`, or `(None, problems)` with each problem's field path under `erp` and reason."""
    problems: list[tuple[tuple, str]] = []
    if not 0 < spec.timeout * 2 < message_timeout:
        problems.append((("timeout",), f"{spec.timeout:g}s: two ERP calls (the action, then the instance's "
                         f"advance) run within one processor message, so twice it must stay below "
                         f"spec.processor.messageTimeout ({message_timeout:g}s)"))
    try:
        instance_re = re.compile(spec.instance_pattern)
    except re.error as e:
        problems.append((("instancePattern",), f"not a regular expression: {e}"))
    try:
        data = path.read_bytes()
    except OSError as e:
        problems.append((("process",), f"cannot read the BPMN file {path}: {e.strerror or e}"))
        return None, problems
    try:
        process = parse_bpmn(data, str(path), spec.process_id)
    except BpmnError as e:
        problems.append((("processId",) if spec.process_id and e.element == spec.process_id else ("process",),
                         str(e)))
        return None, problems
    tasks = {n.id: n for n in process.service_tasks()}
    for tid, n in tasks.items():
        if tid not in spec.operations:
            problems.append((("operations",), f"service task {process.describe(tid)} of {path.name} has no "
                             "operation: add operations." + tid + " (method, path, parameters)"))
    tools: dict[str, Tool] = {}
    task_of: dict[str, str] = {}
    for tid, op in spec.operations.items():
        where = ("operations", tid)
        node = tasks.get(tid)
        if node is None:
            what = f"a {process.nodes[tid].kind}" if tid in process.nodes else "not an element"
            problems.append((where, f"{tid!r} is {what} of process {process.id!r} in {path.name}, not a service "
                             f"task; its service tasks: {', '.join(tasks) or 'none'}"))
            continue
        tool, why = _operation_tool(node, op)
        if tool is None:
            problems.append(why)
            continue
        if tool.name in task_of:
            problems.append((where + ("tool",), f"tool name {tool.name!r} is also service task "
                             f"{task_of[tool.name]!r}'s: set a distinct `tool`"))
            continue
        tools[tid] = tool
        task_of[tool.name] = tid
    if problems:
        return None, problems
    return ErpRoute(process, MappingProxyType(tools), MappingProxyType(task_of), spec.service.rstrip("/"),
                    spec.instance_path, spec.timeout, spec.instance_field, spec.message_field, instance_re,
                    spec.max_tokens), []


def _operation_tool(node: Node, op) -> tuple[Tool | None, tuple]:
    where = ("operations", node.id)
    schema = dict(op.parameters)
    if schema.get("type", "object") != "object":
        return None, (where + ("parameters", "type"), "the arguments' schema must be an object schema")
    schema.setdefault("type", "object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        return None, (where + ("parameters",) + tuple(e.absolute_path), f"not a valid JSON Schema: {e.message}")
    props = schema.get("properties") or {}
    if "instance" in props:
        return None, (where + ("parameters", "properties", "instance"), "`instance` is the client's instance id "
                      "(filled by the gateway, never by the model): rename the argument")
    required = set(schema.get("required") or ())
    params = [ParamBinding("instance", "instance", "path", "simple", False, required=True)]
    in_path = []
    for name in _PLACEHOLDER.findall(op.path):
        if name == "instance":
            continue
        if name not in props or name not in required:
            return None, (where + ("path",), f"placeholder {{{name}}} needs a required property {name!r} in "
                          "parameters")
        params.append(ParamBinding(name, name, "path", "simple", False, required=True))
        in_path.append(name)
    rest = tuple(k for k in props if k not in in_path)
    body = None
    if op.method in ("GET", "DELETE"):
        params.extend(ParamBinding(k, k, "query", "form", True, required=k in required) for k in rest)
    else:
        body = BodyBinding(None, rest, schema.get("additionalProperties", True) is not False, False,
                           "application/json")
    text = op.description or ". ".join(x for x in (node.name, node.documentation) if x) or node.id
    return Tool(op.tool or _tool_name(node), text[:1024], schema, op.method, op.path, None, tuple(params), body,
                node.id, f"/bpmn/{node.id}"), ()


__all__ = ["BpmnError", "Enabled", "ErpRoute", "Flow", "Node", "Process", "Route", "advance", "compile_erp", "enabled",
           "initial_position", "normalize", "parse_bpmn"]
