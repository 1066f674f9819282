"""`InferenceRequest`: the one parsed view of a request, made once per API, read by every later stage.

What: `parse_openai(path, body)` (chat completions, completions, embeddings, and the shape of
Anthropic Messages and OpenAI Responses: `messages` / `input` / `prompt`), `parse_kserve(path,
body)` (KServe v2 `/v2/models/{model}[/versions/{v}]/infer`, body optional: binary tensors are
never read) and `parse_document(doc, route)` (our llm/tensor/rest routes: the model is the
route's) fill the same typed record: API, model, LoRA adapter, prompt text or messages (for prefix
hashing), max tokens, stream, priority, tenant and session key. Dispatch (`extproc/dispatch.py`)
chooses the backend and endpoint from it; schedulers, canaries and QoS read it, never the raw
JSON again.
Why: JSON used to be parsed in three stages, each with its own error handling; a scheduler needs
model, prompt and priority without knowing the API (GIE's `LLMRequest`, llm-d's parsers).
Cost: the JSON parse itself (orjson, about 1 us per 100 bytes) plus a few dict lookups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import orjson

from extproc.errors import reject
from extproc.types import Reject

# APIs a route kind's parser produces; `anthropic` and `responses` have room here for their kinds.
APIS = ("openai.chat", "openai.completions", "openai.embeddings", "openai.other", "anthropic.messages",
        "openai.responses", "kserve.v2", "document")


@dataclass(slots=True)
class InferenceRequest:
    api: str
    model: str | None = None
    lora: str | None = None  # the LoRA adapter asked for, when the model name is one a backend declares as such
    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str | None = None  # completions' prompt, or the text of `messages` joined (prefix hashing)
    max_tokens: int | None = None
    stream: bool = False
    priority: int | None = None  # vLLM's request priority (lower is more urgent)
    tenant: str | None = None
    session_key: str | None = None  # OpenAI `user`, when the client set it
    body: dict[str, Any] | None = field(default=None, repr=False)  # the parsed JSON body, when there is one
    _text: str | None = field(default=None, repr=False, compare=False)  # prompt_text(), once built

    def prompt_text(self) -> str:
        """The prompt as one string: `prompt`, else the messages' text contents in order (built once)."""
        if self.prompt is not None:
            return self.prompt
        if self._text is not None:
            return self._text
        if self.api == "document" and self.body is not None:
            text = orjson.dumps(self.body).decode()  # our routes: the client document is the prompt's source
        else:
            parts: list[str] = []
            for m in self.messages:
                content = m.get("content")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    parts.extend(c.get("text", "") for c in content if isinstance(c, dict))
            text = "\n".join(parts)
        self._text = text
        return text

    def prompt_tokens_estimate(self) -> int:
        """The prompt's tokens, estimated as one per 4 characters (nothing is tokenised in the gateway)."""
        return len(self.prompt_text()) // 4


def parse_json_body(raw: bytes, *, allow_empty: bool = False) -> dict[str, Any] | Reject | None:
    """The body as a JSON object, None when empty and `allow_empty`, or a 400 naming the problem."""
    if not raw.strip():
        if allow_empty:
            return None
        return reject(400, "empty_body", "request body is empty; this route expects a JSON document")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return reject(400, "malformed_json", f"request body is not valid JSON: {e}")
    return doc


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_openai(path: str, body: dict[str, Any], tenant: str | None = None) -> InferenceRequest:
    """An OpenAI-API request body (already a dict) as an InferenceRequest; `path` names the API."""
    api = ("openai.chat" if path.endswith("/chat/completions") else
           "openai.completions" if path.endswith("/completions") else
           "openai.embeddings" if path.endswith("/embeddings") else
           "openai.responses" if path.endswith("/responses") else
           "anthropic.messages" if path.endswith("/messages") else "openai.other")
    model = body.get("model")
    messages = body.get("messages")
    prompt = body.get("prompt") if isinstance(body.get("prompt"), str) else None
    if api == "openai.responses" and isinstance(body.get("input"), str):
        prompt = body["input"]
    if api == "openai.embeddings" and isinstance(body.get("input"), str):
        prompt = body["input"]
    max_tokens = next((v for v in (_int(body.get(k)) for k in ("max_completion_tokens", "max_tokens",
                                                                "max_output_tokens")) if v is not None), None)
    return InferenceRequest(
        api=api, model=model if isinstance(model, str) else None,
        messages=tuple(m for m in messages if isinstance(m, dict)) if isinstance(messages, list) else (),
        prompt=prompt, max_tokens=max_tokens, stream=body.get("stream") is True,
        priority=_int(body.get("priority")), tenant=tenant,
        session_key=body.get("user") if isinstance(body.get("user"), str) else None, body=body)


def kserve_model(path: str) -> str | None:
    """`/v2/models/{model}[/versions/{v}]/...` -> model; None for paths without one."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if len(parts) >= 3 and parts[0] == "v2" and parts[1] == "models" and parts[2]:
        return parts[2]
    return None


def parse_kserve(path: str, body: dict[str, Any] | None = None, tenant: str | None = None) -> InferenceRequest:
    return InferenceRequest(api="kserve.v2", model=kserve_model(path), tenant=tenant, body=body)


def parse_document(doc: Any, model: str | None, tenant: str | None = None) -> InferenceRequest:
    """Our own routes' client document: the model is the route's; the document is the prompt's source."""
    body = doc if isinstance(doc, dict) else None
    return InferenceRequest(api="document", model=model, tenant=tenant, body=body)


__all__ = ["InferenceRequest", "parse_openai", "parse_kserve", "parse_document", "parse_json_body", "kserve_model"]
