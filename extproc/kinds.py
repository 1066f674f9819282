"""Route kinds, declared once each: what a kind accepts, which stages it runs, how it speaks errors.

What: `KindSpec` holds everything that differs between route kinds: the backend API its targets
must speak, whether it takes several targets, a prefix match, templates (`request`, `transform`,
`outputSchema`), an OpenAPI document or a mapping file, whether it needs a model, its error
`dialect` (`extproc/errors.py`) and `stages(route)`, its pipeline. `kind_specs()` is the explicit
registry; `extproc/config/compile.py` validates routes against their spec and builds pipelines
from it; nothing else branches on a route's kind.
Every inference route starts with `admit` (tenant identity and quota) and `body-limit`, and runs
`token-budget` (tenant budgets, `extproc/stages/token_budget.py`) just before `dispatch`; `dispatch`
(`extproc/stages/dispatch.py`) is where every kind sends its request to a backend. The phases a
pipeline's hooks use are exactly what Envoy is configured to send for the route.

| kind | stages (request headers / request body / response) | dialect |
|---|---|---|
| llm | admit, body-limit / parse-json, token-budget, dispatch, encode-request / decode-response | adapter |
| passthrough | admit, body-limit, token-budget, dispatch / - / - | adapter |
| openai | admit, body-limit, openai-parse, dispatch (bodiless) / openai-parse, token-budget, dispatch / openai-usage (streamed) | openai |
| kserve | admit, body-limit, kserve-parse, token-budget, dispatch / - / - | kserve |
| tensor | like llm, with model-metadata before encode-request | adapter |
| tool | admit, body-limit / tool-call, token-budget, dispatch / tool-call | tool |
| rest | like llm, the body mapped by the route's mapping file both ways | adapter |
| erp | admit, body-limit / erp-action (reads the instance), token-budget, dispatch / erp-action (the chosen action checked and run) | adapter |
| anthropic-messages | admit, body-limit, anthropic-messages, backend-dialect / anthropic-messages, token-budget, dispatch, backend-dialect / anthropic-messages (streamed) | anthropic |
| openai-responses | admit, body-limit, openai-responses, backend-dialect / openai-responses, token-budget, dispatch, backend-dialect / openai-responses (streamed) | openai |
| sql | admit, body-limit / sql-query, token-budget, dispatch / sql-query (the model's SQL checked and run) | adapter |
| iot | admit, body-limit / parse-json, mqtt-command (publishes, answers itself) / - | adapter |
| iot with a target | like llm, with mqtt-model-command for decode-response (the model's command published) | adapter |
| websocket | admit, body-limit, websocket-upgrade, token-budget, dispatch / - / - (Envoy proxies the frames) | adapter |
| health | health / - / - | adapter |

Why: one spec per kind instead of if-chains over five files (schema, compile, stages, cli); a
cross-cutting stage (QoS, canary, tracing) is added in one place.
Cost: nothing per request; `stages` runs once per route per config load.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class KindSpec:
    name: str
    stages: Callable[[Any], list[Any]]  # route -> stage objects, in order
    api: str | None = None  # the backend API targets must speak (backends.base adapter `api`)
    dialect: str = "adapter"
    needs_target: bool = True  # False: the processor answers itself (no backend unless one is named)
    multi_target: bool = False  # several targets (dispatch by model)
    prefix: bool = True  # `match: prefix` allowed
    templates: bool = False  # request / transform / outputSchema allowed
    needs_model: bool = False
    openapi: bool = False  # reads an OpenAPI document (required)
    mapping: bool = False  # may apply a field-mapping file
    sql: bool = False  # reads a database (the route's `sql` block, required)
    erp: bool = False  # acts in a BPMN process on an ERP service (the route's `erp` block, required)
    doc: str = ""


def _front() -> list[Any]:
    from extproc.stages.admit import Admit
    from extproc.stages.body_limit import BodyLimit

    return [Admit(), BodyLimit()]


def _llm(route: Any) -> list[Any]:
    from extproc.stages.token_budget import TokenBudgetAtBody
    from extproc.stages.decode_response import DecodeResponse
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.encode_request import EncodeRequest
    from extproc.stages.parse_json import ParseJson

    return [*_front(), ParseJson(), TokenBudgetAtBody(), DispatchAtBody(), EncodeRequest(), DecodeResponse()]


def _tensor(route: Any) -> list[Any]:
    from extproc.stages.token_budget import TokenBudgetAtBody
    from extproc.stages.decode_response import DecodeResponse
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.encode_request import EncodeRequest
    from extproc.stages.model_metadata import ModelMetadata
    from extproc.stages.parse_json import ParseJson

    return [*_front(), ParseJson(), TokenBudgetAtBody(), DispatchAtBody(), ModelMetadata(), EncodeRequest(),
            DecodeResponse()]


def _passthrough(route: Any) -> list[Any]:
    from extproc.stages.token_budget import TokenBudgetAtHeaders
    from extproc.stages.dispatch import DispatchAtHeaders

    return [*_front(), TokenBudgetAtHeaders(), DispatchAtHeaders()]


def _openai(route: Any) -> list[Any]:
    from extproc.stages.token_budget import TokenBudgetAtBody
    from extproc.stages.dispatch import DispatchAtBody, DispatchAtHeaders
    from extproc.stages.openai_api import OpenAIParse, OpenAIUsage

    return [*_front(), OpenAIParse(), DispatchAtHeaders(only_without_body=True), TokenBudgetAtBody(), DispatchAtBody(),
            OpenAIUsage()]


def _kserve(route: Any) -> list[Any]:
    from extproc.stages.token_budget import TokenBudgetAtHeaders
    from extproc.stages.dispatch import DispatchAtHeaders
    from extproc.stages.kserve_dispatch import KServeParse

    return [*_front(), KServeParse(), TokenBudgetAtHeaders(), DispatchAtHeaders()]


def _tool(route: Any) -> list[Any]:
    from extproc.stages.token_budget import TokenBudgetAtBody
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.tool_call import ToolCall

    return [*_front(), ToolCall(), TokenBudgetAtBody(), DispatchAtBody()]


def _erp(route: Any) -> list[Any]:
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.erp_action import ErpAction
    from extproc.stages.token_budget import TokenBudgetAtBody

    return [*_front(), ErpAction(), TokenBudgetAtBody(), DispatchAtBody()]


def _anthropic_messages(route: Any) -> list[Any]:
    from extproc.stages.backend_dialect import BackendDialect
    from extproc.stages.client_api import anthropic_messages
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.token_budget import TokenBudgetAtBody

    return [*_front(), anthropic_messages(), TokenBudgetAtBody(), DispatchAtBody(), BackendDialect()]


def _openai_responses(route: Any) -> list[Any]:
    from extproc.stages.backend_dialect import BackendDialect
    from extproc.stages.client_api import openai_responses
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.token_budget import TokenBudgetAtBody

    return [*_front(), openai_responses(), TokenBudgetAtBody(), DispatchAtBody(), BackendDialect()]


def _iot(route: Any) -> list[Any]:
    from extproc.stages.mqtt_command import MqttCommand
    from extproc.stages.parse_json import ParseJson

    if route.backend is None:  # the command is in the request: the processor publishes and answers
        return [*_front(), ParseJson(), MqttCommand()]
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.encode_request import EncodeRequest
    from extproc.stages.mqtt_model_command import MqttModelCommand
    from extproc.stages.token_budget import TokenBudgetAtBody

    # the optional LLM step: the target model answers with the command, published at the response
    return [*_front(), ParseJson(), TokenBudgetAtBody(), DispatchAtBody(), EncodeRequest(), MqttModelCommand()]


def _sql(route: Any) -> list[Any]:
    from extproc.stages.dispatch import DispatchAtBody
    from extproc.stages.sql_query import SqlQuery
    from extproc.stages.token_budget import TokenBudgetAtBody

    return [*_front(), SqlQuery(), TokenBudgetAtBody(), DispatchAtBody()]


def _websocket(route: Any) -> list[Any]:
    from extproc.stages.dispatch import DispatchAtHeaders
    from extproc.stages.token_budget import TokenBudgetAtHeaders
    from extproc.stages.websocket_upgrade import WebSocketUpgrade

    return [*_front(), WebSocketUpgrade(), TokenBudgetAtHeaders(), DispatchAtHeaders()]


def _health(route: Any) -> list[Any]:
    from extproc.stages.health import Health

    return [Health()]


def kind_specs() -> Mapping[str, KindSpec]:
    specs = (
        KindSpec("llm", _llm, api="openai", prefix=False, templates=True, needs_model=True,
                 doc="adapts JSON in and out of a chat model"),  # pragma: no mutate
        KindSpec("passthrough", _passthrough, doc="forwards requests as they are"),
        KindSpec("openai", _openai, api="openai", dialect="openai", multi_target=True,
                 doc="the OpenAI API: model-based dispatch, streaming, token usage"),  # pragma: no mutate
        KindSpec("kserve", _kserve, api="kserve", dialect="kserve", multi_target=True,
                 doc="KServe v2 paths to the backend serving the model"),  # pragma: no mutate
        KindSpec("tensor", _tensor, api="kserve", prefix=False, templates=True, needs_model=True,
                 doc="JSON mapped to a model's input tensors and back"),  # pragma: no mutate
        KindSpec("tool", _tool, api="rest", dialect="tool", openapi=True, templates=True,
                 doc="LLM tool calls executed on an OpenAPI-described REST service"),  # pragma: no mutate
        KindSpec("rest", _rest_stages(), api="rest", templates=True, mapping=True,
                 doc="a REST service, the body mapped by a field-mapping file both ways"),  # pragma: no mutate
        KindSpec("erp", _erp, api="openai", prefix=False, templates=True, needs_model=True, erp=True,
                 doc="the model's chosen action in a BPMN process, checked against the instance and run on an "
                     "ERP service"),  # pragma: no mutate
        KindSpec("anthropic-messages", _anthropic_messages, api="openai", dialect="anthropic", multi_target=True,
                 prefix=False, doc="the Anthropic Messages API served on chat-completion backends"),  # pragma: no mutate
        KindSpec("openai-responses", _openai_responses, api="openai", dialect="openai", multi_target=True,
                 prefix=False, doc="the OpenAI Responses API served on chat-completion backends"),  # pragma: no mutate
        KindSpec("iot", _iot, needs_target=False, prefix=False,
                 doc="device commands published over MQTT, the device's reply as the answer"),  # pragma: no mutate
        KindSpec("sql", _sql, api="openai", prefix=False, templates=True, needs_model=True, sql=True,
                 doc="questions answered by model-written SQL, checked and run read-only on a database"),  # pragma: no mutate
        KindSpec("websocket", _websocket,
                 doc="WebSocket upgrades admitted, charged and sent to the chosen endpoint; frames proxied by Envoy"),  # pragma: no mutate
        KindSpec("health", _health, prefix=False, doc="the processor's health and protocol-negotiation probe"),
    )
    return MappingProxyType({s.name: s for s in specs})


def _rest_stages() -> Callable[[Any], list[Any]]:
    return _llm  # same stages; the rest adapter applies the route's mapping


__all__ = ["KindSpec", "kind_specs"]
