"""What the client-API translations share: their input error, SSE framing, tool arguments.

What: `TranslationError` is a client mistake found while translating a request (status 400 and a
`param` naming the field); the stage turns it into a `Reject`, rendered in the route's dialect.
`SseSplitter` cuts a byte stream into complete SSE events as chunks arrive (a partial event waits
for the next chunk; nothing else is held); `sse_data` reads an event's `data:` payload;
`sse_event` frames one outgoing event. `tool_input` parses a chat tool call's `arguments` text.
Cost: per chunk one `split` over the new bytes; per event one slice.
"""

from __future__ import annotations

from typing import Any

import orjson


class TranslationError(ValueError):
    """The client's request cannot be translated: a 4xx naming the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


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
