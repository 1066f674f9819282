"""The KServe v2 gRPC front end (``inference.GRPCInferenceService``), sharing the HTTP server's models.

What: a ``grpc.aio`` servicer for ServerLive, ServerReady, ServerMetadata, ModelReady,
ModelMetadata, ModelConfig, ModelInfer, RepositoryIndex, RepositoryModelLoad and
RepositoryModelUnload over :class:`.service.InferenceService`.  Inputs come as
``raw_input_contents`` (what ``tritonclient.grpc`` sends) or typed ``contents``; outputs always go
back as ``raw_output_contents``, as Triton does.  Errors map 400 -> INVALID_ARGUMENT,
404 -> NOT_FOUND, 503 -> UNAVAILABLE, 500 -> INTERNAL, with the same messages as over HTTP.
Not served (UNIMPLEMENTED): ModelStreamInfer, statistics, shared memory, trace and log settings.
The messages are the generated classes ``tritonclient[grpc]`` ships
(``tritonclient.grpc.service_pb2``), so no protos are compiled here.

Why: Triton's clients and Envoy's gRPC routing speak this protocol; the service underneath is
the HTTP server's, so both protocols share models, batchers and metrics.
Cost: protobuf parse and build (upb) plus a ``np.frombuffer`` per raw input; it runs in the same
event loop as the HTTP front end.
"""

from __future__ import annotations

import logging
import math
import time
from types import MappingProxyType

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from .codec import deserialize_bytes, serialize_bytes
from .service import InferenceService, ServiceError
from .tensors import TensorError, datatype_of, numpy_dtype

__all__ = ["KServeGrpcServicer", "start_grpc_server"]

log = logging.getLogger("backends.onnxruntime.grpc")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CODES = MappingProxyType({400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                          503: grpc.StatusCode.UNAVAILABLE})
# KServe datatype -> the typed ``InferTensorContents`` field that carries it.
_CONTENTS_FIELD = MappingProxyType({
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents", "BYTES": "bytes_contents",
})


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError) -> None:
    await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)


def _version(value: str) -> str | None:
    return value or None


def _decode_inputs(request: service_pb2.ModelInferRequest) -> dict[str, tuple[str, np.ndarray]]:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise TensorError(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    inputs: dict[str, tuple[str, np.ndarray]] = {}
    for index, tensor in enumerate(request.inputs):
        name, datatype, shape = tensor.name, tensor.datatype, tuple(tensor.shape)
        if name in inputs:
            raise TensorError(f"input '{name}' is given twice")
        if any(d < 0 for d in shape):
            raise TensorError(f"input '{name}': shape {list(shape)} has a negative dimension")
        try:
            dtype = numpy_dtype(datatype)
        except TensorError as exc:
            raise TensorError(f"input '{name}': {exc}") from None
        count = math.prod(shape)
        if raw:
            data = raw[index]
            if datatype == "BYTES":
                array = deserialize_bytes(data, count, name)
            else:
                if len(data) != count * dtype.itemsize:
                    raise TensorError(f"input '{name}': {len(data)} raw bytes for shape {list(shape)} of "
                                      f"{datatype} (expected {count * dtype.itemsize})")
                array = np.frombuffer(data, dtype=dtype.newbyteorder("<"))
        else:
            field = _CONTENTS_FIELD.get(datatype)
            if field is None:
                raise TensorError(f"input '{name}': {datatype} must be sent in raw_input_contents")
            values = getattr(tensor.contents, field)
            if datatype == "BYTES":
                try:
                    items = [v.decode("utf-8") for v in values]
                except UnicodeDecodeError:
                    raise TensorError(f"input '{name}': BYTES element is not valid UTF-8") from None
                array = np.empty(len(items), dtype=object)
                array[:] = items
            else:
                try:
                    array = np.asarray(values, dtype=dtype)
                except (ValueError, OverflowError) as exc:
                    raise TensorError(f"input '{name}': contents do not convert to {datatype}: {exc}") from None
            if array.size != count:
                raise TensorError(f"input '{name}': {array.size} elements in contents for shape {list(shape)}")
        inputs[name] = (datatype, array.reshape(shape))
    return inputs


class KServeGrpcServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """KServe v2 gRPC over an :class:`InferenceService`."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def ServerLive(self, request, context):  # noqa: N802 - gRPC method names
        return service_pb2.ServerLiveResponse(live=self.service.live())

    async def ServerReady(self, request, context):  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=self.service.ready())

    async def ServerMetadata(self, request, context):  # noqa: N802
        meta = self.service.server_metadata()
        return service_pb2.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                                  extensions=meta["extensions"])

    async def ModelReady(self, request, context):  # noqa: N802
        try:
            ready = self.service.model_ready(request.name, _version(request.version))
        except ServiceError as exc:
            await _abort(context, exc)
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ModelMetadata(self, request, context):  # noqa: N802
        try:
            meta = self.service.model_metadata(request.name, _version(request.version))
        except ServiceError as exc:
            await _abort(context, exc)
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["outputs"]])

    async def ModelConfig(self, request, context):  # noqa: N802
        try:
            config = self.service.model_config(request.name, _version(request.version))
        except ServiceError as exc:
            await _abort(context, exc)
        message = json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        return service_pb2.ModelConfigResponse(config=message)

    async def RepositoryIndex(self, request, context):  # noqa: N802
        entries = self.service.repository_index(request.ready)
        return service_pb2.RepositoryIndexResponse(models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(
                name=e["name"], version=e.get("version", ""), state=e["state"], reason=e.get("reason", ""))
            for e in entries])

    async def RepositoryModelLoad(self, request, context):  # noqa: N802
        try:
            await self.service.load_model(request.model_name)
        except ServiceError as exc:
            await _abort(context, exc)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):  # noqa: N802
        try:
            await self.service.unload_model(request.model_name)
        except ServiceError as exc:
            await _abort(context, exc)
        return service_pb2.RepositoryModelUnloadResponse()

    async def ModelInfer(self, request, context):  # noqa: N802
        started = time.perf_counter()
        name, version = request.model_name, _version(request.model_version)
        status = "success"
        try:
            self.service.resolve(name, version)
            try:
                inputs = _decode_inputs(request)
            except TensorError as exc:
                raise ServiceError(400, str(exc)) from None
            wanted = [o.name for o in request.outputs] or None
            if wanted is not None and len(set(wanted)) != len(wanted):
                raise ServiceError(400, "an output is requested twice")
            model, outputs = await self.service.infer(name, version, inputs, wanted)
            response = service_pb2.ModelInferResponse(model_name=name, model_version=model.version,
                                                      id=request.id)
            precision, fallback = model.served_precision()
            response.parameters["precision"].string_param = precision or ""
            if fallback:
                response.parameters["precision_fallback"].string_param = fallback
            for out_name, array in outputs:
                response.outputs.add(name=out_name, datatype=datatype_of(array), shape=array.shape)
                if array.dtype.kind in "OUS":
                    response.raw_output_contents.append(serialize_bytes(array))
                else:
                    response.raw_output_contents.append(
                        np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes())
        except ServiceError as exc:
            status = exc.label
            self.service.record_request(name, status)
            await _abort(context, exc)
        except Exception as exc:
            log.exception("model %s: gRPC inference failed", name)
            self.service.record_request(name, "error")
            await context.abort(grpc.StatusCode.INTERNAL, f"inference failed: {exc}")
        self.service.record_request(name, status, time.perf_counter() - started)
        return response


async def start_grpc_server(service: InferenceService, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC front end; returns the server and its real port (``port`` 0 picks one)."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeGrpcServicer(service), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    return server, bound
