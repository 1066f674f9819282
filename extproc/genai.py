"""GenAI metrics by the OpenTelemetry semantic conventions, as Prometheus metrics (a lifecycle observer).

What: when a request to an LLM backend ends (`on_done`), `GenAiObserver` records the OpenTelemetry
GenAI semantic conventions' metrics (open-telemetry/semantic-conventions docs/gen-ai/gen-ai-metrics.md,
status Development; `OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental` names), with their
advised bucket boundaries, under the Prometheus names the OTel-to-Prometheus rules give (dots to
underscores, the unit `s` as a `_seconds` suffix, the annotation unit `{token}` dropped):

| OTel metric | Prometheus histogram | buckets | recorded |
|---|---|---|---|
| gen_ai.server.request.duration | gen_ai_server_request_duration_seconds | 0.01 x 2^k .. 81.92 s | every request (error_type set when not OK) |
| gen_ai.server.time_to_first_token | gen_ai_server_time_to_first_token_seconds | 0.001 .. 10 s (16) | OK streamed requests: the first response body the stream saw (the first SSE event) |
| gen_ai.server.time_per_output_token | gen_ai_server_time_per_output_token_seconds | 0.01 .. 2.5 s (13) | OK streamed requests with more than one output token: (duration - TTFT) / (output tokens - 1) |
| gen_ai.client.token.usage | gen_ai_client_token_usage | 1, 4, ..., 4^13 | OK requests: input and output tokens (`gen_ai_token_type`) |

Labels (the conventions' attributes, dots as underscores; an empty value is Prometheus' "absent"):
`gen_ai_operation_name` (`chat` for chat completions, Anthropic messages, the Responses API and the
adapter's own LLM routes, whose backend call is a chat; `text_completion`; `embeddings`),
`gen_ai_provider_name` (the backend's kind: `openai` for an OpenAI-compatible server, `vllm`: a custom
value, as the conventions allow for self-hosted engines), `gen_ai_request_model` (the request's model
when the route's config names it, `other` otherwise: never a client-chosen value), `server_address` and
`server_port` (the endpoint that served: Envoy's upstream address, else the processor's pick; empty
when unknown), on the duration `error_type` (the HTTP status when 400 or more, else the outcome:
`timeout`, `truncated`, `cancelled`, `backend_error`; empty for OK), on token usage
`gen_ai_token_type` (`input`, `output`) and **`estimated`** (not a convention attribute: `true` when
the backend reported no usage and the count is the gateway's estimate: input = prompt characters / 4,
output = the SSE events with a JSON payload the stream saw (about one token each), else the answer's
text characters / 4; `false` for the backend's own count).
Which requests: those with a parsed inference request (`state.request`: OpenAI, Anthropic, Responses,
or an adapter LLM route's document) sent to a backend of kind `openai` or `vllm`; tensor and REST
backends are not generative and get none. Bounded cardinality: every label value comes from the
config or a small fixed set.
Over OTLP too (`spec.otlpMetrics`, extproc/genai_otlp.py, docs/operations.md "GenAI metrics over
OTLP"): the same values, recorded at the same point into a second sink, under the conventions' own
names, units, boundaries and attributes.
Cost: at `on_done`, off the request path: a few dict lookups and up to five buffered observations
(`Pending`, written every 250 ms like the other request metrics); nothing per message. OTLP off: one
None check more; on: up to five OpenTelemetry SDK histogram records (the export runs in its thread).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from extproc.types import Outcome, RequestState

GENERATIVE_KINDS = frozenset({"openai", "vllm"})
OPERATIONS = {"openai.chat": "chat", "anthropic.messages": "chat", "openai.responses": "chat", "document": "chat",
              "openai.completions": "text_completion", "openai.embeddings": "embeddings"}
ESTIMATED_EVENTS_ATTR = "genai.sse_events"  # state.attrs: SSE events with a JSON payload the stream saw
ANSWER_ATTR = "genai.answer"  # state.attrs: an llm route's backend answer without usage (for the estimate)


def split_address(address: str | None) -> tuple[str, str]:
    """("host", "port") of "host:port" (IPv6 in brackets kept whole), ("", "") when unknown."""
    if not address:
        return "", ""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address, ""
    return host, port


def estimate_output_tokens(state: RequestState) -> int | None:
    """The gateway's estimate of a response's output tokens when the backend reported no usage."""
    events = state.attrs.get(ESTIMATED_EVENTS_ATTR)
    if events:
        return max(0, events - 1)  # the last JSON event of an OpenAI stream is usually the finish chunk
    # openai-usage keeps a JSON answer's bytes (up to its limit); decode-response an llm route's answer
    # when the backend reported no usage
    pending = state.attrs.get("pending") or state.attrs.get(ANSWER_ATTR)
    if not pending or state.attrs.get("sse"):
        return None
    try:
        doc = orjson.loads(pending)
    except orjson.JSONDecodeError:
        return None
    chars = 0
    for choice in (doc.get("choices") or ()) if isinstance(doc, dict) else ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if isinstance(text, str):
            chars += len(text)
    return chars // 4 if chars else None


class PrometheusSink:
    """The `GenAiSink` of the Prometheus histograms (extproc/metrics.py): buffered in `pending`."""

    __slots__ = ("metrics", "pending", "child")

    def __init__(self, metrics: Any, pending: Any, child: Any):
        self.metrics = metrics
        self.pending = pending
        self.child = child  # RequestObserver.child: the labelled children, cached

    def duration(self, key: tuple, error: str, seconds: float) -> None:
        self.pending.observe(self.child(self.metrics.genai_request_duration, *key, error), seconds)

    def tokens(self, key: tuple, token_type: str, estimated: bool, count: int) -> None:
        self.pending.observe(self.child(self.metrics.genai_token_usage, *key, token_type,
                                        "true" if estimated else "false"), count)

    def ttft(self, key: tuple, seconds: float) -> None:
        self.pending.observe(self.child(self.metrics.genai_ttft, *key), seconds)

    def tpot(self, key: tuple, seconds: float) -> None:
        self.pending.observe(self.child(self.metrics.genai_tpot, *key), seconds)


class GenAiObserver:
    """Lifecycle observer recording the GenAI metrics of one worker: the one place their values are
    worked out, recorded into each sink (the `GenAiSink` interface: `duration(key, error, s)`,
    `tokens(key, token_type, estimated, n)`, `ttft(key, s)`, `tpot(key, s)`, where `key` is
    (operation, provider, request model, server address, server port), "" for an absent value):
    always the Prometheus sink, and `state.runtime.genai_otlp` when `spec.otlpMetrics` is on
    (extproc/genai_otlp.py: the same values over OTLP; None when off, the one check per request)."""

    def __init__(self, metrics: Any, pending: Any, child: Any):
        self.prometheus = PrometheusSink(metrics, pending, child)
        self._only = (self.prometheus,)

    def __call__(self, state: RequestState, outcome: Outcome) -> None:
        req = state.request
        target = state.target
        if req is None or target is None or getattr(target, "kind", None) not in GENERATIVE_KINDS:
            return
        operation = OPERATIONS.get(req.api)
        if operation is None:
            return
        route = state.route
        model = req.model or (route.model if route is not None else None) or ""
        if route is not None and model and model not in route.models:
            model = "other"
        host, port = split_address((state.completion.upstream if state.completion is not None else None)
                                   or state.served or state.endpoint)
        key = (operation, target.kind, model, host, port)
        otlp = getattr(state.runtime, "genai_otlp", None)
        sinks = self._only if otlp is None else (self.prometheus, otlp)
        c = state.completion
        duration = c.duration if c is not None and c.duration is not None else time.monotonic() - state.started
        ok = outcome is Outcome.OK
        if ok:
            error = ""
        else:
            status = (c.status if c is not None else None) or state.reply_status or 0
            error = str(status) if status >= 400 else outcome.value
        for sink in sinks:
            sink.duration(key, error, duration)
        if not ok:
            return
        usage = state.usage
        if usage is not None and (usage.prompt_tokens or usage.completion_tokens):
            tokens_in, tokens_out, estimated = usage.prompt_tokens, usage.completion_tokens, False
        else:
            tokens_in, tokens_out, estimated = req.prompt_tokens_estimate(), estimate_output_tokens(state), True
        for sink in sinks:
            if tokens_in:
                sink.tokens(key, "input", estimated, tokens_in)
            if tokens_out:
                sink.tokens(key, "output", estimated, tokens_out)
        if not req.stream or state.first_body is None:
            return
        ttft = state.first_body - state.started
        if ttft < 0:
            return
        tpot = (duration - ttft) / (tokens_out - 1) if tokens_out and tokens_out > 1 and duration > ttft else None
        for sink in sinks:
            sink.ttft(key, ttft)
            if tpot is not None:
                sink.tpot(key, tpot)


__all__ = ["GenAiObserver", "PrometheusSink", "split_address", "estimate_output_tokens", "ESTIMATED_EVENTS_ATTR",
           "ANSWER_ATTR"]
