"""KServe v2 inference protocol backends: Triton, and our ONNX Runtime server.

Wire protocol: `POST /v2/models/{model}/infer` with
`{"inputs": [{"name", "datatype", "shape", "data"}]}` (JSON tensors; the gateway always asks for
JSON outputs), answered with `{"model_name", "outputs": [{"name", "datatype", "shape", "data"}]}`.
For a route (kind `tensor`), the client's JSON (or the route's `request` template output) is a
mapping from input name to a (nested) list; the adapter flattens each to `data`, derives `shape`,
and takes `datatype` from the model's metadata (`GET /v2/models/{model}`), checking rank, fixed
dimensions and element types against it: a mismatch is a 400 naming the input. Outputs come back
as `{"output": {name: nested list}, "usage": {"batch_size": n}, ...}` for the route's transform.
Plain KServe paths (`/v2/...`) are passed through untouched by a `kserve` route, so
`tritonclient` pointed at the gateway works, binary tensor extension included.
Health probe path: `/v2/health/ready`.
Cost per request: one flatten of each input (O(elements)), one JSON encode; on the way back one
JSON parse and one reshape per output.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import orjson

from backends.base import BackendError, EncodedRequest, InputError, MissingPathError, Usage

_FLOAT = ("FP16", "FP32", "FP64", "BF16")
_INT = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")


def _flatten(value: Any, name: str) -> tuple[list[Any], list[int]]:
    """Nested lists -> (flat data, shape); ragged lists are refused."""
    if not isinstance(value, list):
        return [value], []
    if not value:
        return [], [0]
    parts = [_flatten(v, name) for v in value]
    inner = parts[0][1]
    if any(p[1] != inner for p in parts):
        raise InputError("invalid_tensor", f"input {name}: ragged nested lists cannot form a tensor", path=name)
    return [x for p in parts for x in p[0]], [len(value), *inner]


def _infer_datatype(data: list[Any]) -> str:
    if all(isinstance(x, bool) for x in data):
        return "BOOL"
    if all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        return "INT64"
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in data):
        return "FP32"
    return "BYTES"


def _check_elements(name: str, datatype: str, data: list[Any]) -> None:
    if datatype in _FLOAT:
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in data)
    elif datatype in _INT:
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in data)
    elif datatype == "BOOL":
        ok = all(isinstance(x, bool) for x in data)
    else:
        ok = all(isinstance(x, str) for x in data)
    if not ok:
        raise InputError("invalid_tensor", f"input {name}: the model expects {datatype} elements", path=name)


def _reshape(data: list[Any], shape: list[int]) -> Any:
    if not shape:
        return data[0] if data else None
    if len(shape) == 1:
        return list(data)
    step = len(data) // shape[0] if shape[0] else 0
    return [_reshape(data[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


class KServeAdapter:
    kind: ClassVar[str] = "kserve"
    api: ClassVar[str] = "kserve"
    default_health_path: ClassVar[str] = "/v2/health/ready"
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})

    def encode(self, route: Any, doc: Any, metadata: Mapping[str, Any] | None = None) -> EncodedRequest:
        if route.request is not None:
            try:
                tensors = route.request.render(doc)
            except MissingPathError as e:
                raise InputError("missing_input_field", f"request field {e.path} is required by this route",
                                 path=e.path) from None
        else:
            tensors = doc
        if not isinstance(tensors, dict) or not tensors:
            raise InputError("invalid_tensor", "expected a JSON object mapping input names to (nested) lists")
        declared = {i["name"]: i for i in (metadata or {}).get("inputs", ())}
        if declared:
            unknown = sorted(set(tensors) - set(declared))
            if unknown:
                raise InputError("unknown_input", f"model {route.model} has no input {unknown[0]!r} "
                                 f"(inputs: {', '.join(sorted(declared))})", path=unknown[0])
            missing = sorted(set(declared) - set(tensors))
            if missing:
                raise InputError("missing_input", f"input {missing[0]} is required by model {route.model}",
                                 path=missing[0])
        inputs = []
        for name, value in tensors.items():
            data, shape = _flatten(value, name)
            meta = declared.get(name)
            if meta is not None:
                datatype = meta["datatype"]
                want = list(meta.get("shape") or [])
                if len(want) != len(shape) or any(w not in (-1, s) for w, s in zip(want, shape)):
                    raise InputError("invalid_tensor", f"input {name}: shape {shape} does not match the model's "
                                     f"{want} (-1 is any size)", path=name)
                _check_elements(name, datatype, data)
            else:
                datatype = _infer_datatype(data)
            inputs.append({"name": name, "datatype": datatype, "shape": shape, "data": data})
        return EncodedRequest(f"/v2/models/{route.model}/infer", orjson.dumps({"inputs": inputs}))

    def decode(self, route: Any, status: int, body: bytes) -> dict[str, Any]:
        try:
            resp = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            resp = None
        name = route.backend.name
        if status >= 400:
            detail = resp.get("error") if isinstance(resp, dict) else None
            raise BackendError(status if status < 500 else 502, "backend_error",
                               f"backend {name} answered HTTP {status}" + (f": {detail}" if detail else ""))
        if not isinstance(resp, dict) or not isinstance(resp.get("outputs"), list):
            raise BackendError(502, "backend_bad_response", f"backend {name} response has no outputs list")
        outputs = {}
        for out in resp["outputs"]:
            try:
                outputs[out["name"]] = _reshape(list(out["data"]), list(out["shape"]))
            except (KeyError, TypeError, ZeroDivisionError):
                raise BackendError(502, "backend_bad_response", f"backend {name} sent a malformed output tensor") from None
        usage = self.usage(resp)
        return {"output": outputs, "model": resp.get("model_name"), "usage": {"batch_size": usage.batch_size},
                "response": resp}

    def usage(self, response: Any) -> Usage:
        try:
            return Usage(batch_size=int(response["outputs"][0]["shape"][0]))
        except (KeyError, IndexError, TypeError, ValueError):
            return Usage()


class TritonAdapter(KServeAdapter):
    """NVIDIA Triton Inference Server (HTTP :8000, gRPC :8001, metrics :8002)."""

    kind: ClassVar[str] = "triton"
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "queue_depth": ("nv_inference_pending_request_count",),
        "gpu_utilisation": ("nv_gpu_utilization",),
        "gpu_memory_used_bytes": ("nv_gpu_memory_used_bytes",),
        "batches": ("nv_inference_exec_count",),
    })


class OnnxRuntimeAdapter(KServeAdapter):
    """Our ONNX Runtime KServe v2 server (backends/onnxruntime), with dynamic batching."""

    kind: ClassVar[str] = "onnxruntime"
    metric_names: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "queue_time": ("ort_queue_time_seconds",),
        "batch_size": ("ort_batch_size",),
        "inference_time": ("ort_inference_time_seconds",),
    })
