"""extproc/precision.py: what a KServe answer says about its precision, as bounded label values."""

from __future__ import annotations

import pytest

from extproc.precision import from_response, headers


@pytest.mark.parametrize("response, expected", [
    ({"parameters": {"precision": "int8"}}, ("int8", "none")),
    ({"parameters": {"precision": "FP16", "precision_fallback": "int8:missing"}}, ("fp16", "int8:missing")),
    ({"parameters": {"precision": "fp32", "precision_fallback": "int8:load_error,fp16:warmup_error"}},
     ("fp32", "int8:load_error,fp16:warmup_error")),
    ({"outputs": []}, ("unknown", "unknown")),  # Triton: says nothing
    ({"parameters": {"precision": "int3"}}, ("other", "none")),
    ({"parameters": {"precision": "fp32", "precision_fallback": "int8:cosmic_ray,x:missing"}}, ("fp32", "other,other")),
    ("not a dict", ("unknown", "unknown")),
])
def test_from_response_bounds_the_values(response, expected) -> None:
    assert from_response("onnxruntime", response) == expected


def test_headers_leave_out_an_absent_fallback() -> None:
    assert headers("int8", "none") == (("x-adapter-precision", "int8"),)
    assert headers("unknown", "unknown") == (("x-adapter-precision", "unknown"),)
    assert headers("fp16", "int8:missing")[1] == ("x-adapter-precision-fallback", "int8:missing")
