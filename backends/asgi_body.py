"""Reading a whole ASGI request body with a size limit: shared by our ASGI servers.

What: `read_body(receive, limit)` returns the body, raising `Disconnected` if the client goes away
first and `BodyTooLarge` past `limit` bytes (before buffering more). Each server maps those to its
own error shape (KServe's `{"error"}`, OpenAI's `{"error": {...}}`).
Cost: one join of the received chunks.
"""

from __future__ import annotations

from typing import Callable


class Disconnected(Exception):
    """The client went away before the body was complete."""


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body larger than {limit} bytes")
        self.limit = limit


async def read_body(receive: Callable, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        if message["type"] != "http.request":
            continue
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
