"""The backend adapter contract: how the processor speaks one model server's API.

What every adapter provides (checked for all kinds by tests/backends/test_contract.py on the same
golden fixtures):
- `encode(route, doc)`: the route's client document -> the backend request (path, JSON body);
- `decode(route, status, body)`: the backend's response -> the document a route's transform reads,
  `{"output": <model output>, "model": ..., "usage": {...}, "response": <raw backend JSON>}`;
- `usage(response_doc)`: tokens and batch size for metrics and quotas;
- `default_health_path`: what the health probe asks for;
- `metric_names`: the backend's own Prometheus metric names for queue depth, running requests and
  KV-cache / GPU use (data, not code, as in the endpoint picker's engine tables).
Why: the processor's stages stay protocol-agnostic; each backend's wire details live in one file.
Cost: encode/decode run on the request path: one JSON render and one JSON parse per request.

Layering: `backends` imports nothing from `extproc` (tests/test_layering.py checks it); the processor
imports `backends`. What an adapter must recognise from the processor's objects is defined here:
the errors `route.request.render()` and `route.mapping.forward()/.inverse()` raise
(`MissingPathError`, `MappingError`). `extproc.template` re-exports `MissingPathError` (the same
class) and `extproc.semantic.mapping.MappingError` subclasses `MappingError`, so an adapter catches
them without importing the processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol


@dataclass(frozen=True, slots=True)
class EncodedRequest:
    path: str
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class Usage:
    """What one request consumed: tokens for LLMs, batch size for tensor models."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    batch_size: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class MissingPathError(LookupError):
    """At render time, a path without a default resolved to nothing.

    ``path`` is the canonical text of the path (see `extproc.template.path_text`). Raised by the
    processor's templates (`extproc.template`, which re-exports this class) and mappings.
    """

    def __init__(self, path: str) -> None:
        super().__init__(f"path {path} not found in the document")
        self.path = path

    def __reduce__(self):
        return (type(self), (self.path,))


class MappingError(ValueError):
    """A field mapping failed: ``field`` names the mapping key (load time) or the document path of
    the value (run time). The processor's `extproc.semantic.mapping.MappingError` subclasses it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InputError(ValueError):
    """The client's document cannot be mapped (a request-template path is missing, a tensor has the
    wrong shape): 400 naming the field."""

    def __init__(self, code: str, message: str, path: str | None = None):
        super().__init__(message)
        self.code, self.message, self.path = code, message, path


class BackendError(RuntimeError):
    """The backend answered with something the route cannot map: 502 naming the backend."""

    def __init__(self, status: int, code: str, message: str, path: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.path = status, code, message, path


class BackendAdapter(Protocol):
    kind: ClassVar[str]
    api: ClassVar[str]  # "openai" or "kserve": which client-facing API paths pass through to it
    default_health_path: ClassVar[str]
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]]

    def encode(self, route: Any, doc: Any, metadata: Mapping[str, Any] | None = None) -> EncodedRequest:
        """`metadata`: the model's KServe metadata when the route fetched it (tensor routes)."""

    def decode(self, route: Any, status: int, body: bytes) -> dict[str, Any]: ...

    def usage(self, response: Any) -> Usage: ...
