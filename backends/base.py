"""The backend adapter contract: how the processor speaks one model server's API.

What: `encode_llm` turns a route's client document into the backend request (path and JSON body);
`decode_llm` turns the backend's response into the document a route's transform reads:
`{"output": <model output>, "model": ..., "usage": {...}, "response": <raw backend JSON>}`.
Why: the processor's stages stay protocol-agnostic; each backend's wire details live in one file.
Cost: encode/decode run on the request path: one JSON render and one JSON parse per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True, slots=True)
class EncodedRequest:
    path: str
    body: bytes
    content_type: str = "application/json"


class InputError(ValueError):
    """The client's document cannot be mapped (for example a request-template path is missing): 400."""

    def __init__(self, code: str, message: str, path: str | None = None):
        super().__init__(message)
        self.code, self.message, self.path = code, message, path


class BackendError(RuntimeError):
    """The backend answered with an error or with something the route cannot map: 502 (or its 4xx)."""

    def __init__(self, status: int, code: str, message: str, path: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.path = status, code, message, path


class BackendAdapter(Protocol):
    kind: ClassVar[str]
    default_health_path: ClassVar[str]

    def encode_llm(self, route: Any, doc: Any) -> EncodedRequest: ...

    def decode_llm(self, route: Any, status: int, body: bytes) -> dict[str, Any]: ...
