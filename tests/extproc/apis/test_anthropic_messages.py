"""The Messages <-> chat translation: exact mappings, 400s naming the field, and round-trip properties.

Round trip: a Messages conversation -> chat request keeps every turn's role, text, tool calls and tool
results in order; a chat answer -> Message keeps text, tool calls (id, name, input) and usage; and
the same answer streamed as chat chunks, cut anywhere, gives events that the official `anthropic`
client's own accumulator (`accumulate_event`) turns into that same Message.
"""

from __future__ import annotations

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings, strategies as st

from extproc.apis import anthropic_messages as am
from extproc.apis.common import TranslationError

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30)
ident = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,12}", fullmatch=True)
json_value = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | text,
                          lambda v: st.lists(v, max_size=3) | st.dictionaries(ident, v, max_size=3), max_leaves=8)
tool_input = st.dictionaries(ident, json_value, max_size=4)


def base(**kw):
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **kw}


# --- request: exact mappings -------------------------------------------------------------------------


def test_request_maps_system_sampling_stops_tools_and_choice():
    chat, ctx = am.to_chat(base(system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                                temperature=0.5, top_p=0.9, top_k=4, stop_sequences=["END"],
                                tools=[{"name": "get", "description": "d", "input_schema": {"type": "object"}}],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                metadata={"user_id": "u1"}, stream=True))
    assert chat == {"model": "m", "max_tokens": 16,
                    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    "temperature": 0.5, "top_p": 0.9, "top_k": 4, "stop": ["END"],
                    "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"},
                                                                "description": "d"}}],
                    "tool_choice": "required", "parallel_tool_calls": False, "user": "u1", "stream": True,
                    "stream_options": {"include_usage": True}}
    assert ctx == {"model": "m", "stop_sequences": ("END",), "stream": True}


@pytest.mark.parametrize("choice, expected", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                              ({"type": "tool", "name": "f"},
                                               {"type": "function", "function": {"name": "f"}})])
def test_tool_choice(choice, expected):
    assert am.to_chat(base(tool_choice=choice))[0]["tool_choice"] == expected


def test_tool_results_come_first_as_tool_messages_and_images_become_parts():
    chat, _ = am.to_chat(base(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "let me look"},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "rain"}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
            {"type": "text", "text": "and "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]))
    assert chat["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "rain"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: boom"},
        {"role": "user", "content": [{"type": "text", "text": "and "},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]


def test_assistant_with_only_tool_use_has_null_content_and_thinking_is_dropped():
    chat, _ = am.to_chat(base(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]))
    assert chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (base(max_tokens=0), "max_tokens"),
    (base(max_tokens=True), "max_tokens"),
    (base(messages=[]), "messages"),
    (base(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (base(messages=[{"role": "user"}]), "messages[0].content"),
    (base(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages[0].content[0].type"),
    (base(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), "messages[0].content[0].text"),
    (base(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (base(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (base(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (base(stop_sequences="END"), "stop_sequences"),
    (base(stream="yes"), "stream"),
    (base(system=5), "system"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(TranslationError) as e:
        am.to_chat(body)
    assert e.value.param == param and e.value.status == 400


# --- response: exact mappings ------------------------------------------------------------------------


def chat_answer(content, calls=(), finish="stop", usage=(7, 3, 0), **choice):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    u = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": usage[0] + usage[1]}
    if usage[2]:
        u["prompt_tokens_details"] = {"cached_tokens": usage[2]}
    return {"id": "chatcmpl-abc", "object": "chat.completion", "model": "backend-name",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}], "usage": u}


def test_response_text_tool_use_and_usage():
    msg = am.from_chat(chat_answer("hello", [("c1", "f", '{"a": 1}'), ("c2", "g", "not json")], "tool_calls",
                                   (10, 4, 6)), {"model": "m"})
    assert msg == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "hello"},
                               {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
                               {"type": "tool_use", "id": "c2", "name": "g", "input": {"arguments": "not json"}}],
                   "stop_reason": "tool_use", "stop_sequence": None,
                   "usage": {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 6}}


@pytest.mark.parametrize("finish, matched, reason, sequence", [
    ("stop", None, "end_turn", None), ("length", None, "max_tokens", None), ("tool_calls", None, "tool_use", None),
    ("content_filter", None, "refusal", None), ("stop", "END", "stop_sequence", "END"),
    ("stop", "OTHER", "end_turn", None), (None, None, "end_turn", None)])
def test_stop_reason(finish, matched, reason, sequence):
    msg = am.from_chat(chat_answer("x", finish=finish, stop_reason=matched), {"model": "m", "stop_sequences": ("END",)})
    assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, sequence)


def test_empty_content_gives_no_text_block():
    assert am.from_chat(chat_answer(""), {"model": "m"})["content"] == []


# --- round trips ----------------------------------------------------------------------------------


@st.composite
def conversations(draw):
    """A valid Messages conversation: user/assistant turns, tool uses answered by tool results."""
    turns = []
    for i in range(draw(st.integers(1, 4))):
        turns.append({"role": "user", "content": draw(text)})
        calls = draw(st.lists(st.tuples(ident, ident, tool_input), max_size=2, unique_by=lambda c: c[0]))
        reply = draw(st.one_of(st.none(), text))
        blocks = ([{"type": "text", "text": reply}] if reply else []) + [
            {"type": "tool_use", "id": f"{cid}{i}", "name": name, "input": args} for cid, name, args in calls]
        if not blocks:
            continue
        turns.append({"role": "assistant", "content": blocks})
        if calls:
            turns.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"{cid}{i}", "content": draw(text)} for cid, _, _ in calls]})
    return turns


@settings(max_examples=150, deadline=None)
@given(conversations(), st.one_of(st.none(), text))
def test_request_round_trip_keeps_roles_text_tool_calls_and_results(turns, system):
    body = base(messages=turns, **({"system": system} if system else {}))
    chat, _ = am.to_chat(body)
    expected = [("system", system, None)] if system else []
    for t in turns:
        if isinstance(t["content"], str):
            expected.append(("user", t["content"], None))
        elif t["role"] == "assistant":
            texts = "".join(b["text"] for b in t["content"] if b["type"] == "text")
            calls = [(b["id"], b["name"], b["input"]) for b in t["content"] if b["type"] == "tool_use"]
            expected.append(("assistant", texts if texts or not calls else None, calls or None))
        else:
            expected += [("tool", b["content"], b["tool_use_id"]) for b in t["content"]]
    got = []
    for m in chat["messages"]:
        if m["role"] == "assistant":
            calls = [(c["id"], c["function"]["name"], orjson.loads(c["function"]["arguments"]))
                     for c in m.get("tool_calls", ())]
            got.append(("assistant", m["content"], calls or None))
        elif m["role"] == "tool":
            got.append(("tool", m["content"], m["tool_call_id"]))
        else:
            got.append((m["role"], m["content"], None))
    assert got == expected


@st.composite
def answers(draw):
    content = draw(st.one_of(st.just(""), text))
    calls = draw(st.lists(st.tuples(ident, ident, tool_input), max_size=3, unique_by=lambda c: c[0]))
    finish = draw(st.sampled_from(["stop", "length", "tool_calls"] if calls else ["stop", "length"]))
    usage = (draw(st.integers(0, 5000)), draw(st.integers(0, 5000)), 0)
    usage = (usage[0], usage[1], draw(st.integers(0, usage[0])))
    return content, [(c, n, orjson.dumps(a).decode()) for c, n, a in calls], finish, usage


def pieces(draw, s: str) -> list[str]:
    """`s` cut at arbitrary points (each piece non-empty)."""
    if not s:
        return []
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(s) - 1)), max_size=4))) if len(s) > 1 else []
    bounds = [0, *cuts, len(s)]
    return [s[a:b] for a, b in zip(bounds, bounds[1:]) if s[a:b]]


def chat_chunks(draw, content, calls, finish, usage) -> list[dict]:
    """The answer as a vLLM chat stream: role chunk, text pieces, tool calls (id/name, then args), finish, usage."""
    def chunk(delta, finish_reason=None):
        return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "b",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": p}) for p in pieces(draw, content)]
    for i, (cid, name, args) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]}) for p in pieces(draw, args)]
    out.append(chunk({}, finish))
    u = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": usage[0] + usage[1]}
    if usage[2]:
        u["prompt_tokens_details"] = {"cached_tokens": usage[2]}
    out.append({"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "b", "choices": [], "usage": u})
    return out


def events_of(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for e in raw:
        name, data = e.split(b"\n", 1)
        assert name.startswith(b"event: ") and data.startswith(b"data: ") and data.endswith(b"\n\n")
        out.append((name[7:].decode(), orjson.loads(data[6:])))
    return out


@settings(max_examples=150, deadline=None)
@given(answers(), st.data())
def test_answer_round_trip_json_and_stream_agree_with_the_official_accumulator(answer, data):
    content, calls, finish, usage = answer
    ctx = {"model": "m", "stop_sequences": ()}
    msg = am.from_chat(chat_answer(content, calls, finish, usage), ctx)
    # JSON: text, tool calls and usage kept
    assert "".join(b["text"] for b in msg["content"] if b["type"] == "text") == content
    assert [(b["id"], b["name"], b["input"]) for b in msg["content"] if b["type"] == "tool_use"] == \
        [(c, n, orjson.loads(a)) for c, n, a in calls]
    assert msg["usage"]["input_tokens"] + msg["usage"].get("cache_read_input_tokens", 0) == usage[0]
    assert msg["usage"]["output_tokens"] == usage[1]
    # stream: the same Message out of the client's accumulator, event names matching their types
    stream = am.MessagesStream(ctx, "rid")
    raw = []
    for c in chat_chunks(data.draw, content, calls, finish, usage):
        raw += stream.feed(c)
    raw += stream.done()
    events = events_of(raw)
    assert all(name == ev["type"] for name, ev in events)
    assert [n for n, _ in events][:2] == ["message_start", "ping"] and events[-1][0] == "message_stop"
    snapshot = None
    json_bufs: dict = {}
    for name, ev in events:
        if name != "ping":
            snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=json_bufs)
    got = snapshot.to_dict()
    for block in got["content"]:
        block.pop("parsed_output", None)
        block.pop("citations", None)
    assert got["content"] == msg["content"]
    assert (got["stop_reason"], got["usage"]["input_tokens"], got["usage"]["output_tokens"]) == \
        (msg["stop_reason"], msg["usage"]["input_tokens"], msg["usage"]["output_tokens"])
    assert got["id"] == msg["id"] and got["model"] == "m"


def test_stream_without_chunks_still_opens_and_closes_the_message():
    stream = am.MessagesStream({"model": "m"}, "rid")
    names = [n for n, _ in events_of(stream.done())]
    assert names == ["message_start", "ping", "message_delta", "message_stop"]


def test_stream_error_event_is_the_api_error_shape():
    stream = am.MessagesStream({"model": "m"}, "rid")
    [(name, ev)] = events_of(stream.error(502, "gone"))
    assert name == "error" and ev == {"type": "error", "error": {"type": "api_error", "message": "gone"}}
    assert stream.ended
