"""A plain REST/JSON service (an existing API described by OpenAPI, or a legacy contract).

Wire protocol: whatever the service's contract says; the gateway's `tool` routes build each request
from the OpenAPI operation (extproc/semantic/toolcall.py) and `rest` routes forward the client's
path with the body mapped by a field-mapping file (extproc/semantic/mapping.py). So this adapter
has no model semantics: `encode`/`decode` apply the route's mapping (adapter schema <-> legacy
schema), and `usage` is empty.
Health probe path: `/` unless the backend sets `healthPath`.
Cost: one mapping render and conversion pass each way when the route has a mapping.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import orjson

from backends.base import BackendError, EncodedRequest, InputError, MappingError, MissingPathError, Usage


class RestAdapter:
    kind: ClassVar[str] = "rest"
    api: ClassVar[str] = "rest"
    default_health_path: ClassVar[str] = "/"
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})

    def encode(self, route: Any, doc: Any, metadata: Any = None) -> EncodedRequest:
        body = doc
        if route.mapping is not None:
            try:
                body = route.mapping.inverse(doc)
            except MissingPathError as e:
                raise InputError("missing_input_field", f"request field {e.path} is required by this route",
                                 path=e.path) from None
            except MappingError as e:
                raise InputError("invalid_field", str(e), path=getattr(e, "field", None)) from None
        return EncodedRequest("", orjson.dumps(body))

    def decode(self, route: Any, status: int, body: bytes) -> dict[str, Any]:
        try:
            resp = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            raise BackendError(502, "backend_bad_response", f"backend {route.backend.name} answered with no JSON") from None
        output = resp
        if route.mapping is not None:
            try:
                output = route.mapping.forward(resp)
            except MissingPathError as e:
                raise BackendError(502, "transform_path_missing", f"mapping: {e.path} not found in the service's "
                                   "response", path=e.path) from None
            except MappingError as e:
                raise BackendError(502, "mapping_failed", str(e), path=getattr(e, "field", None)) from None
        return {"output": output, "model": None, "usage": None, "response": resp}

    def usage(self, response: Any) -> Usage:
        return Usage()
