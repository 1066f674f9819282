"""Stage `sql-query` on a compiled sql route over a real SQLite file: the chat request it builds (schema in
the system message, the question, the chat path and an exact content-length), the refusals before the
model is asked, the model's SQL run and the rows returned (as JSON, or through the route's
transform), the refusal and failure answers (422 with the reason, 504, 502), a backend's own error
sanitised, and Envoy's own replies passed as they are."""

from __future__ import annotations

import sqlite3

import orjson
import pytest

from extproc.config.loader import load_file
from extproc.stages.sql_query import SqlQuery
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: sql}
spec:
  backends: [{name: llm, kind: openai, endpoints: ["127.0.0.1:9001"], models: [m]}]
  routes:
    - {path: /ask, kind: sql, target: llm, sql: {database: shop.db, maxRows: 2, timeout: 200ms}, policy: {maxBodyBytes: 300}}
    - {path: /count, kind: sql, target: llm, sql: {database: shop.db, questionField: q},
       transform: '{"n": $.rows[0][0], "asked": $.input.q}'}
"""


@pytest.fixture
def snap(tmp_path):
    conn = sqlite3.connect(tmp_path / "shop.db")
    conn.executescript("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL);"
                       "INSERT INTO orders VALUES (1, 10.5), (2, 4.5), (3, 7);")
    conn.commit()
    conn.close()
    (tmp_path / "gateway.yaml").write_text(CONFIG)
    return load_file(tmp_path / "gateway.yaml")


def state(snap, route="ask") -> RequestState:
    return RequestState(snapshot=snap, route=snap.routes[route], started=0.0, request_id="req-1")


def answer(sql: str) -> bytes:
    return orjson.dumps({"choices": [{"message": {"role": "assistant", "content": sql}}],
                         "usage": {"prompt_tokens": 50, "completion_tokens": 9}})


async def respond(stage, st, body: bytes, status: int = 200, details: str | None = "via_upstream"):
    st.response_status, st.response_details = status, details
    head = stage.on_response_headers(st, HttpMessage(Phase.RESPONSE_HEADERS, headers={":status": str(status)}))
    if head is not None:
        return head
    return await stage.on_response_body(st, HttpMessage(Phase.RESPONSE_BODY, body=body, end_of_stream=True))


def ask(stage, st, doc) -> Mutate | Reject:
    return stage.on_request_body(st, HttpMessage(Phase.REQUEST_BODY, body=orjson.dumps(doc), end_of_stream=True))


def test_the_question_becomes_a_chat_request_with_the_schema(snap):
    stage, st = SqlQuery(), state(snap)
    v = ask(stage, st, {"question": "What is the largest order?"})
    assert isinstance(v, Mutate)
    headers = dict(v.set_headers)
    assert headers[":path"] == "/v1/chat/completions" and headers["content-length"] == str(len(v.body))
    chat = orjson.loads(v.body)
    assert chat["model"] == "m" and chat["temperature"] == 0 and chat["max_tokens"] == 512
    system, user = chat["messages"]
    assert "orders(id integer PK, total real)" in system["content"] and "at most 2 rows" in system["content"]
    assert user == {"role": "user", "content": "What is the largest order?"}
    assert st.request.model == "m" and st.request.prompt_text().endswith("What is the largest order?")
    assert st.backend_request == v.body


@pytest.mark.parametrize("body, status, code", [
    (b'{"question": ', 400, "malformed_json"),
    (b'{"q": "x"}', 400, "missing_question"),
    (b'{"question": "   "}', 400, "missing_question"),
    (b'["question"]', 400, "missing_question"),
    (b'{"question": "' + b"x" * 400 + b'"}', 413, "body_too_large"),
])
def test_refusals_before_the_model_is_asked(snap, body, status, code):
    v = SqlQuery().on_request_body(state(snap), HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True))
    assert isinstance(v, Reject) and (v.status, v.code) == (status, code)


async def test_the_models_sql_runs_and_the_rows_come_back(snap):
    stage, st = SqlQuery(), state(snap)
    ask(stage, st, {"question": "orders by size"})
    v = await respond(stage, st, answer("```sql\nSELECT id, total FROM orders ORDER BY total DESC;\n```"))
    assert isinstance(v, Mutate) and dict(v.set_headers)[":status"] == "200"
    assert dict(v.set_headers)["x-adapter-sql-rows"] == "2"
    assert orjson.loads(v.body) == {"sql": "SELECT id, total FROM orders ORDER BY total DESC LIMIT 3",
                                    "columns": ["id", "total"], "rows": [[1, 10.5], [3, 7.0]], "row_count": 2,
                                    "truncated": True}
    assert (st.usage.prompt_tokens, st.usage.completion_tokens) == (50, 9)


async def test_the_route_transform_maps_the_result(snap):
    stage, st = SqlQuery(), state(snap, "count")
    ask(stage, st, {"q": "how many orders?"})
    v = await respond(stage, st, answer("SELECT COUNT(*) FROM orders"))
    assert orjson.loads(v.body) == {"n": 3, "asked": "how many orders?"}


@pytest.mark.parametrize("sql, status, code, reason", [
    ("DELETE FROM orders", 422, "sql_refused", "not_read_only"),
    ("SELECT * FROM customers", 422, "sql_refused", "unknown_table"),
    ("SELECT price FROM orders", 422, "sql_refused", "unknown_column"),
    ("I cannot answer that.", 422, "sql_refused", "parse_error"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c", 504, "sql_timeout",
     "timeout"),
    ("SELECT 1 / 0 + abs(-9223372036854775808)", 502, "sql_error", "database_error"),
    ("SELECT printf('%.*c', 700000, 'x') AS a, printf('%.*c', 700000, 'y') AS b", 502, "sql_result_too_large",
     "result_too_large"),
])
async def test_refused_and_failed_sql_are_errors_naming_the_reason(snap, caplog, sql, status, code, reason):
    stage, st = SqlQuery(), state(snap)
    ask(stage, st, {"question": "q"})
    v = await respond(stage, st, answer(sql))
    assert isinstance(v, Reject) and (v.status, v.code, v.fields["reason"]) == (status, code, reason)
    assert v.fields["sql"] and (f"({reason})" in v.message if code == "sql_refused" else "the " in v.message)
    assert any(reason in r.getMessage() and "req-1" in r.getMessage() for r in caplog.records)


async def test_a_backend_error_is_sanitised_and_envoys_own_reply_passes(snap, caplog):
    stage, st = SqlQuery(), state(snap)
    ask(stage, st, {"question": "q"})
    v = await respond(stage, st, b'{"error": "Traceback: /srv/secret.py line 3"}', status=500)
    assert isinstance(v, Reject) and (v.status, v.code) == (502, "backend_error") and "secret" not in v.message
    assert "req-1" in v.message and any("secret.py" in r.getMessage() for r in caplog.records)
    st = state(snap)
    ask(stage, st, {"question": "q"})
    v = await respond(stage, st, b"", status=503, details="upstream_reset_before_response_started")
    assert isinstance(v, Mutate) and v.skip_body  # Envoy's own 503: as it is
    v = await respond(stage, st := state(snap), b"")  # nothing was asked (e.g. answered at the request): as it is
    assert isinstance(v, Mutate) and v.skip_body
    st = state(snap)
    ask(stage, st, {"question": "q"})
    v = await respond(stage, st, b'{"choices": []}')
    assert isinstance(v, Reject) and (v.status, v.code) == (502, "backend_bad_response")
