"""The Anthropic Messages API on chat-completion backends, end to end with the official `anthropic` client.

Real Envoy and processor; the backends are the OpenAI API simulator (text, 40 tokens/s, so a stream's
progress is observable) and a chat server that calls tools (tests/e2e/chat_tools_service.py), both
speaking only chat completions. Checked: text answers with usage and stop reasons, the system prompt
and tool results reaching the backend as chat messages, tool use (plain and streamed), the stream
reaching the client while the backend still decodes, usage counted by the gateway, and errors in
Anthropic's shape with its status codes.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.e2e.client_api_stack import backend_decoded, client_api_stack, last_backend_request
from tests.promtext import wait_samples

pytestmark = pytest.mark.e2e
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city", "days"]}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with client_api_stack(tmp_path_factory.mktemp("anthropic")) as st:
        yield st


@pytest.fixture
def client(stack):
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)


def test_text_answer_with_usage_and_stop_reason(client):
    m = client.messages.create(model="sim-model", max_tokens=6, messages=[{"role": "user", "content": "hi there"}])
    assert m.type == "message" and m.role == "assistant" and m.model == "sim-model"
    assert [b.type for b in m.content] == ["text"] and len(m.content[0].text.split()) == 6
    assert m.stop_reason == "max_tokens"  # the simulator stops at the client's limit: finish_reason length
    assert m.usage.output_tokens == 6 and m.usage.input_tokens == 2  # "hi there": ceil(8 / 4) tokens
    assert m.id.startswith("msg_")


def test_system_prompt_and_conversation_reach_the_backend_as_chat(stack, client):
    m = client.messages.create(model="tool-model", max_tokens=20, system="You are terse.", stop_sequences=["##"],
                               messages=[{"role": "user", "content": "first"},
                                         {"role": "assistant", "content": "ok"},
                                         {"role": "user", "content": [{"type": "text", "text": "second"}]}])
    assert m.content[0].text == "echo: second" and m.stop_reason == "end_turn"
    sent = last_backend_request(stack, "You are terse.")
    assert sent["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "first"},
                                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    assert sent["max_tokens"] == 20 and sent["stop"] == ["##"] and "stream" not in sent


def test_tool_use_then_tool_result(stack, client):
    m = client.messages.create(model="tool-model", max_tokens=50, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "weather in Oslo?"}])
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert (use.name, use.input, use.id) == ("get_weather", {"city": "Oslo", "days": 3}, "call_get_weather_1")
    sent = last_backend_request(stack, "weather in Oslo?")
    assert sent["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                               "parameters": WEATHER["input_schema"]}}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    # the client sends the tool's result back: it reaches the backend as a tool message after the call
    m2 = client.messages.create(model="tool-model", max_tokens=50, tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 4 C"}]}])
    assert m2.content[0].text == "result: rain, 4 C" and m2.stop_reason == "end_turn"
    sent = last_backend_request(stack, "rain, 4 C")
    assert sent["messages"][1]["tool_calls"][0]["id"] == use.id
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": use.id, "content": "rain, 4 C"}


def test_streamed_tool_use(client):
    with client.messages.stream(model="tool-model", max_tokens=50, tools=[WEATHER], tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "weather?"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "input_json" in kinds  # the arguments arrived as input_json deltas
    (use,) = final.content
    assert use.type == "tool_use" and use.input == {"city": "Oslo", "days": 3}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 7 and final.usage.input_tokens == 3


def test_stream_arrives_while_the_backend_decodes_and_usage_is_counted(stack, client):
    # one streamed answer first: on a fresh stack the first one reached the client about 1 s after the
    # simulator had decoded all of it (clean-clone run, seed 2770058759, this test first in its file; the
    # later chunks then came paced, so it is a cold-path delay, not buffering, and not yet understood);
    # the check below is about buffering, on a warm stack
    with client.messages.stream(model="sim-model", max_tokens=2, messages=[{"role": "user", "content": "warm up"}]) as warm:
        warm.get_final_message()
    decoded0 = backend_decoded(stack)
    text, decoded_at_first = "", None
    with client.messages.stream(model="sim-model", max_tokens=40,
                                messages=[{"role": "user", "content": "tell me"}]) as stream:
        for piece in stream.text_stream:
            text += piece
            if decoded_at_first is None:
                decoded_at_first = backend_decoded(stack) - decoded0
        final = stream.get_final_message()
    # the first text reached the client through Envoy and the processor's translation while the
    # backend was still decoding the rest (40 tokens at 40 tokens/s): the stream is not buffered
    assert decoded_at_first is not None and 1 <= decoded_at_first < 40, decoded_at_first
    assert len(text.split()) == 40 and final.content[0].text == text
    assert final.usage.output_tokens == 40 and final.usage.input_tokens == 2 and final.stop_reason == "max_tokens"
    samples = wait_samples(f"{stack.processor_admin_url}/metrics", lambda s: s.value(
        "adapter_processor_tokens_total", 0.0, route="v1-messages", backend="sim", model="sim-model",
        type="completion", tenant="none") >= 40)
    assert samples.value("adapter_processor_tokens_total", 0.0, route="v1-messages", backend="sim",
                         model="sim-model", type="prompt", tenant="none") >= 2


def test_unknown_model_is_anthropics_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-9", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert "claude-9" in e.value.body["error"]["message"] and "sim-model" in e.value.body["error"]["message"]


def test_invalid_request_is_a_400_invalid_request_error(stack):
    r = httpx.post(f"{stack.url}/v1/messages", json={"model": "sim-model", "messages": [{"role": "user", "content": "x"}]},
                   timeout=10)
    assert r.status_code == 400
    assert r.json()["error"] == {"type": "invalid_request_error",
                                 "message": "max_tokens: an integer of at least 1 is required"}
    r = httpx.get(f"{stack.url}/v1/messages", timeout=10)
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_backend_refusal_keeps_its_status_and_message(client):
    # the simulator refuses a limit beyond its context window with 400; the client sees it as Anthropic's
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="sim-model", max_tokens=10_000_000, messages=[{"role": "user", "content": "hi"}])
    err = e.value.body["error"]
    assert err["type"] == "invalid_request_error" and err["message"].startswith("backend sim: ")


def test_backend_down_is_a_503_overloaded_error(client):
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model="down-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 503
    err = e.value.body["error"]
    assert err["type"] == "overloaded_error" and "backend down" in err["message"]


def test_stream_the_backend_gives_up_on_ends_with_an_error_event(client):
    # the simulator ends the stream after 3 chunks without `data: [DONE]` (its x-simulator-fault hook)
    text = ""
    with pytest.raises(anthropic.APIStatusError) as e:
        with client.messages.stream(model="sim-model", max_tokens=20, messages=[{"role": "user", "content": "go"}],
                                    extra_headers={"x-simulator-fault": "truncate-after=3"}) as stream:
            for piece in stream.text_stream:
                text += piece
    assert len(text.split()) == 3  # what came before the cut reached the client
    assert e.value.body["error"]["type"] == "api_error" and "before it was complete" in e.value.body["error"]["message"]


def test_backend_500_is_an_api_error_without_the_backends_body(client):
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model="sim-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                               extra_headers={"x-simulator-fault": "status=500"})
    err = e.value.body["error"]
    assert e.value.status_code == 500 and err["type"] == "api_error"
    assert "simulated engine failure" not in err["message"] and "logged its answer" in err["message"]
