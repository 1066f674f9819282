"""Priority classes: which class a request runs in, the brief's priority matrix, and what the engine gets.

What: `PriorityClass` (name, rank: 0 is the most urgent, `critical`, the engine values), compiled once
from `spec.qos.classes` (default P0, P1, P2). A request's base class is, first match wins:
1. a trusted objective header (`QosRouteSpec.objectiveHeader`, e.g. the Gateway API inference
   extension's `x-gateway-inference-objective`, only on routes that declare it): a class name, or an
   objective name mapped to a class by `spec.qos.objectives`; an unknown value is ignored;
2. the route's class (`spec.qos.routes[].priorityClass`);
3. the tenant's class (`spec.qos.tenants[].priorityClass`);
4. `spec.qos.defaultClass` (P1).
`matrix_class(...)` is the brief's priority matrix (§2.4) as the default re-prioritisation rule:

| SLO deviation (attainment - target, points) | latency-sensitive | throughput-sensitive |
|---|---|---|
| < below (-5) | the first class (P0) | the last class (P2) |
| >= recover (-2), the brief's ±2 % band | its class (P1) | its class (P1) |
| between | what it was (hysteresis, per SLO: `extproc/qos/slo.py`) | |

It applies only to requests whose base class is in `matrix.applyTo` (default: the default class), so
an explicit class from a header, route or tenant is kept. The class chosen is the request attribute
`state.attrs[PRIORITY_ATTR]` (a `PriorityClass`) that scheduling plugins and a gateway queue read.
`engine_body(...)` puts it into the backend request for engines that take one: vLLM's `priority`
field (OpenAI API: the class's `enginePriority`, lower runs first) and the KServe v2 `parameters.priority`
(Triton: `tritonPriority`, 1 is the highest level), for backends listed in `spec.qos.enginePriority`.
Parameters: the classes, objectives, routes' and tenants' classes, matrix thresholds (schema.QosSpec).
Cost: per request two dict lookups and, with a trusted header, a third; the matrix one flag test per
matching SLO; the engine rewrite one JSON encode (and one decode where the body was already encoded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import orjson

PRIORITY_ATTR = "qos.class"  # state.attrs: the request's PriorityClass (after the matrix)
BASE_ATTR = "qos.base"  # state.attrs: (base PriorityClass, source) before the matrix
OPENAI_ENGINES = frozenset({"openai", "vllm"})
KSERVE_ENGINES = frozenset({"triton", "onnxruntime"})


@dataclass(frozen=True, slots=True)
class PriorityClass:
    name: str
    rank: int  # 0: the most urgent
    critical: bool  # never shed by the glitch breaker
    engine_priority: int  # vLLM's `priority` (lower runs first)
    triton_priority: int  # KServe v2 / Triton `priority` parameter (1 is the highest level)


def compile_classes(specs: Any) -> tuple[PriorityClass, ...]:
    return tuple(PriorityClass(s.name, i, s.critical if s.critical is not None else i == 0,
                               s.engine_priority if s.engine_priority is not None else i,
                               s.triton_priority if s.triton_priority is not None else i + 1)
                 for i, s in enumerate(specs))


def base_class(classes: Mapping[str, PriorityClass], objectives: Mapping[str, str], route_qos: Any,
               tenant_class: PriorityClass | None, default: PriorityClass,
               headers: Mapping[str, str] | None) -> tuple[PriorityClass, str]:
    """(class, source) for one request: source is header, route, tenant or default."""
    if route_qos is not None:
        if route_qos.objective_header is not None and headers:
            value = headers.get(route_qos.objective_header)
            if value:
                cls = classes.get(value) or classes.get(objectives.get(value, ""))
                if cls is not None:
                    return cls, "header"
        if route_qos.priority_class is not None:
            return route_qos.priority_class, "route"
    if tenant_class is not None:
        return tenant_class, "tenant"
    return default, "default"


def matrix_class(base: PriorityClass, workload: str, escalated: bool, first: PriorityClass,
                 last: PriorityClass, applies: bool) -> PriorityClass:
    """The brief's matrix: while an SLO the request falls under is escalated (deviation < below),
    latency work runs as `first`, throughput work as `last`; otherwise, or for classes the matrix
    does not apply to, the base class."""
    if not (applies and escalated):
        return base
    return first if workload == "latency" else last


def engine_body(kind: str, cls: PriorityClass, body: dict[str, Any] | None,
                encoded: bytes | None) -> bytes | None:
    """The backend request with the class's priority in it, or None when nothing applies: an OpenAI-API
    body gets `priority` (the parsed client body for openai routes, or the request the adapter encoded);
    a KServe v2 JSON request gets `parameters.priority`. A body that is not a JSON object is left alone
    (KServe's binary tensor extension)."""
    if kind in OPENAI_ENGINES:
        doc = body if encoded is None else _json(encoded)
        if doc is None:
            return None
        doc["priority"] = cls.engine_priority
    elif kind in KSERVE_ENGINES:
        doc = _json(encoded) if encoded is not None else body
        if doc is None:
            return None
        params = doc.get("parameters")
        doc["parameters"] = {**(params if isinstance(params, dict) else {}), "priority": cls.triton_priority}
    else:
        return None
    return orjson.dumps(doc)


def _json(raw: bytes) -> dict[str, Any] | None:
    if not raw[:1] == b"{":
        return None
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:  # e.g. a JSON header followed by binary tensors
        return None
    return doc if isinstance(doc, dict) else None


__all__ = ["PriorityClass", "PRIORITY_ATTR", "BASE_ATTR", "compile_classes", "base_class", "matrix_class",
           "engine_body"]
