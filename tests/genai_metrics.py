"""The GenAI histograms' Prometheus names against the OpenTelemetry GenAI conventions' names, for the
tests that compare the processor's Prometheus series with what an OTLP collector received
(tests/extproc/test_genai_otlp.py in process, tests/e2e/test_genai_otlp.py through Envoy).

No OpenTelemetry import here: the in-process test checks that a worker with OTLP off imports none.
"""

from __future__ import annotations

PROMETHEUS = {"gen_ai_server_request_duration_seconds": "gen_ai.server.request.duration",
              "gen_ai_server_time_to_first_token_seconds": "gen_ai.server.time_to_first_token",
              "gen_ai_server_time_per_output_token_seconds": "gen_ai.server.time_per_output_token",
              "gen_ai_client_token_usage": "gen_ai.client.token.usage"}
LABELS = {"gen_ai_operation_name": "gen_ai.operation.name", "gen_ai_provider_name": "gen_ai.provider.name",
          "gen_ai_request_model": "gen_ai.request.model", "server_address": "server.address",
          "server_port": "server.port", "error_type": "error.type", "gen_ai_token_type": "gen_ai.token.type",
          "estimated": "estimated"}


def histogram_points(samples) -> dict:
    """{(otel name, attributes as the OTLP side has them): {"count": ..., "sum": ..., "buckets": {le: cumulative
    count}}} of the GenAI histograms among Prometheus `samples` (tests/promtext.py's `Samples`); a key is there
    only for the parts that had samples."""
    out: dict = {}
    for (name, labels), value in samples.items():
        for prom, otel in PROMETHEUS.items():
            if not name.startswith(prom + "_"):
                continue
            part = name[len(prom) + 1:]
            if part not in ("count", "sum", "bucket"):
                continue
            labels = dict(labels)
            le = labels.pop("le", None)
            attrs = {LABELS[k]: v for k, v in labels.items() if v != ""}
            if "server.port" in attrs:
                attrs["server.port"] = int(attrs["server.port"])
            if "estimated" in attrs:
                attrs["estimated"] = attrs["estimated"] == "true"
            entry = out.setdefault((otel, tuple(sorted(attrs.items()))), {"buckets": {}})
            if part == "bucket":
                entry["buckets"][float(le)] = value
            else:
                entry[part] = value
    return out
