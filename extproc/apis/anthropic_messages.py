"""The Anthropic Messages API (`POST /v1/messages`) on an OpenAI chat-completions backend.

What: `to_chat(body)` turns a Messages request into a chat-completions request (raising
`TranslationError`, a 400 naming the field, for what it cannot carry), `from_chat(chat, ctx)` turns
the chat completion into a Message, and `MessagesStream` turns the chat stream's chunks into the
Messages stream's events one chunk at a time (nothing is held but the open block and the counts).

Request (Messages -> chat):

| Messages | chat completions |
|---|---|
| `model`, `max_tokens` (required), `temperature`, `top_p`, `top_k`, `stop_sequences` | `model`, `max_tokens`, `temperature`, `top_p`, `top_k` (vLLM), `stop` |
| `system` (string or text blocks) | a first `system` message |
| user `text` / `image` (base64 or url) blocks | `text` / `image_url` parts (`data:` URL for base64) |
| user `tool_result` blocks (`tool_use_id`, `content`, `is_error`) | `tool` messages before the user's other content |
| assistant `text` / `tool_use` blocks | `content` / `tool_calls` (`input` as JSON `arguments`) |
| assistant `thinking` / `redacted_thinking` blocks | dropped (chat has no place for them) |
| `tools` (`name`, `description`, `input_schema`) | `tools` of type `function` (`parameters`) |
| `tool_choice` auto / any / tool / none, `disable_parallel_tool_use` | `auto` / `required` / named function / `none`, `parallel_tool_calls: false` |
| `metadata.user_id` | `user` |
| `stream: true` | `stream`, `stream_options.include_usage` (usage for `message_delta`) |
Refused with a 400: server tools (a `type` other than `custom`), `document` and other block types,
roles other than user/assistant. Ignored: `thinking`, `service_tier`, `container`.

Response (chat -> Message): `content` -> a `text` block (left out when empty), each tool call -> a
`tool_use` block (`arguments` parsed; text that is not a JSON object kept as `{"arguments": text}`);
`finish_reason` stop -> `end_turn` (`stop_sequence` when vLLM's `stop_reason` names one of the
request's stop sequences), length -> `max_tokens`, tool_calls -> `tool_use`, content_filter ->
`refusal`; `usage` prompt (less cached) / completion / cached -> `input_tokens` / `output_tokens` /
`cache_read_input_tokens`.

Stream (chat chunks -> events): the first chunk opens `message_start` (usage 0: the chat stream
reports usage only at its end) and a `ping`; text deltas go to a `text` block, each tool call to a
`tool_use` block (`content_block_start`, `input_json_delta` with the argument fragments as they
come, `content_block_stop` when the next block opens or the choice finishes); the final usage chunk
and `[DONE]` give `message_delta` (stop reason, `input_tokens` and `output_tokens`) and
`message_stop`. A backend error inside the stream becomes an `error` event.
Cost: per request one dict walk over the messages; per chunk one JSON parse and one or two small
encodes; state per stream: the open block's index, the tool-call-to-block map and the usage.
"""

from __future__ import annotations

from typing import Any, Iterator

import orjson

from extproc.apis.common import (ChatStream, TranslationError, copy_sampling, copy_tools, first_choice,
                                 function_calls, function_tool, is_int, model_of, named, objects, reply_id,
                                 require, sse_event, stream_of, text_of, tool_input, usage_of)

NAME = "anthropic-messages"
API = "anthropic.messages"
DIALECT = "anthropic"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    require(isinstance(source, dict), f"{where}.source must be an object", f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        require(isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str),
                f"{where}.source needs string media_type and data", f"{where}.source")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url":
        require(isinstance(source.get("url"), str), f"{where}.source.url must be a string", f"{where}.source.url")
        url = source["url"]
    else:
        raise TranslationError(f"{where}.source.type {kind!r} is not supported (base64 or url)", f"{where}.source.type")
    return {"type": "image_url", "image_url": {"url": url}}


def _blocks(content: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`where[i]`, block) for each content block of a message's `content` list."""
    return objects(content, where, "a string or a list of content blocks")


def _text(block: dict[str, Any], at: str) -> str:
    """A `text` block's text (a string is required)."""
    require(isinstance(block.get("text"), str), f"{at}.text must be a string", f"{at}.text")
    return block["text"]


def _user_messages(content: Any, where: str) -> list[dict[str, Any]]:
    """One user turn: its tool results as `tool` messages first, then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for at, block in _blocks(content, where):
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            require(isinstance(block.get("tool_use_id"), str), f"{at}.tool_use_id must be a string", f"{at}.tool_use_id")
            text = text_of(block.get("content"), f"{at}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise TranslationError(f"{at}.type {kind!r} is not supported in user messages on this gateway "
                                   "(text, image, tool_result)", f"{at}.type")
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        tools.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text else parts})
    return tools


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for at, block in _blocks(content, where):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            require(isinstance(block.get("id"), str) and isinstance(block.get("name"), str),
                    f"{at} needs string id and name", at)
            require(isinstance(block.get("input", {}), dict), f"{at}.input must be an object", f"{at}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": orjson.dumps(block.get("input", {})).decode()}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise TranslationError(f"{at}.type {kind!r} is not supported in assistant messages on this gateway "
                                   "(text, tool_use)", f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for at, tool in objects(tools, "tools", "a list"):
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise TranslationError(f"{at}.type {kind!r}: server tools are not available on this gateway "
                                   "(only client tools with an input_schema)", f"{at}.type")
        out.append({"type": "function", "function": function_tool(tool, at, "input_schema", required=True)})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    require(isinstance(choice, dict), "tool_choice must be an object", "tool_choice")
    kind = choice.get("type")
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        require(isinstance(choice.get("name"), str), "tool_choice.name must be a string", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise TranslationError(f"tool_choice.type {kind!r} is not one of auto, any, tool, none", "tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the chat-completions request, the context the response needs) for a Messages request."""
    model = model_of(body)
    max_tokens = body.get("max_tokens")
    require(is_int(max_tokens) and max_tokens >= 1, "max_tokens: an integer of at least 1 is required",
            "max_tokens")
    messages = body.get("messages")
    require(isinstance(messages, list) and len(messages) > 0, "messages: a non-empty list is required", "messages")
    chat: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for at, m in objects(messages, "messages", "a list"):
        role = m.get("role")
        require("content" in m, f"{at}.content is required", f"{at}.content")
        if role == "user":
            out.extend(_user_messages(m["content"], f"{at}.content"))
        elif role == "assistant":
            out.append(_assistant_message(m["content"], f"{at}.content"))
        else:
            raise TranslationError(f"{at}.role must be user or assistant, not {role!r}", f"{at}.role")
    chat["messages"] = out
    copy_sampling(body, chat)
    if body.get("top_k") is not None:
        require(is_int(body["top_k"]), "top_k must be an integer", "top_k")
        chat["top_k"] = body["top_k"]
    stops = body.get("stop_sequences")
    if stops is not None:
        require(isinstance(stops, list) and all(isinstance(s, str) for s in stops),
                "stop_sequences must be a list of strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    copy_tools(body, chat, _tools)
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    stream = stream_of(body, chat)
    return chat, {"model": model, "stop_sequences": tuple(stops or ()), "stream": stream}


def _stop(finish: Any, matched: Any, ctx: dict[str, Any]) -> tuple[str, str | None]:
    if finish == "stop" and isinstance(matched, str) and matched in ctx.get("stop_sequences", ()):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def message_id(chat_id: Any, fallback: str) -> str:
    return reply_id("msg_", chat_id, fallback)


def _usage(u: tuple[int, int, int] | None) -> dict[str, int]:
    prompt, completion, cached = u or (0, 0, 0)
    usage = {"input_tokens": max(0, prompt - cached), "output_tokens": completion}
    if cached:
        usage["cache_read_input_tokens"] = cached
    return usage


def from_chat(chat: dict[str, Any], ctx: dict[str, Any], request_id: str = "") -> dict[str, Any]:
    """The Message for a chat completion (its first choice)."""
    choice, message = first_choice(chat)
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for _, call, fn in function_calls(message):
        content.append({"type": "tool_use", "id": named(call.get("id"), f"toolu_{len(content)}"),
                        "name": named(fn.get("name")), "input": tool_input(fn.get("arguments"))})
    reason, sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), ctx)
    if reason == "end_turn" and any(c["type"] == "tool_use" for c in content):
        reason = "tool_use"  # some servers finish tool calls with "stop"
    return {"id": message_id(chat.get("id"), request_id), "type": "message", "role": "assistant",
            "model": ctx.get("model") or chat.get("model"), "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(usage_of(chat))}


class MessagesStream(ChatStream):
    """Chat-completion chunks in, Messages stream events out, chunk by chunk (the walk: `ChatStream`)."""

    __slots__ = ("block", "kind")

    def __init__(self, ctx: dict[str, Any], request_id: str = ""):
        super().__init__(ctx, request_id)
        self.block = -1  # index of the last block opened
        self.kind: str | None = None  # the open block's type (None: none open)

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        message = {"id": message_id(chunk.get("id"), self.request_id), "type": "message", "role": "assistant",
                   "model": self.ctx.get("model") or chunk.get("model"), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [sse_event("message_start", {"type": "message_start", "message": message}),
                sse_event("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.block += 1
        self.kind = block["type"]
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                     "content_block": block}))
        return out

    def _text(self, text: str) -> list[bytes]:
        out = [] if self.kind == "text" else self._open({"type": "text", "text": ""})
        out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                     "delta": {"type": "text_delta", "text": text}}))
        return out

    def _tool_open(self, i: int, call: dict[str, Any], fn: dict[str, Any]) -> list[bytes]:
        call_id = named(call.get("id"), f"toolu_{self.request_id}_{i}")
        out = self._open({"type": "tool_use", "id": call_id, "name": named(fn.get("name")), "input": {}})
        self.tools[i] = self.block
        return out

    def _tool_args(self, index: int, args: str) -> list[bytes]:
        return [sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "input_json_delta", "partial_json": args}})]

    def done(self) -> list[bytes]:
        """The closing events, at the chat stream's `[DONE]`."""
        out = self._begin({})
        out += self._close()
        reason, sequence = _stop(self.finish, self.matched, self.ctx)
        if reason == "end_turn" and self.tools:  # some servers finish tool calls with "stop"
            reason = "tool_use"
        self.ended = True
        return out + [sse_event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                  "usage": _usage(self.usage)}),
                      sse_event("message_stop", {"type": "message_stop"})]

    def error(self, status: int, message: str) -> list[bytes]:
        """An in-stream `error` event (the anthropic client raises it as an APIStatusError)."""
        self.ended = True
        return [sse_event("error", {"type": "error", "error": {"type": error_type(status), "message": message}})]


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               409: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """The Anthropic error `type` for an HTTP status."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, request_id: str = "") -> dict[str, Any]:
    """The Anthropic error object: `{"type": "error", "error": {"type", "message"}, "request_id"}`."""
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body
