"""Stages of the request pipeline, one per file; `build_pipeline` picks them per route kind.

Every inference route starts with `admit` (tenant identity and quota) at request headers.
Route kinds and their stages (the phases listed are exactly what Envoy is configured to send):
- `llm`: request headers -> `body_limit`; request body -> `body_limit`, `parse_json`,
  `encode_request`; response headers and body -> `decode_response`.
- `passthrough`: request headers -> `body_limit`, `select_backend`.
- `openai`: request headers and body, response headers and (streamed) body -> `openai_api`.
- `kserve`: request headers -> `body_limit`, `kserve_dispatch`.
- `tensor`: like `llm`, with `model_metadata` before `encode_request` (KServe backends).
- `tool`: request body -> `tool_call` (OpenAPI tool call executed on a REST service); response too.
- `rest`: like `llm`, the body mapped by the route's field-mapping file both ways (REST backends).
- `health`: request headers -> `health`.
"""

from __future__ import annotations

from typing import Any

from extproc.pipeline import Pipeline
from extproc.stages.admit import Admit
from extproc.stages.body_limit import BodyLimit
from extproc.stages.decode_response import DecodeResponse
from extproc.stages.encode_request import EncodeRequest
from extproc.stages.health import Health
from extproc.stages.kserve_dispatch import KServeDispatch
from extproc.stages.model_metadata import ModelMetadata
from extproc.stages.openai_api import OpenAIApi
from extproc.stages.parse_json import ParseJson
from extproc.stages.select_backend import SelectBackend
from extproc.stages.tool_call import ToolCall


def build_pipeline(route: Any) -> Pipeline:
    if route.kind == "llm":
        return Pipeline([Admit(), BodyLimit(), ParseJson(), EncodeRequest(), DecodeResponse()])
    if route.kind == "passthrough":
        return Pipeline([Admit(), BodyLimit(), SelectBackend()])
    if route.kind == "openai":
        return Pipeline([Admit(), BodyLimit(), OpenAIApi()])
    if route.kind == "kserve":
        return Pipeline([Admit(), BodyLimit(), KServeDispatch()])
    if route.kind == "tensor":
        return Pipeline([Admit(), BodyLimit(), ParseJson(), ModelMetadata(), EncodeRequest(), DecodeResponse()])
    if route.kind == "health":
        return Pipeline([Health()])
    if route.kind == "tool":
        return Pipeline([Admit(), BodyLimit(), ToolCall()])
    if route.kind == "rest":
        return Pipeline([Admit(), BodyLimit(), ParseJson(), EncodeRequest(), DecodeResponse()])
    raise ValueError(f"no pipeline for route kind {route.kind!r}")
