"""OpenAI-compatible chat backend (vLLM's OpenAI server, or the simulator in `simulator_openai`).

Wire protocol: `POST /v1/chat/completions` with a JSON body; response `choices[0].message.content`.
For an `llm` route the adapter builds the chat request from the client's JSON:
- with a `request` template, the template's output is the request body; `model` and
  `response_format` are filled in when the template leaves them out;
- without one, the prompt is the client's `query`/`prompt`/`input`/`question`/`text` string field
  if it has one, else the client's whole JSON text.
When the route has an output schema (declared, or derived from the transform), the request asks
for it in the backend's dialect (backends/dialects.py: `response_format: {"type": "json_schema", ...}`
by default, llama.cpp's `json_object` with `schema`, vLLM's `structured_outputs`, ...; negotiated by
extproc/negotiate.py) and the model's content is parsed as JSON; in the `prompt` dialect (a server
that constrains nothing) the schema goes in the system prompt and the answer is validated against it.
Health probe path: `/health` (vLLM and the simulator both serve it).
Cost per request: one template render and one orjson encode; on the way back one orjson parse of
the backend response and one of the model's content.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import orjson

from backends.base import BackendError, EncodedRequest, InputError, MissingPathError, Usage
from backends.dialects import first_json_object, schema_error, schema_prompt, structured_fields

# the request fields that already ask for structured output (a request template that sets one wins)
STRUCTURED_KEYS = ("response_format", "guided_json", "structured_outputs", "json_schema", "format")

PROMPT_FIELDS = ("query", "prompt", "input", "question", "text")
SYSTEM_PROMPT = "Answer with a single JSON object that matches the requested schema. No prose."


class OpenAIAdapter:
    kind: ClassVar[str] = "openai"
    api: ClassVar[str] = "openai"
    default_health_path: ClassVar[str] = "/health"
    chat_path: ClassVar[str] = "/v1/chat/completions"
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})  # a generic server exports none

    def encode(self, route: Any, doc: Any, metadata: Any = None, dialect: Any = None) -> EncodedRequest:
        """`dialect` (backends/dialects.Dialect, negotiated with the backend): how the output schema is
        asked for; without one, OpenAI's `response_format: json_schema`."""
        structured = dialect.structured if dialect is not None else "json_schema"
        if route.request is not None:
            try:
                body = route.request.render(doc)
            except MissingPathError as e:
                raise InputError("missing_input_field", f"request field {e.path} is required by this route",
                                 path=e.path) from None
        else:
            body = {"messages": self._messages(route, doc, structured)}
        if isinstance(body, dict):
            body.setdefault("model", route.model)
            if route.response_schema is not None and not any(k in body for k in STRUCTURED_KEYS):
                body.update(structured_fields(structured, route.name.replace("-", "_"), route.response_schema))
                if structured == "prompt" and route.request is not None and isinstance(body.get("messages"), list):
                    body["messages"] = [{"role": "system", "content": schema_prompt(route.response_schema)},
                                        *body["messages"]]
        return EncodedRequest(self.chat_path, orjson.dumps(body))

    @staticmethod
    def _messages(route: Any, doc: Any, structured: str = "json_schema") -> list[dict[str, str]]:
        prompt = None
        if isinstance(doc, dict):
            prompt = next((doc[k] for k in PROMPT_FIELDS if isinstance(doc.get(k), str)), None)
        if prompt is None:
            prompt = doc if isinstance(doc, str) else orjson.dumps(doc).decode()
        messages = [{"role": "user", "content": prompt}]
        if route.response_schema is not None:
            system = schema_prompt(route.response_schema) if structured == "prompt" else SYSTEM_PROMPT
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def usage(self, response: Any) -> Usage:
        """Token counts from a chat/completions response or the final usage chunk of a stream."""
        u = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(u, dict):
            return Usage()
        return Usage(_tokens(u.get("prompt_tokens")), _tokens(u.get("completion_tokens")))

    def decode(self, route: Any, status: int, body: bytes, structured: str | None = None) -> dict[str, Any]:
        """`structured` "prompt": the schema was only asked for in the prompt, so the answer's JSON is
        looked for in its text and validated against the schema (`model_output_invalid` otherwise)."""
        try:
            resp = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            resp = None
        if status >= 400:
            message = f"backend {route.backend.name} answered HTTP {status}"
            if isinstance(resp, dict) and isinstance(resp.get("error"), dict):
                message += f": {resp['error'].get('message', '')}".rstrip(": ")
            raise BackendError(status if status < 500 else 502, "backend_error", message)
        if not isinstance(resp, dict):
            raise BackendError(502, "backend_bad_response", f"backend {route.backend.name} answered with no JSON object")
        try:
            content = resp["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BackendError(502, "backend_bad_response",
                               f"backend {route.backend.name} response has no choices[0].message.content") from None
        output: Any = content
        if route.response_schema is not None and structured == "prompt":
            try:
                output = first_json_object(content)
                error = schema_error(route.response_schema, output)
            except ValueError as e:
                error = str(e)
            if error is not None:
                raise BackendError(502, "model_output_invalid",
                                   f"model output does not match the route's schema: {error}")
        elif route.response_schema is not None:
            try:
                output = orjson.loads(content)
            except (orjson.JSONDecodeError, TypeError):
                snippet = str(content)[:120]
                raise BackendError(502, "model_output_not_json",
                                   f"model output is not the requested JSON: {snippet!r}") from None
        return {"output": output, "model": resp.get("model"), "usage": resp.get("usage"), "response": resp}


class VllmAdapter(OpenAIAdapter):
    """vLLM's OpenAI-compatible server: the same wire API, plus its engine metrics for scheduling.

    vLLM specifics the gateway passes through untouched: `priority` (lower runs earlier), LoRA
    adapters addressed by `model` name, `stream_options.include_usage`.
    """

    kind: ClassVar[str] = "vllm"
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "queue_depth": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        # renamed in vLLM 0.10 (PR #18354); scrape both
        "kv_cache_utilisation": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "time_to_first_token": ("vllm:time_to_first_token_seconds",),
    })


def _tokens(value: Any) -> int:
    """A token count as the backend reported it; 0 when it is not a number (a list, an object)."""
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0
