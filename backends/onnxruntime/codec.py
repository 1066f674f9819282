"""KServe v2 HTTP inference bodies <-> numpy: JSON tensors and Triton's binary tensor extension.

What: :func:`parse_infer_request` reads a ``POST .../infer`` body (JSON, or a JSON header of
``Inference-Header-Content-Length`` bytes followed by raw tensor bytes, each input's length given
by its ``binary_data_size`` parameter) into numpy arrays; :func:`encode_infer_response` writes
outputs back as JSON ``data`` or as binary (``binary_data_output`` on the request, or
``binary_data`` per requested output), exactly as ``tritonclient.http`` sends and expects.
BYTES tensors use Triton's layout: each element a 4-byte little-endian length, then its bytes.
Why: one place owns the wire format; the service sees only named numpy arrays.
Cost: binary tensors are zero-copy views of the request body (``np.frombuffer``); JSON tensors cost
a parse and one ``np.asarray`` each; responses are one ``orjson.dumps`` (numpy-native) plus a
``tobytes`` per binary output.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
import orjson

from .tensors import TensorError, datatype_of, numpy_dtype

__all__ = ["InferRequest", "InputTensor", "OutputRequest", "deserialize_bytes", "encode_infer_response",
           "error_body", "json_body", "parse_infer_request", "serialize_bytes"]

_LEN = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, slots=True)
class InputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class OutputRequest:
    name: str
    binary: bool


@dataclasses.dataclass(frozen=True, slots=True)
class InferRequest:
    """A parsed inference request; ``outputs`` is None when the client asked for all outputs."""

    id: str | None
    inputs: tuple[InputTensor, ...]
    outputs: tuple[OutputRequest, ...] | None
    binary_output: bool  # the request-level ``binary_data_output`` parameter


def serialize_bytes(array: np.ndarray) -> bytes:
    """Triton's BYTES layout: per element (row-major) a uint32 LE length, then the bytes."""
    parts = []
    for item in array.reshape(-1):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(buffer: bytes | memoryview, count: int, name: str) -> np.ndarray:
    """The inverse of :func:`serialize_bytes`: ``count`` elements as an object array of ``str``."""
    items: list[str] = []
    view, offset = memoryview(buffer), 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise TensorError(f"input '{name}': BYTES data ends inside an element length")
        (length,) = _LEN.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise TensorError(f"input '{name}': BYTES element of {length} bytes runs past the data")
        try:
            items.append(bytes(view[offset:offset + length]).decode("utf-8"))
        except UnicodeDecodeError:
            raise TensorError(f"input '{name}': BYTES element is not valid UTF-8") from None
        offset += length
    if len(items) != count:
        raise TensorError(f"input '{name}': {len(items)} BYTES elements for a shape of {count} elements")
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def _flatten_strings(data: Any, name: str) -> list[str]:
    out: list[str] = []
    stack = [data]
    while stack:  # iterative, so a deeply nested body cannot exhaust the Python stack
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, str):
            out.append(item)
        else:
            raise TensorError(f"input '{name}': BYTES data must be strings, got {type(item).__name__}")
    return out


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if (not isinstance(value, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value)):
        raise TensorError(f"input '{name}': shape must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _decode_input(raw: Any, binary: memoryview, offset: int) -> tuple[InputTensor, int]:
    if not isinstance(raw, dict):
        raise TensorError("every entry of 'inputs' must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise TensorError("an input has no 'name'")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str):
        raise TensorError(f"input '{name}': 'datatype' is missing")
    shape = _shape(raw.get("shape"), name)
    try:
        dtype = numpy_dtype(datatype)
    except TensorError as exc:
        raise TensorError(f"input '{name}': {exc}") from None
    count = math.prod(shape)
    parameters = raw.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise TensorError(f"input '{name}': 'parameters' must be an object")
    if "shared_memory_region" in parameters:
        raise TensorError(f"input '{name}': shared memory is not supported by this server")
    size = parameters.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TensorError(f"input '{name}': binary_data_size must be a non-negative integer")
        if offset + size > len(binary):
            raise TensorError(f"input '{name}': binary_data_size {size} runs past the end of the body "
                              f"({len(binary) - offset} bytes left)")
        chunk = binary[offset:offset + size]
        offset += size
        if datatype == "BYTES":
            array = deserialize_bytes(chunk, count, name)
        else:
            if size != count * dtype.itemsize:
                raise TensorError(f"input '{name}': {size} bytes of binary data for shape {list(shape)} "
                                  f"of {datatype} (expected {count * dtype.itemsize})")
            array = np.frombuffer(chunk, dtype=dtype.newbyteorder("<"))
    else:
        if "data" not in raw:
            raise TensorError(f"input '{name}': neither 'data' nor a binary_data_size parameter")
        data = raw["data"]
        try:
            if datatype == "BYTES":
                strings = _flatten_strings(data, name)
                array = np.empty(len(strings), dtype=object)
                array[:] = strings
            else:
                array = np.asarray(data, dtype=dtype)
        except (ValueError, TypeError, OverflowError) as exc:
            raise TensorError(f"input '{name}': data does not convert to {datatype}: {exc}") from None
        if array.size != count:
            raise TensorError(f"input '{name}': {array.size} data elements for shape {list(shape)} "
                              f"({count} elements)")
    return InputTensor(name, datatype, shape, array.reshape(shape)), offset


def parse_infer_request(body: bytes, header_length: int | None) -> InferRequest:
    """Parse a KServe v2 infer body; :class:`TensorError` (400) says what is wrong and where."""
    if header_length is not None:
        if not 0 <= header_length <= len(body):
            raise TensorError(f"Inference-Header-Content-Length {header_length} is outside the body "
                              f"of {len(body)} bytes")
        head, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        head, binary = body, memoryview(b"")
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise TensorError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise TensorError("request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise TensorError("'inputs' must be a non-empty list")
    inputs, offset, seen = [], 0, set()
    for raw in raw_inputs:
        tensor, offset = _decode_input(raw, binary, offset)
        if tensor.name in seen:
            raise TensorError(f"input '{tensor.name}' is given twice")
        seen.add(tensor.name)
        inputs.append(tensor)
    if offset != len(binary):
        raise TensorError(f"{len(binary) - offset} bytes of binary data are not claimed by any input's "
                          "binary_data_size")

    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise TensorError("'parameters' must be an object")
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise TensorError("parameter binary_data_output must be a boolean")

    outputs = None
    if "outputs" in doc:
        raw_outputs = doc["outputs"]
        if not isinstance(raw_outputs, list):
            raise TensorError("'outputs' must be a list")
        outputs, names = [], set()
        for raw in raw_outputs:
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                raise TensorError("every entry of 'outputs' must be an object with a 'name'")
            name = raw["name"]
            if name in names:
                raise TensorError(f"output '{name}' is requested twice")
            names.add(name)
            out_params = raw.get("parameters") or {}
            if not isinstance(out_params, dict):
                raise TensorError(f"output '{name}': 'parameters' must be an object")
            if out_params.get("classification"):
                raise TensorError(f"output '{name}': the classification extension is not supported")
            if "shared_memory_region" in out_params:
                raise TensorError(f"output '{name}': shared memory is not supported by this server")
            wants_binary = out_params.get("binary_data", binary_output)
            if not isinstance(wants_binary, bool):
                raise TensorError(f"output '{name}': binary_data must be a boolean")
            outputs.append(OutputRequest(name, wants_binary))
        outputs = tuple(outputs) or None  # an empty list means all outputs, as in Triton

    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise TensorError("'id' must be a string")
    return InferRequest(request_id, tuple(inputs), outputs, binary_output)


def _json_data(array: np.ndarray) -> Any:
    if array.dtype.kind in "OUS":
        return [item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
                for item in array.reshape(-1)]
    return np.ascontiguousarray(array).reshape(-1)  # orjson writes numpy arrays natively


def _binary_data(array: np.ndarray) -> bytes:
    if array.dtype.kind in "OUS":
        return serialize_bytes(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encode_infer_response(model_name: str, model_version: str, request_id: str | None,
                          outputs: Iterable[tuple[str, np.ndarray, bool]],
                          parameters: dict[str, Any] | None = None) -> tuple[bytes, int | None]:
    """Encode ``(name, array, binary)`` outputs; returns (body, JSON header length or None).

    When any output is binary the body is the JSON header followed by the raw tensors in output
    order, and the caller must send the header length as ``Inference-Header-Content-Length``.
    """
    entries: list[dict[str, Any]] = []
    buffers: list[bytes] = []
    for name, array, binary in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        if binary:
            raw = _binary_data(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            buffers.append(raw)
        else:
            entry["data"] = _json_data(array)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = parameters
    doc["outputs"] = entries
    head = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not buffers:
        return head, None
    return b"".join([head, *buffers]), len(head)


def error_body(message: str) -> bytes:
    """The KServe v2 error object."""
    return orjson.dumps({"error": message})


def json_body(doc: Any) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
