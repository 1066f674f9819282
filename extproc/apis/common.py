"""What the client-API translations share: their input error, request checks, SSE framing, the
walk over a chat response and over a chat stream.

What: `TranslationError` is a client mistake found while translating a request (status 400 and a
`param` naming the field); the stage turns it into a `Reject`, rendered in the route's dialect.
`require` raises one; `objects` walks a list of objects naming each `where[i]`; `model_of`,
`copy_sampling`, `copy_tools`, `function_tool` and `stream_of` read the request fields both APIs
carry the same way. `SseSplitter` cuts a byte stream into complete SSE events as chunks arrive (a
partial event waits for the next chunk; nothing else is held); `sse_data` reads an event's `data:`
payload; `sse_event` frames one outgoing event. `tool_input` parses a chat tool call's `arguments`
text. `first_choice`, `function_calls` and `reply_id` read a chat completion; `ChatStream` walks a
chat stream's chunks and leaves what each piece becomes to its subclass (one per API).
Cost: per chunk one `split` over the new bytes; per event one slice.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import orjson


class TranslationError(ValueError):
    """The client's request cannot be translated: a 4xx naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def require(cond: bool, message: str, param: str) -> None:
    """A `TranslationError` (400, `param` naming the field) unless `cond`."""
    if not cond:
        raise TranslationError(message, param)


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def objects(value: Any, where: str, expected: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`where[i]`, item) for each item of the list `value`; a 400 `<where> must be <expected>` when
    it is not a list, `<where>[i] must be an object` at the first item that is not one."""
    require(isinstance(value, list), f"{where} must be {expected}", where)
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        require(isinstance(item, dict), f"{at} must be an object", at)
        yield at, item


def model_of(body: dict[str, Any]) -> str:
    """The request's `model` (a non-empty string is required)."""
    model = body.get("model")
    require(isinstance(model, str) and model != "", "model: a string is required", "model")
    return model


def copy_sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """`temperature` and `top_p` (numbers, when given) into the chat request as they are."""
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            require(isinstance(v, (int, float)) and not isinstance(v, bool), f"{key} must be a number", key)
            chat[key] = v


def copy_tools(body: dict[str, Any], chat: dict[str, Any], convert: Callable[[Any], list[dict[str, Any]]]) -> None:
    """The request's `tools` (when given) as chat tools by `convert`; none at all when that is empty."""
    if body.get("tools") is not None:
        tools = convert(body["tools"])
        if tools:
            chat["tools"] = tools


def function_tool(tool: dict[str, Any], at: str, schema_key: str, required: bool) -> dict[str, Any]:
    """A chat tool's `function` for the client tool `tool` (at `at`): its `name` (a non-empty string
    is required), `parameters` from the JSON schema object under `schema_key` (when given or
    `required`), its `description` when it is a string."""
    require(isinstance(tool.get("name"), str) and tool["name"], f"{at}.name must be a non-empty string", f"{at}.name")
    fn: dict[str, Any] = {"name": tool["name"]}
    schema = tool.get(schema_key)
    if required or schema is not None:
        require(isinstance(schema, dict), f"{at}.{schema_key} must be a JSON schema object", f"{at}.{schema_key}")
        fn["parameters"] = schema
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return fn


def stream_of(body: dict[str, Any], chat: dict[str, Any]) -> bool:
    """Whether the request streams (`stream`, a boolean when given); a streamed chat request asks for
    the usage chunk at its end (`stream_options.include_usage`)."""
    stream = body.get("stream")
    require(stream is None or isinstance(stream, bool), "stream must be a boolean", "stream")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return bool(stream)


class SseSplitter:
    """Complete SSE events out of arbitrary chunks; the tail of a partial event is kept until the next."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self._pending = data.split(b"\n\n")
        return [e for e in events if e.strip()]

    def flush(self) -> list[bytes]:
        """The last event of a stream that ended without its blank line (if any)."""
        rest, self._pending = self._pending, b""
        return [rest] if rest.strip() else []


def sse_data(event: bytes) -> bytes | None:
    """The `data:` payload of one event (several data lines joined by newlines); None without one."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def sse_event(name: str, data: Any) -> bytes:
    """One outgoing event: `event: <name>` and its JSON `data`."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def tool_input(arguments: Any) -> dict[str, Any]:
    """A chat tool call's `arguments` (JSON text) as an object; text that is not a JSON object is kept
    whole under `arguments` (models do emit broken JSON; the caller should see what it was)."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def text_of(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """The text of a string or of a list of text parts (`{"type": <one of kinds>, "text": ...}`)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise TranslationError(f"{where} must be a string or a list of content blocks", where)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in kinds or not isinstance(block.get("text"), str):
            raise TranslationError(f"{where}[{i}] must be a text block ({' or '.join(kinds)} with a string text)",
                                   f"{where}[{i}]")
        parts.append(block["text"])
    return "".join(parts)


def listed(value: Any) -> list[Any] | tuple[()]:
    """`value` when it is a list, else nothing to iterate (a backend's `choices: true` is not a crash)."""
    return value if isinstance(value, list) else ()


def named(value: Any, default: str = "") -> str:
    """`value` when it is a non-empty string, else `default`."""
    return value if isinstance(value, str) and value else default


def first_choice(chat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the first choice, its message) of a chat completion; empty dicts where they are missing."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    return choice, message


def function_calls(message: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(position, call, its function) of each well-formed tool call of a chat message."""
    for i, call in enumerate(listed(message.get("tool_calls"))):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            continue
        yield i, call, call["function"]


def reply_id(prefix: str, chat_id: Any, fallback: str) -> str:
    """`prefix` + the chat completion's id less its `chatcmpl-` (`fallback` when it has none)."""
    base = chat_id if isinstance(chat_id, str) and chat_id else fallback
    return prefix + base.removeprefix("chatcmpl-")


def usage_of(chunk: Any) -> tuple[int, int, int] | None:
    """(prompt, completion, cached prompt) tokens of a chat response or usage chunk; None without usage."""
    u = chunk.get("usage") if isinstance(chunk, dict) else None
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return _n(u.get("prompt_tokens")), _n(u.get("completion_tokens")), _n(cached)


def _n(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class ChatStream:
    """The walk over a chat stream's chunks that both stream translations share, chunk by chunk.

    The first chunk (or `done`/`error` before any) starts the reply (`_start`); a usage chunk's
    counts go to `usage`; of the first choice (index 0; other choices are skipped), a text delta goes
    to `_text`, a tool call's first fragment to `_tool_open` (which records the call's block or item
    index in `tools`), each argument fragment to `_tool_args` with that index, and its finish to
    `finish` / `matched` (vLLM's `stop_reason`) and `_close`. Malformed pieces (a `choices` or
    `tool_calls` that is not a list, a call or delta that is not an object) are skipped.
    """

    __slots__ = ("ctx", "request_id", "started", "tools", "finish", "matched", "usage", "ended")

    def __init__(self, ctx: dict[str, Any], request_id: str = ""):
        self.ctx = ctx
        self.request_id = request_id
        self.started = False
        self.tools: dict[int, int] = {}  # the chat tool call's index -> its block / output index
        self.finish: Any = None
        self.matched: Any = None
        self.usage: tuple[int, int, int] | None = None
        self.ended = False

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def _close(self) -> list[bytes]:
        raise NotImplementedError

    def _text(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def _tool_open(self, i: int, call: dict[str, Any], fn: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def _tool_args(self, index: int, args: str) -> list[bytes]:
        raise NotImplementedError

    def _begin(self, chunk: dict[str, Any]) -> list[bytes]:
        """`_start`'s events the first time, then none."""
        if self.started:
            return []
        self.started = True
        return self._start(chunk)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events for one chat chunk (possibly none)."""
        out = self._begin(chunk)
        u = usage_of(chunk)
        if u is not None:
            self.usage = u
        for choice in listed(chunk.get("choices")):
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content")
            if isinstance(text, str) and text:
                out += self._text(text)
            for call in listed(delta.get("tool_calls")):
                if not isinstance(call, dict):
                    continue
                i = call.get("index") if isinstance(call.get("index"), int) else 0
                fn = call.get("function") if isinstance(call.get("function"), dict) else {}
                if i not in self.tools:
                    out += self._tool_open(i, call, fn)
                args = fn.get("arguments")
                if isinstance(args, str) and args:
                    out += self._tool_args(self.tools[i], args)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                self.matched = choice.get("stop_reason")
                out += self._close()
        return out
