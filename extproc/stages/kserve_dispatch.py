"""Stage `kserve-parse`: the model of a KServe v2 request, from its path, for dispatch.

What: on a `kserve` route (for example `path: /v2, match: prefix`), `/v2/models/{model}[/versions/
{v}]/...` names the model (`state.request`, `extproc/request.py`); `dispatch` then sends it to the
first target that lists the model (a target with no `models` serves any) and answers an unknown
model with a 404 in KServe's error shape (`{"error": "..."}`, what tritonclient reports). Paths
without a model (`/v2/health/ready`, `/v2`, `/v2/repository/index`) and gRPC calls
(`/inference.GRPCInferenceService/...`, whose model is inside the protobuf body) go to the route's
first target. Bodies are never read: binary tensors pass through untouched.
Cost: one path split in the request-headers reply; one round trip.
"""

from __future__ import annotations

from extproc.request import parse_kserve
from extproc.types import HttpMessage, RequestState, Verdict


class KServeParse:
    name = "kserve-parse"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        path = (msg.headers or {}).get(":path", "")
        state.request = parse_kserve(path, tenant=state.tenant)
        return None
