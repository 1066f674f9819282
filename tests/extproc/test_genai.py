"""The OpenTelemetry GenAI metrics (extproc/genai.py): which requests get them, each metric's value and
labels, the advised bucket boundaries, and token counts labelled estimated when the backend reported none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from backends.base import Usage
from extproc.genai import ESTIMATED_EVENTS_ATTR, GenAiObserver, estimate_output_tokens, split_address
from extproc.lifecycle import Completion
from extproc.metrics import (GENAI_DURATION_BUCKETS, GENAI_TOKEN_BUCKETS, GENAI_TPOT_BUCKETS, GENAI_TTFT_BUCKETS,
                             Pending, ProcessorMetrics)
from extproc.request import parse_openai
from extproc.types import Outcome, RequestState
from tests.promtext import collect

ROUTE = SimpleNamespace(name="v1", model=None, models=("llama-3-8b",))
VLLM = SimpleNamespace(name="llm", kind="vllm")
BASE = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "vllm", "gen_ai_request_model": "llama-3-8b",
        "server_address": "10.0.0.5", "server_port": "8000"}


class Harness:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.metrics = ProcessorMetrics(self.registry)
        self.pending = Pending()
        self.children: dict = {}
        self.observer = GenAiObserver(self.metrics, self.pending, self.child)

    def child(self, metric, *labels):
        key = (id(metric),) + labels
        if key not in self.children:
            self.children[key] = metric.labels(*labels)
        return self.children[key]

    def samples(self):
        self.pending.flush()
        return collect(self.registry)


def state(path="/v1/chat/completions", model="llama-3-8b", stream=True, target=VLLM, prompt="x" * 400,
          **completion) -> RequestState:
    st = RequestState(snapshot=None, route=ROUTE, started=100.0)
    body = {"model": model, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    st.request = parse_openai(path, body)
    st.target = target
    st.backend = target.name
    st.completion = Completion(status=completion.pop("status", 200), upstream="10.0.0.5:8000",
                               duration=completion.pop("duration", 2.0), source="stream")
    return st


def test_an_ok_streamed_chat_records_all_four_with_the_backends_usage():
    h = Harness()
    st = state()
    st.first_body = 100.5
    st.usage = Usage(prompt_tokens=100, completion_tokens=21)
    h.observer(st, Outcome.OK)
    s = h.samples()
    assert s.value("gen_ai_server_request_duration_seconds_sum", **BASE, error_type="") == 2.0
    assert s.value("gen_ai_server_time_to_first_token_seconds_sum", **BASE) == 0.5
    assert s.value("gen_ai_server_time_per_output_token_seconds_sum", **BASE) == pytest.approx(1.5 / 20)
    assert s.value("gen_ai_client_token_usage_sum", **BASE, gen_ai_token_type="input", estimated="false") == 100
    assert s.value("gen_ai_client_token_usage_sum", **BASE, gen_ai_token_type="output", estimated="false") == 21
    # the advised boundaries: 21 output tokens fall in the (16, 64] bucket
    assert s.value("gen_ai_client_token_usage_bucket", **BASE, gen_ai_token_type="output", estimated="false",
                   le="16.0") == 0
    assert s.value("gen_ai_client_token_usage_bucket", **BASE, gen_ai_token_type="output", estimated="false",
                   le="64.0") == 1


def test_without_usage_the_tokens_are_estimated_and_labelled_so():
    h = Harness()
    st = state(prompt="y" * 800)
    st.first_body = 100.2
    st.attrs[ESTIMATED_EVENTS_ATTR] = 11  # ten content events and the finish chunk
    h.observer(st, Outcome.OK)
    s = h.samples()
    assert s.value("gen_ai_client_token_usage_sum", **BASE, gen_ai_token_type="input", estimated="true") == 200
    assert s.value("gen_ai_client_token_usage_sum", **BASE, gen_ai_token_type="output", estimated="true") == 10
    assert s.value("gen_ai_server_time_per_output_token_seconds_sum", **BASE) == pytest.approx(1.8 / 9)


def test_a_json_answer_without_usage_is_estimated_from_its_text():
    h = Harness()
    st = state(stream=False)
    st.attrs.update(sse=False, pending=b'{"choices": [{"message": {"role": "assistant", "content": "' + b"z" * 80
                    + b'"}}]}')
    h.observer(st, Outcome.OK)
    s = h.samples()
    assert s.value("gen_ai_client_token_usage_sum", **BASE, gen_ai_token_type="output", estimated="true") == 20
    assert not s.series("gen_ai_server_time_to_first_token_seconds_count")  # not streamed: no TTFT
    assert s.value("gen_ai_server_request_duration_seconds_count", **BASE, error_type="") == 1


def test_failures_get_only_the_duration_with_their_error_type():
    h = Harness()
    h.observer(state(status=500), Outcome.BACKEND_ERROR)
    cancelled = state(status=0)
    cancelled.first_body = 100.1
    h.observer(cancelled, Outcome.CANCELLED)
    s = h.samples()
    assert s.value("gen_ai_server_request_duration_seconds_count", **BASE, error_type="500") == 1
    assert s.value("gen_ai_server_request_duration_seconds_count", **BASE, error_type="cancelled") == 1
    assert not s.series("gen_ai_client_token_usage_count")
    assert not s.series("gen_ai_server_time_to_first_token_seconds_count")


def test_operations_and_bounded_model_labels():
    h = Harness()
    h.observer(state(path="/v1/completions", model="someone-elses-model"), Outcome.OK)
    s = h.samples()
    labels = dict(BASE, gen_ai_operation_name="text_completion", gen_ai_request_model="other")
    assert s.value("gen_ai_server_request_duration_seconds_count", **labels, error_type="") == 1


def test_non_generative_backends_and_requests_without_a_parsed_body_get_nothing():
    h = Harness()
    h.observer(state(target=SimpleNamespace(name="t", kind="triton")), Outcome.OK)
    bare = RequestState(snapshot=None, route=ROUTE, started=0.0)
    bare.target = VLLM
    h.observer(bare, Outcome.OK)
    s = h.samples()
    assert not s.series("gen_ai_server_request_duration_seconds_count")


def test_the_served_endpoint_else_the_pick_names_the_server():
    h = Harness()
    st = state()
    st.completion = Completion(status=200, upstream=None, duration=1.0)
    st.endpoint = "[fd00::1]:9000"
    h.observer(st, Outcome.OK)
    s = h.samples()
    assert s.value("gen_ai_server_request_duration_seconds_count", **dict(BASE, server_address="[fd00::1]",
                                                                        server_port="9000"), error_type="") == 1


def test_split_address_and_output_estimates():
    assert split_address("10.0.0.1:80") == ("10.0.0.1", "80")
    assert split_address("[::1]:8000") == ("[::1]", "8000")
    assert split_address("host") == ("host", "") and split_address(None) == ("", "")
    st = RequestState(snapshot=None, route=None, started=0.0)
    assert estimate_output_tokens(st) is None
    st.attrs.update(sse=False, pending=b"not json")
    assert estimate_output_tokens(st) is None
    st.attrs.update(pending=b'{"choices": [{"text": "abcdefgh"}, "junk"]}')
    assert estimate_output_tokens(st) == 2


def test_the_advised_bucket_boundaries():
    assert GENAI_DURATION_BUCKETS[0] == 0.01 and GENAI_DURATION_BUCKETS[-1] == 81.92 and len(GENAI_DURATION_BUCKETS) == 14
    assert GENAI_TTFT_BUCKETS == (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                                  7.5, 10.0)
    assert GENAI_TPOT_BUCKETS == (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
    assert GENAI_TOKEN_BUCKETS[0] == 1 and GENAI_TOKEN_BUCKETS[-1] == 67108864 and len(GENAI_TOKEN_BUCKETS) == 14
