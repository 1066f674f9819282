"""The OpenAI Responses API on chat-completion backends, end to end with the official `openai` client.

Real Envoy and processor; the backends are the OpenAI API simulator (text, 40 tokens/s) and a chat
server that calls tools (tests/e2e/chat_tools_service.py), both speaking only chat completions.
Checked: string and item input with instructions, usage and status, function calls and their outputs
sent back, `responses.stream()` (its final response, the stream reaching the client while the
backend still decodes), usage counted by the gateway, and errors in the OpenAI error shape.
"""

from __future__ import annotations

import openai
import pytest

from tests.e2e.client_api_stack import backend_decoded, client_api_stack, last_backend_request
from tests.promtext import wait_samples

pytestmark = pytest.mark.e2e
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with client_api_stack(tmp_path_factory.mktemp("responses")) as st:
        yield st


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_string_input_with_instructions(stack, client):
    r = client.responses.create(model="tool-model", input="hello", instructions="Be terse.", max_output_tokens=30,
                                metadata={"case": "1"})
    assert r.object == "response" and r.status == "completed" and r.model == "tool-model"
    assert r.output_text == "echo: hello" and r.instructions == "Be terse." and r.metadata == {"case": "1"}
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (4, 7, 11)  # 14 characters // 4 + 1
    sent = last_backend_request(stack, "Be terse.")
    assert sent["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}]
    assert sent["max_tokens"] == 30


def test_limit_reached_is_incomplete(client):
    r = client.responses.create(model="sim-model", input="hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert len(r.output_text.split()) == 5 and r.usage.output_tokens == 5


def test_function_call_then_its_output(stack, client):
    r = client.responses.create(model="tool-model", input="weather in Oslo?", tools=[WEATHER], tool_choice="required")
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert (call.name, call.arguments, call.call_id) == ("get_weather", '{"city": "Oslo"}', "call_get_weather_1")
    assert last_backend_request(stack, "weather in Oslo?")["tool_choice"] == "required"
    r2 = client.responses.create(model="tool-model", tools=[WEATHER], input=[
        {"role": "user", "content": "weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r2.output_text == "result: sunny"
    sent = last_backend_request(stack, "sunny")["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.call_id
    assert sent[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}


def test_streamed_function_call(client):
    with client.responses.stream(model="tool-model", input="weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.function_call_arguments.delta") == 2
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == '{"city": "Oslo"}'
    assert final.usage.output_tokens == 7


def test_stream_arrives_while_the_backend_decodes_and_usage_is_counted(stack, client):
    # one streamed answer first: on a fresh stack the first one reached the client about 1 s after the
    # simulator had decoded all of it (clean-clone run, seed 2770058759, this test first in its file; the
    # later chunks then came paced, so it is a cold-path delay, not buffering, and not yet understood);
    # the check below is about buffering, on a warm stack
    with client.responses.stream(model="sim-model", input="warm up", max_output_tokens=2) as warm:
        assert [e.type for e in warm][-1] == "response.incomplete"  # cut at max_output_tokens
    decoded0 = backend_decoded(stack)
    text, decoded_at_first = "", None
    # no max_output_tokens: the simulator writes its default 16 tokens and stops ("completed")
    with client.responses.stream(model="sim-model", input=[{"role": "user", "content": "tell me"}]) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
                if decoded_at_first is None:
                    decoded_at_first = backend_decoded(stack) - decoded0
        final = stream.get_final_response()
    assert decoded_at_first is not None and 1 <= decoded_at_first < 16, decoded_at_first  # not buffered
    assert final.status == "completed" and final.output_text == text and len(text.split()) == 16
    assert final.usage.output_tokens == 16 and final.usage.input_tokens == 2
    wait_samples(f"{stack.processor_admin_url}/metrics", lambda s: s.value(
        "adapter_processor_tokens_total", 0.0, route="v1-responses", backend="sim", model="sim-model",
        type="completion", tenant="none") >= 16)


def test_stateless_gateway_refuses_previous_response_id(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="sim-model", input="again", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "no conversation state" in e.value.body["message"]


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-9", input="hi")
    assert e.value.body["param"] == "model" and "sim-model" in e.value.body["message"]


def test_backend_down_is_a_503_in_the_openai_shape(client):
    with pytest.raises(openai.InternalServerError) as e:
        client.responses.create(model="down-model", input="hi")
    assert e.value.status_code == 503
    assert e.value.body["type"] == "server_error" and "backend down" in e.value.body["message"]


def test_stream_the_backend_gives_up_on_ends_with_response_failed(client):
    with client.responses.stream(model="sim-model", input="go",
                                 extra_headers={"x-simulator-fault": "truncate-after=3"}) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len("".join(deltas).split()) == 3 and events[-1].type == "response.failed"
    assert "before it was complete" in events[-1].response.error.message


def test_backend_500_is_a_server_error_without_the_backends_body(client):
    with pytest.raises(openai.InternalServerError) as e:
        client.responses.create(model="sim-model", input="hi", extra_headers={"x-simulator-fault": "status=500"})
    assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
    assert "simulated engine failure" not in e.value.body["message"]
