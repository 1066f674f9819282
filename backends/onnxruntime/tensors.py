"""Tensor datatypes and signatures: KServe v2 names, numpy dtypes and ONNX Runtime type strings.

What: the datatype table (``FP32`` <-> ``float32`` <-> ``tensor(float)``), :class:`TensorSpec`
(name, datatype, shape with -1 for a dynamic dimension) built from an ORT session, and
:func:`check_input`, which turns a client's tensor that does not fit the model into a
:class:`TensorError` naming the input (answered as 400).
Why: the HTTP and gRPC front ends and the repository's variant check share one definition of
"fits", so a wrong shape or datatype gives the same message on every protocol.
Cost: a dict lookup and a tuple compare per input per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = ["DATATYPES", "TensorError", "TensorSpec", "check_input", "datatype_of", "numpy_dtype",
           "spec_from_node_arg"]

# KServe v2 datatype -> (numpy dtype, ORT element type).  BF16 is not served: numpy has no
# bfloat16 and ORT's Python API takes none.
DATATYPES: Mapping[str, tuple[np.dtype, str]] = MappingProxyType({
    "BOOL": (np.dtype(np.bool_), "tensor(bool)"),
    "UINT8": (np.dtype(np.uint8), "tensor(uint8)"),
    "UINT16": (np.dtype(np.uint16), "tensor(uint16)"),
    "UINT32": (np.dtype(np.uint32), "tensor(uint32)"),
    "UINT64": (np.dtype(np.uint64), "tensor(uint64)"),
    "INT8": (np.dtype(np.int8), "tensor(int8)"),
    "INT16": (np.dtype(np.int16), "tensor(int16)"),
    "INT32": (np.dtype(np.int32), "tensor(int32)"),
    "INT64": (np.dtype(np.int64), "tensor(int64)"),
    "FP16": (np.dtype(np.float16), "tensor(float16)"),
    "FP32": (np.dtype(np.float32), "tensor(float)"),
    "FP64": (np.dtype(np.float64), "tensor(double)"),
    "BYTES": (np.dtype(object), "tensor(string)"),
})
_BY_ORT = MappingProxyType({ort_type: name for name, (_, ort_type) in DATATYPES.items()})
_BY_NUMPY = MappingProxyType({dtype: name for name, (dtype, _) in DATATYPES.items()})


class TensorError(ValueError):
    """A client's tensor does not fit (unknown datatype, wrong shape, bad data): HTTP 400."""


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        return DATATYPES[datatype][0]
    except KeyError:
        raise TensorError(f"unsupported datatype {datatype!r}; supported: {', '.join(DATATYPES)}") from None


def datatype_of(array: np.ndarray) -> str:
    """The KServe datatype of a numpy array (strings and bytes are BYTES)."""
    if array.dtype.kind in "OUS":
        return "BYTES"
    try:
        return _BY_NUMPY[array.dtype]
    except KeyError:
        raise TensorError(f"numpy dtype {array.dtype} has no KServe v2 datatype") from None


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output as KServe v2 metadata shows it (-1 marks a dynamic dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def batch_dynamic(self) -> bool:
        """True when the first dimension is dynamic, so requests can be stacked along it."""
        return bool(self.shape) and self.shape[0] == -1

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def spec_from_node_arg(arg: Any) -> TensorSpec:
    """A :class:`TensorSpec` from an ``onnxruntime.NodeArg`` (symbolic or unknown dims become -1)."""
    try:
        datatype = _BY_ORT[arg.type]
    except KeyError:
        raise TensorError(f"tensor {arg.name!r} has ORT type {arg.type}, which KServe v2 cannot carry") from None
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or ()))
    return TensorSpec(arg.name, datatype, shape)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_input(spec: TensorSpec, datatype: str, shape: Sequence[int]) -> None:
    """Raise :class:`TensorError` naming the input when (datatype, shape) does not fit ``spec``."""
    if datatype != spec.datatype:
        raise TensorError(f"input '{spec.name}': datatype {datatype} does not match the model's "
                          f"{spec.datatype}")
    if len(shape) != len(spec.shape) or any(want not in (-1, got) for want, got in zip(spec.shape, shape)):
        raise TensorError(f"input '{spec.name}': shape {_shape_text(shape)} does not match the model's "
                          f"{_shape_text(spec.shape)} (-1 is any size)")
