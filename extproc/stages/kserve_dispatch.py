"""Stage `kserve-dispatch`: KServe v2 paths through the gateway to the backend serving the model.

What: on a `kserve` route (for example `path: /v2, match: prefix`), `/v2/models/{model}[/versions/
{v}]/...` goes to the first target that lists `model` (a target with no `models` serves any); an
unknown model is a 404 in KServe's error shape (`{"error": "..."}`, what tritonclient reports).
Paths without a model (`/v2/health/ready`, `/v2`, `/v2/repository/index`) and gRPC calls
(`/inference.GRPCInferenceService/...`, whose model is inside the protobuf body) go to the route's
first target. Bodies are never read: binary tensors pass through untouched.
Cost: one path split in the request-headers reply; one round trip.
"""

from __future__ import annotations

import orjson

from extproc.stages.select_backend import route_to
from extproc.types import HttpMessage, Reject, RequestState, Verdict


class KServeDispatch:
    name = "kserve-dispatch"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict:
        path = (msg.headers or {}).get(":path", "").split("?", 1)[0]
        parts = path.strip("/").split("/")
        route = state.route
        if len(parts) >= 3 and parts[0] == "v2" and parts[1] == "models" and parts[2]:
            model = parts[2]
            state.attrs["model"] = model
            backend = route.backend_for_model(model)
            if backend is None:
                body = orjson.dumps({"error": f"Request for unknown model: '{model}' is not found "
                                              f"(served through this gateway: {', '.join(route.models) or 'none'})"})
                return Reject(404, body, "model_not_found")
            return route_to(state, backend)
        return route_to(state, route.backend)
