"""The OpenAI Responses API (`POST /v1/responses`) on an OpenAI chat-completions backend.

What: `to_chat(body)` turns a Responses request into a chat-completions request (raising
`TranslationError`, a 400 naming the field, for what it cannot carry), `from_chat(chat, ctx)` turns
the chat completion into a Response, and `ResponsesStream` turns the chat stream's chunks into the
Responses stream's events one chunk at a time.

Request (Responses -> chat):

| Responses | chat completions |
|---|---|
| `model`, `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls` | `model`, `max_tokens`, `temperature`, `top_p`, `parallel_tool_calls` |
| `instructions` | a first `system` message |
| `input` as a string | one `user` message |
| `input` message items (`role` user / assistant / system / developer; `input_text`, `output_text`, `input_image` parts, or a string) | messages (`developer` as `system`; `image_url` parts) |
| `function_call` items (`call_id`, `name`, `arguments`) | an assistant message's `tool_calls` (consecutive calls in one message) |
| `function_call_output` items (`call_id`, `output`) | `tool` messages |
| `reasoning` items | dropped |
| `tools` of type `function` (`name`, `description`, `parameters`, `strict`) | `tools` of type `function` |
| `tool_choice` auto / none / required / `{"type": "function", "name"}` | the same, chat's shape |
| `text.format` json_schema / json_object | `response_format` |
| `user`, `safety_identifier` | `user` |
| `stream: true` | `stream`, `stream_options.include_usage` |
Refused with a 400: `previous_response_id`, `conversation` and `item_reference` items (the gateway
keeps no conversation state), `background`, built-in tools (web_search, file_search, ...),
`input_file` parts. Ignored: `store` (nothing is stored: responses say `store: false`), `reasoning`,
`truncation`, `include`, `service_tier`.

Response (chat -> Response): `content` -> a `message` output item with one `output_text` part (left
out when empty), each tool call -> a `function_call` item (`call_id` the chat call's id);
`finish_reason` length -> `status: incomplete` with `incomplete_details.reason: max_output_tokens`,
content_filter -> `incomplete` with `content_filter`, else `completed`; `usage` prompt / completion /
cached -> `input_tokens` / `output_tokens` / `input_tokens_details.cached_tokens`. The request's
`instructions`, `tools`, `tool_choice`, `temperature`, `top_p`, `max_output_tokens`, `metadata` and
`text` are echoed as the API does.

Stream (chat chunks -> events, each with its `sequence_number`): the first chunk gives
`response.created` and `response.in_progress`; text opens a message item
(`response.output_item.added`, `response.content_part.added`) and each delta is a
`response.output_text.delta`; each tool call is a `function_call` item with
`response.function_call_arguments.delta` events; an item is closed (`...done` events with its whole
text or arguments) when the next one opens or the choice finishes; `[DONE]` gives
`response.completed` (or `response.incomplete`) carrying the whole Response with usage. A backend
error inside the stream becomes `response.failed`.
Cost: per request one walk over the input items; per chunk one JSON parse and one or two small
encodes; state per stream: the output items so far (the `...done` and final events repeat them).
"""

from __future__ import annotations

import time
from typing import Any

from extproc.apis.common import (ChatStream, TranslationError, copy_sampling, copy_tools, first_choice,
                                 function_calls, function_tool, is_int, model_of, named, objects, reply_id,
                                 require, sse_event, stream_of, text_of, usage_of)

NAME = "openai-responses"
API = "openai.responses"
DIALECT = "openai"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
UNSUPPORTED = {"previous_response_id": "the gateway keeps no conversation state: send the whole input",
               "conversation": "the gateway keeps no conversation state: send the whole input",
               "background": "background responses need stored state, which the gateway does not keep"}
ECHOED = ("instructions", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens", "metadata",
          "parallel_tool_calls", "text", "user")


def _content(content: Any, where: str) -> Any:
    """A message item's content for chat: a string, or parts when it has images."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for at, part in objects(content, where, "a string or a list of content parts"):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            key = "refusal" if kind == "refusal" else "text"
            require(isinstance(part.get(key), str), f"{at}.{key} must be a string", f"{at}.{key}")
            parts.append({"type": "text", "text": part[key]})
        elif kind == "input_image":
            url = part.get("image_url")
            require(isinstance(url, str), f"{at}.image_url must be a string (file_id images need the Files API, "
                                           "which the gateway does not serve)", f"{at}.image_url")
            image: dict[str, Any] = {"url": url}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise TranslationError(f"{at}.type {kind!r} is not supported on this gateway "
                                   "(input_text, output_text, input_image)", f"{at}.type")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _messages(items: Any, out: list[dict[str, Any]]) -> None:
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return
    for at, item in objects(items, "input", "a string or a list of items"):
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            require(role is not None, f"{at}.role must be user, assistant, system or developer", f"{at}.role")
            out.append({"role": role, "content": _content(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            require(isinstance(item.get("call_id"), str) and isinstance(item.get("name"), str),
                    f"{at} needs string call_id and name", at)
            args = item.get("arguments", "")
            require(isinstance(args, str), f"{at}.arguments must be a string (JSON text)", f"{at}.arguments")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # a reply's text and its calls: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            require(isinstance(item.get("call_id"), str), f"{at}.call_id must be a string", f"{at}.call_id")
            output = text_of(item.get("output"), f"{at}.output", ("input_text", "output_text", "text"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise TranslationError(f"{at}: item references need stored responses, which the gateway does not keep",
                                   f"{at}.type")
        else:
            raise TranslationError(f"{at}.type {kind!r} is not supported on this gateway "
                                   "(message, function_call, function_call_output)", f"{at}.type")


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for at, tool in objects(tools, "tools", "a list"):
        if tool.get("type") != "function":
            raise TranslationError(f"{at}.type {tool.get('type')!r}: built-in tools are not available on this "
                                   "gateway (only function tools)", f"{at}.type")
        fn = function_tool(tool, at, "parameters", required=False)
        if isinstance(tool.get("strict"), bool):
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise TranslationError("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                           "tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    require(isinstance(text, dict), "text must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    require(isinstance(fmt, dict), "text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        require(isinstance(fmt.get("schema"), dict), "text.format.schema must be a JSON schema object",
                "text.format.schema")
        spec: dict[str, Any] = {"name": fmt.get("name") if isinstance(fmt.get("name"), str) else "response",
                                "schema": fmt["schema"]}
        if isinstance(fmt.get("strict"), bool):
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise TranslationError(f"text.format.type {kind!r} is not one of text, json_object, json_schema",
                           "text.format.type")


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the chat-completions request, the context the response needs) for a Responses request."""
    for key, why in UNSUPPORTED.items():
        if body.get(key):
            raise TranslationError(f"{key}: {why}", key)
    model = model_of(body)
    require("input" in body, "input: a string or a list of items is required", "input")
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        require(isinstance(instructions, str), "instructions must be a string", "instructions")
        if instructions:
            out.append({"role": "system", "content": instructions})
    _messages(body["input"], out)
    require(any(m["role"] != "system" for m in out), "input: at least one item is required", "input")
    chat: dict[str, Any] = {"model": model, "messages": out}
    limit = body.get("max_output_tokens")
    if limit is not None:
        require(is_int(limit) and limit >= 1,
                "max_output_tokens must be an integer of at least 1", "max_output_tokens")
        chat["max_tokens"] = limit
    copy_sampling(body, chat)
    copy_tools(body, chat, _tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        require(isinstance(body["parallel_tool_calls"], bool), "parallel_tool_calls must be a boolean",
                "parallel_tool_calls")
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("text") is not None:
        fmt = _format(body["text"])
        if fmt is not None:
            chat["response_format"] = fmt
    user = body.get("user") if isinstance(body.get("user"), str) else body.get("safety_identifier")
    if isinstance(user, str):
        chat["user"] = user
    stream = stream_of(body, chat)
    ctx = {k: body[k] for k in ECHOED if body.get(k) is not None}
    ctx["model"] = model
    ctx["stream"] = stream
    return chat, ctx


def response_id(chat_id: Any, fallback: str) -> str:
    return reply_id("resp_", chat_id, fallback)


def _created(chat: dict[str, Any]) -> int:
    """The chat completion's `created` (now when it has none)."""
    return chat.get("created") if isinstance(chat.get("created"), int) else int(time.time())


def _usage(u: tuple[int, int, int] | None) -> dict[str, Any]:
    prompt, completion, cached = u or (0, 0, 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _status(finish: Any) -> tuple[str, dict[str, str] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _response(rid: str, created: int, ctx: dict[str, Any], status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: Any = None, error: Any = None) -> dict[str, Any]:
    text = ctx.get("text") or {"format": {"type": "text"}}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": ctx.get("instructions"),
            "max_output_tokens": ctx.get("max_output_tokens"), "model": ctx.get("model"), "output": output,
            "parallel_tool_calls": ctx.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": ctx.get("temperature"), "text": text, "tool_choice": ctx.get("tool_choice", "auto"),
            "tools": ctx.get("tools", []), "top_p": ctx.get("top_p"), "truncation": "disabled",
            "usage": usage, "user": ctx.get("user"), "metadata": ctx.get("metadata", {})}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def from_chat(chat: dict[str, Any], ctx: dict[str, Any], request_id: str = "") -> dict[str, Any]:
    """The Response for a chat completion (its first choice)."""
    rid = response_id(chat.get("id"), request_id)
    choice, message = first_choice(chat)
    output: list[dict[str, Any]] = []
    text = message.get("content")
    suffix = rid.removeprefix("resp_")
    if isinstance(text, str) and text:
        output.append(_message_item(f"msg_{suffix}_0", text))
    for i, call, fn in function_calls(message):
        args = fn.get("arguments")
        output.append(_call_item(f"fc_{suffix}_{len(output)}", named(call.get("id"), f"call_{suffix}_{i}"),
                                 named(fn.get("name")), args if isinstance(args, str) else "{}"))
    status, incomplete = _status(choice.get("finish_reason"))
    return _response(rid, _created(chat), ctx, status, output, _usage(usage_of(chat)), incomplete)


class ResponsesStream(ChatStream):
    """Chat-completion chunks in, Responses stream events out, chunk by chunk (the walk: `ChatStream`)."""

    __slots__ = ("rid", "suffix", "created", "seq", "items", "open")

    def __init__(self, ctx: dict[str, Any], request_id: str = ""):
        super().__init__(ctx, request_id)
        self.rid = ""
        self.suffix = ""  # the response id less its `resp_`: the item ids' middle part
        self.created = 0
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items so far (the open one last)
        self.open = False  # the last item is still in progress

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, data)

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.rid = response_id(chunk.get("id"), self.request_id)
        self.suffix = self.rid.removeprefix("resp_")
        self.created = _created(chunk)
        snapshot = _response(self.rid, self.created, self.ctx, "in_progress", [], None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _close(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        index = len(self.items) - 1
        item = self.items[index]
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.items.append(item)
        self.open = True
        index = len(self.items) - 1
        added = {**item, "content": []} if item["type"] == "message" else dict(item)
        out.append(self._event("response.output_item.added", output_index=index, item=added))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}))
        return out

    def _text(self, text: str) -> list[bytes]:
        last = self.items[-1] if self.items else None
        out: list[bytes] = []
        if not (self.open and last is not None and last["type"] == "message"):
            out = self._add(_message_item(f"msg_{self.suffix}_{len(self.items)}", "", "in_progress"))
        item = self.items[-1]
        item["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _tool_open(self, i: int, call: dict[str, Any], fn: dict[str, Any]) -> list[bytes]:
        call_id = named(call.get("id"), f"call_{self.suffix}_{i}")
        out = self._add(_call_item(f"fc_{self.suffix}_{len(self.items)}", call_id, named(fn.get("name")), "",
                                   "in_progress"))
        self.tools[i] = len(self.items) - 1
        return out

    def _tool_args(self, index: int, args: str) -> list[bytes]:
        self.items[index]["arguments"] += args
        return [self._event("response.function_call_arguments.delta", item_id=self.items[index]["id"],
                            output_index=index, delta=args)]

    def done(self) -> list[bytes]:
        """The closing events, at the chat stream's `[DONE]`."""
        out = self._begin({})
        out += self._close()
        status, incomplete = _status(self.finish)
        self.ended = True
        final = _response(self.rid, self.created, self.ctx, status, self.items, _usage(self.usage), incomplete)
        return out + [self._event(f"response.{status}", response=final)]

    def error(self, status: int, message: str) -> list[bytes]:
        """`response.failed` with the error (what the API sends when generation fails mid-way)."""
        out = self._begin({})
        self.ended = True
        for item in self.items:
            item["status"] = "incomplete" if item["status"] == "in_progress" else item["status"]
        failed = _response(self.rid, self.created, self.ctx, "failed", self.items, _usage(self.usage),
                           error={"code": "server_error", "message": message})
        return out + [self._event("response.failed", response=failed)]


def error_body(status: int, message: str, request_id: str = "") -> dict[str, Any]:
    """The OpenAI error object (`{"error": {"message", "type", "param", "code"}}`)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
