"""The Responses <-> chat translation: exact mappings, 400s naming the field, and round-trip properties.

Round trip: Responses input items -> chat request keep roles, text, function calls and their outputs
in order; a chat answer -> Response keeps text, function calls and usage; the same answer streamed as
chat chunks cut anywhere gives events that the official `openai` client's own stream state
(`ResponseStreamState`, what `client.responses.stream()` runs) accumulates into that same Response.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings, strategies as st
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from extproc.apis import openai_responses as ar
from extproc.apis.common import TranslationError
from tests.extproc.apis.test_anthropic_messages import answers, chat_answer, chat_chunks, events_of, ident, text


def test_string_input_instructions_and_options():
    chat, ctx = ar.to_chat({"model": "m", "input": "hi", "instructions": "brief", "max_output_tokens": 9,
                            "temperature": 0.2, "top_p": 0.5, "parallel_tool_calls": False, "user": "u",
                            "tools": [{"type": "function", "name": "f", "description": "d",
                                       "parameters": {"type": "object"}, "strict": True}],
                            "tool_choice": {"type": "function", "name": "f"},
                            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                                "strict": True}},
                            "metadata": {"k": "v"}, "store": True, "stream": True})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_tokens": 9, "temperature": 0.2, "top_p": 0.5,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                "description": "d", "strict": True}}],
                    "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                               "strict": True}},
                    "user": "u", "stream": True, "stream_options": {"include_usage": True}}
    assert ctx["instructions"] == "brief" and ctx["metadata"] == {"k": "v"} and ctx["stream"] is True


def test_items_map_to_messages_function_calls_merge_into_the_assistant_turn():
    chat, _ = ar.to_chat({"model": "m", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "see "},
                                                        {"type": "input_image", "image_url": "http://x/i.png"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a":1}'},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "see "},
                                     {"type": "image_url", "image_url": {"url": "http://x/i.png"}}]},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": 5}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "i"}]}, "input[0].type"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"model": "m", "input": "x", "instructions": 3}, "instructions"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(TranslationError) as e:
        ar.to_chat(body)
    assert e.value.param == param and e.value.status == 400


def test_response_items_status_and_usage():
    r = ar.from_chat(chat_answer("hi", [("c1", "f", '{"a":1}')], "length", (10, 4, 6)),
                     {"model": "m", "instructions": "brief"})
    assert r["id"] == "resp_abc" and r["object"] == "response" and r["model"] == "m"
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"] == [
        {"type": "message", "id": "msg_abc_0", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_abc_1", "call_id": "c1", "name": "f", "arguments": '{"a":1}',
         "status": "completed"}]
    assert r["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 6}, "output_tokens": 4,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}
    assert r["instructions"] == "brief" and r["store"] is False


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.sampled_from(["user", "assistant", "system"]), text),
    st.tuples(st.just("call"), st.tuples(ident, ident, text)),
    st.tuples(st.just("output"), st.tuples(ident, text))), min_size=1, max_size=8))
def test_request_round_trip_keeps_roles_text_calls_and_outputs(items):
    body_items, expected = [], []
    for kind, value in items:
        if kind == "call":
            cid, name, args = value
            body_items.append({"type": "function_call", "call_id": cid, "name": name, "arguments": args})
            expected.append(("call", cid, name, args))
        elif kind == "output":
            body_items.append({"type": "function_call_output", "call_id": value[0], "output": value[1]})
            expected.append(("tool", value[0], value[1]))
        else:
            body_items.append({"role": kind, "content": value})
            expected.append((kind, value))
    if all(k == "system" for k, _ in items):
        with pytest.raises(TranslationError):
            ar.to_chat({"model": "m", "input": body_items})
        return
    chat, _ = ar.to_chat({"model": "m", "input": body_items})
    got = []
    for m in chat["messages"]:
        if m["role"] == "tool":
            got.append(("tool", m["tool_call_id"], m["content"]))
            continue
        if m["content"] is not None:
            got.append((m["role"], m["content"]))
        got += [("call", c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())]
    assert got == expected


def client_events(raw: list[bytes]):
    return [(name, construct_type(type_=ResponseStreamEvent, value=ev)) for name, ev in events_of(raw)]


@settings(max_examples=150, deadline=None)
@given(answers(), st.data())
def test_answer_round_trip_json_and_stream_agree_with_the_official_stream_state(answer, data):
    content, calls, finish, usage = answer
    ctx = {"model": "m"}
    r = ar.from_chat(chat_answer(content, calls, finish, usage), ctx)
    texts = [p["text"] for item in r["output"] if item["type"] == "message" for p in item["content"]]
    assert "".join(texts) == content
    assert [(i["call_id"], i["name"], i["arguments"]) for i in r["output"] if i["type"] == "function_call"] == calls
    assert (r["usage"]["input_tokens"], r["usage"]["output_tokens"],
            r["usage"]["input_tokens_details"]["cached_tokens"]) == usage
    stream = ar.ResponsesStream(ctx, "rid")
    raw = []
    for c in chat_chunks(data.draw, content, calls, finish, usage):
        raw += stream.feed(c)
    raw += stream.done()
    events = client_events(raw)
    assert all(name == ev.type for name, ev in events)
    assert [ev.sequence_number for _, ev in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for _, ev in events:
        state.handle_event(ev)
    final = events[-1][1]
    assert final.type == ("response.incomplete" if finish == "length" else "response.completed")
    if final.type == "response.completed":  # the client's own view: what get_final_response() returns
        done = state._completed_response
        assert done.output_text == content
        assert [(i.call_id, i.name, i.arguments) for i in done.output if i.type == "function_call"] == calls
        assert (done.usage.input_tokens, done.usage.output_tokens) == usage[:2]
    final_output = [o.to_dict() for o in final.response.output]
    assert [(i["type"], i["id"], i.get("call_id"), i.get("arguments")) for i in final_output] == \
        [(i["type"], i["id"], i.get("call_id"), i.get("arguments")) for i in r["output"]]
    assert "".join(p["text"] for i in final_output if i["type"] == "message" for p in i["content"]) == content


def test_stream_error_is_response_failed():
    stream = ar.ResponsesStream({"model": "m"}, "rid")
    stream.feed({"id": "chatcmpl-x", "choices": [{"index": 0, "delta": {"content": "par"}}]})
    (name, ev), = events_of(stream.error(502, "gone"))
    assert name == "response.failed" and ev["response"]["status"] == "failed"
    assert ev["response"]["error"] == {"code": "server_error", "message": "gone"}
    assert ev["response"]["output"][0]["status"] == "incomplete" and stream.ended
