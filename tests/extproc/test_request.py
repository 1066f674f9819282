"""InferenceRequest: one parsed view per API (OpenAI shapes, KServe paths, our documents)."""

from __future__ import annotations

import orjson
import pytest

from extproc.request import (InferenceRequest, kserve_model, parse_document, parse_json_body, parse_kserve,
                             parse_openai)
from extproc.types import Reject

# --- parse_openai: which API ------------------------------------------------------------------------


@pytest.mark.parametrize("path, api", [
    ("/v1/chat/completions", "openai.chat"),
    ("/v1/completions", "openai.completions"),
    ("/v1/embeddings", "openai.embeddings"),
    ("/v1/responses", "openai.responses"),
    ("/v1/messages", "anthropic.messages"),
    ("/openai/v1/chat/completions", "openai.chat"),  # any prefix: the route decides where the API lives
    ("/v1/models", "openai.other"),
    ("/v1/audio/transcriptions", "openai.other"),
    ("", "openai.other"),
])
def test_api_from_path(path, api):
    assert parse_openai(path, {}).api == api


def test_chat_request_fields():
    body = {"model": "m2", "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi"}],
            "max_tokens": 64, "stream": True, "priority": -3, "user": "sess-9"}
    r = parse_openai("/v1/chat/completions", body, tenant="acme")
    assert r.api == "openai.chat" and r.model == "m2"
    assert r.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    assert r.prompt is None
    assert r.max_tokens == 64 and r.stream is True and r.priority == -3
    assert r.session_key == "sess-9" and r.tenant == "acme"
    assert r.body is body and r.lora is None


def test_chat_messages_keep_only_objects_and_non_list_is_empty():
    r = parse_openai("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}, "junk", 3, None]})
    assert r.messages == ({"role": "user", "content": "a"},)
    assert parse_openai("/v1/chat/completions", {"messages": "hello"}).messages == ()
    assert parse_openai("/v1/chat/completions", {}).messages == ()


def test_completions_prompt_string_only():
    assert parse_openai("/v1/completions", {"model": "m", "prompt": "Once upon"}).prompt == "Once upon"
    # token arrays / batches of prompts are not a string: no prompt text
    assert parse_openai("/v1/completions", {"prompt": ["a", "b"]}).prompt is None
    assert parse_openai("/v1/completions", {"prompt": [1, 2, 3]}).prompt is None


def test_embeddings_input_string_is_the_prompt():
    r = parse_openai("/v1/embeddings", {"model": "e5", "input": "embed me"})
    assert r.api == "openai.embeddings" and r.model == "e5" and r.prompt == "embed me"
    assert parse_openai("/v1/embeddings", {"input": ["a", "b"]}).prompt is None


def test_responses_input_string_is_the_prompt_and_max_output_tokens_counts():
    r = parse_openai("/v1/responses", {"model": "m", "input": "hello", "max_output_tokens": 50})
    assert r.api == "openai.responses" and r.prompt == "hello" and r.max_tokens == 50


def test_input_is_only_a_prompt_for_responses_and_embeddings():
    assert parse_openai("/v1/chat/completions", {"input": "x"}).prompt is None
    assert parse_openai("/v1/completions", {"input": "x"}).prompt is None


def test_anthropic_messages_shape():
    body = {"model": "claude", "max_tokens": 256, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}], "stream": True}
    r = parse_openai("/v1/messages", body)
    assert r.api == "anthropic.messages" and r.model == "claude" and r.max_tokens == 256 and r.stream
    assert r.prompt_text() == "part one\npart two"


@pytest.mark.parametrize("body, expected", [
    ({"max_completion_tokens": 10, "max_tokens": 20, "max_output_tokens": 30}, 10),
    ({"max_tokens": 20, "max_output_tokens": 30}, 20),
    ({"max_output_tokens": 30}, 30),
    ({"max_completion_tokens": "10", "max_tokens": 20}, 20),  # not an int: the next one counts
    ({"max_completion_tokens": True, "max_tokens": 20}, 20),  # bools are not ints here
    ({"max_tokens": 1.5}, None),
    ({}, None),
])
def test_max_tokens_precedence(body, expected):
    assert parse_openai("/v1/chat/completions", body).max_tokens == expected


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("true", False), (1, False), (None, False)])
def test_stream_only_when_true(value, expected):
    assert parse_openai("/v1/chat/completions", {"stream": value}).stream is expected


@pytest.mark.parametrize("value, expected", [(5, 5), (0, 0), (-1, -1), (True, None), (False, None), ("1", None),
                                             (1.0, None), (None, None)])
def test_priority_is_an_int_never_a_bool(value, expected):
    assert parse_openai("/v1/chat/completions", {"priority": value}).priority == expected


@pytest.mark.parametrize("value, expected", [("u-1", "u-1"), (7, None), ({"id": "x"}, None), (None, None)])
def test_session_key_from_user_string(value, expected):
    assert parse_openai("/v1/chat/completions", {"user": value}).session_key == expected


def test_model_must_be_a_string():
    assert parse_openai("/v1/chat/completions", {"model": 42}).model is None
    assert parse_openai("/v1/chat/completions", {"model": ["a"]}).model is None
    assert parse_openai("/v1/chat/completions", {}).model is None


# --- prompt_text -----------------------------------------------------------------------------------


def test_prompt_text_prefers_prompt():
    r = InferenceRequest(api="openai.completions", prompt="p", messages=({"content": "m"},))
    assert r.prompt_text() == "p"


def test_prompt_text_joins_string_and_list_contents_in_order():
    r = parse_openai("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "not-a-part", {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},  # no content: skipped
        {"role": "user", "content": "last"},
    ]})
    assert r.prompt_text() == "sys\na\nb\nlast"


def test_prompt_text_empty_without_prompt_or_messages():
    assert parse_openai("/v1/chat/completions", {}).prompt_text() == ""


def test_prompt_text_of_a_document_is_its_json():
    doc = {"query": "计算Q3营收", "n": 1}
    r = parse_document(doc, "qwen", tenant="t1")
    assert (r.api, r.model, r.tenant, r.body) == ("document", "qwen", "t1", doc)
    assert r.prompt_text() == orjson.dumps(doc).decode()
    assert "计算Q3营收" in r.prompt_text()  # not ASCII-escaped


def test_document_that_is_not_an_object_has_no_body():
    r = parse_document([1, 2], "m")
    assert r.body is None and r.model == "m" and r.prompt_text() == ""


# --- parse_json_body --------------------------------------------------------------------------------


def test_parse_json_body_object():
    assert parse_json_body(b'{"a": [1, 2]}') == {"a": [1, 2]}


@pytest.mark.parametrize("raw", [b"{bad", b'{"a": 1', b"\xff\xfe", b"nul"])
def test_parse_json_body_malformed_is_a_400_naming_it(raw):
    r = parse_json_body(raw)
    assert isinstance(r, Reject) and r.status == 400 and r.code == "malformed_json"
    assert r.message.startswith("request body is not valid JSON: ")


@pytest.mark.parametrize("raw", [b"", b"   ", b"\n\t "])
def test_parse_json_body_empty_is_a_400_unless_allowed(raw):
    r = parse_json_body(raw)
    assert isinstance(r, Reject) and r.status == 400 and r.code == "empty_body"
    assert parse_json_body(raw, allow_empty=True) is None


def test_allow_empty_does_not_excuse_malformed_json():
    r = parse_json_body(b"{", allow_empty=True)
    assert isinstance(r, Reject) and r.code == "malformed_json"


# --- KServe ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, model", [
    ("/v2/models/m/versions/1/infer", "m"),
    ("/v2/models/m/infer", "m"),
    ("/v2/models/fraud-score", "fraud-score"),
    ("/v2/models/m/ready", "m"),
    ("/v2/models/m/infer?trace=1", "m"),
    ("/v2/health/ready", None),
    ("/v2/health/live", None),
    ("/v2", None),
    ("/v2/", None),
    ("/v2/models", None),
    ("/v2/models/", None),
    ("/v2/repository/index", None),
    ("/inference.GRPCInferenceService/ModelInfer", None),
    ("/inference.GRPCInferenceService/ServerReady", None),
    ("/v1/models/m", None),
    ("", None),
])
def test_kserve_model(path, model):
    assert kserve_model(path) == model


def test_parse_kserve():
    r = parse_kserve("/v2/models/m/versions/3/infer", tenant="acme")
    assert (r.api, r.model, r.tenant, r.body) == ("kserve.v2", "m", "acme", None)
    r = parse_kserve("/inference.GRPCInferenceService/ModelInfer", {"inputs": []})
    assert r.api == "kserve.v2" and r.model is None and r.body == {"inputs": []}


# --- survivors of mutation testing (issue 9): exact values where the suite only checked kinds -------


def test_prompt_text_counts_a_content_part_without_text_as_empty():
    r = InferenceRequest(api="openai.chat", messages=({"content": [{"type": "image_url"}, {"type": "text", "text": "hi"}]},))
    assert r.prompt_text() == "\nhi"


def test_parse_json_body_empty_message_is_exact():
    r = parse_json_body(b" ")
    assert r.message == "request body is empty; this route expects a JSON document"


@pytest.mark.parametrize("path, model", [
    ("/v2/models/m?trace=1", "m"),  # the query ends the model name
    ("/v2/models/m?a=1?b=2", "m"),  # at the first `?`
    ("/v2/models/X", "X"),  # only slashes are stripped from the ends
    ("X/v2/models/m/X", None),
])
def test_kserve_model_query_and_edges(path, model):
    assert kserve_model(path) == model
