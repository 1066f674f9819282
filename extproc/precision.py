"""The precision a tensor answer was computed in, and why it is not the preferred one.

What: `from_response(backend_kind, response)` reads what the backend reported in a KServe v2 answer:
our ONNX Runtime server (backends/onnxruntime) sets the response parameters `precision` (int8, fp16,
fp32) and, when a variant before it in the model's `precision_order` is missing or failed,
`precision_fallback` ("int8:missing", "int8:load_error,fp16:warmup_error"). Triton and other KServe
servers report neither: "unknown". The decode-response stage puts the result on the client's answer
(`x-adapter-precision`, `x-adapter-precision-fallback`) and counts
`adapter_processor_precision_total{route,backend,precision,fallback}`.
Label values are bounded: a precision outside `PRECISIONS` becomes "other", a fallback step whose
variant or reason is unknown becomes "other" (a backend never chooses a label value freely).
kserve routes (passthrough: the processor never sees the answer) get the same headers from Envoy,
copied from the server's `x-inference-precision*` headers (`extproc/envoy_render.py`), and are not
counted here (the server's own `ort_model_active_precision` / `ort_model_fallback_total` cover them).
Cost: two dict lookups and a split per answer.
"""

from __future__ import annotations

from typing import Any

PRECISION_HEADER = "x-adapter-precision"
FALLBACK_HEADER = "x-adapter-precision-fallback"
# what our ONNX Runtime server sets (backends/onnxruntime/server.py); Envoy copies them on kserve routes
SERVER_PRECISION_HEADER = "x-inference-precision"
SERVER_FALLBACK_HEADER = "x-inference-precision-fallback"
PRECISIONS = frozenset({"int8", "uint8", "fp8", "fp16", "bf16", "fp32", "fp64"})
REASONS = frozenset({"missing", "load_error", "signature_mismatch", "warmup_error", "run_error"})
UNKNOWN = "unknown"
NONE = "none"  # the preferred variant answered


def _step(step: str) -> str:
    precision, _, reason = step.partition(":")
    if precision in PRECISIONS and reason in REASONS:
        return step
    return "other"


def from_response(backend_kind: str, response: Any) -> tuple[str, str]:
    """(precision, fallback) of one decoded KServe v2 answer; fallback is "none" when the preferred
    variant answered, "unknown" when the backend does not say."""
    params = response.get("parameters") if isinstance(response, dict) else None
    precision = params.get("precision") if isinstance(params, dict) else None
    if not isinstance(precision, str) or not precision:
        return UNKNOWN, UNKNOWN
    precision = precision.lower()
    if precision not in PRECISIONS:
        precision = "other"
    fallback = params.get("precision_fallback")
    if not isinstance(fallback, str) or not fallback:
        return precision, NONE
    return precision, ",".join(_step(s.strip().lower()) for s in fallback.split(",") if s.strip()) or NONE


def headers(precision: str, fallback: str) -> tuple[tuple[str, str], ...]:
    """The answer's headers: the precision always; the fallback only when there was one."""
    if fallback in (NONE, UNKNOWN):
        return ((PRECISION_HEADER, precision),)
    return ((PRECISION_HEADER, precision), (FALLBACK_HEADER, fallback))
