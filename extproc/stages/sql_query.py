"""Stage `sql-query`: a question -> the model writes SQL over the route's database -> checked, run read-only
-> the rows to the client.

What: at the request body the client's JSON question (`{"question": "..."}`, the field named by
`sql.questionField`) becomes a chat request to the route's openai-kind backend: a system message
with the database schema introspected at config load (`Route.sql`, extproc/semantic/sql.py), the
question as the user message, `temperature: 0`, `max_tokens` from `sql.maxTokens`; `dispatch`,
next in the same reply, routes it. At the response body the model's answer (`choices[0].message
.content`) is the SQL: `check_sql` refuses anything but one SELECT over known tables and columns
(no writing, sleeping or file functions) and caps its LIMIT, then it runs on a read-only
connection with the statement timeout, in a worker thread (`asyncio.to_thread`: the worker's
event loop keeps serving other streams). The client gets 200 with `{"sql", "columns", "rows",
"row_count", "truncated"}`, or that document (plus `input`, the client's) through the route's
`transform` template.
Refusals, in the route's dialect and logged (warning, with the model's SQL): 422 `sql_refused` with
`reason` (`parse_error`, `multiple_statements`, `not_read_only`, `unknown_table`, `unknown_column`,
`forbidden_function`) and the `sql` refused; 504 `sql_timeout`; 502 `sql_error` (the database
refused the query: a runtime error), `sql_result_too_large` (the encoded rows over MAX_RESULT_BYTES,
1 MiB) and `backend_bad_response` (no answer text); a backend's own
error is sanitised like decode-response (502/4xx `backend_error`, its body only in the log).
Parameters: the route's `sql` block (docs/sql-adapter.md). Connections: the worker's
`Connections` in `Runtime.cache("sql")` (PostgreSQL connections kept idle, SQLite one per query).
Cost: request: one JSON parse and one encode (the schema text is precomputed); response: one JSON
parse, one sqlglot parse + qualify, the query, one encode (perf/bench_sql.py: adapter time without
the model).
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from extproc.errors import reject
from extproc.request import InferenceRequest
from extproc.semantic.sql import (Connections, SqlFailed, SqlRefused, check_sql, extract_sql, result_document)
from extproc.stages.body_limit import check_length
from extproc.stages.dispatch import backend_of
from extproc.template import MissingPathError
from extproc.types import HttpMessage, Mutate, RequestState, Verdict

CACHE = "sql"
ERROR_LOG_LIMIT = 2048  # bytes of a backend's error body written to the log
CHAT_PATH = "/v1/chat/completions"
MAX_RESULT_BYTES = 1024 * 1024  # the encoded rows, at most (a query can build huge values within its timeout)
log = logging.getLogger(__name__)


def connections(state: RequestState, own: dict) -> Connections:
    """The worker's connections (`Runtime.cache("sql")`); a stage used without a runtime keeps its own."""
    cache = state.runtime.cache(CACHE) if state.runtime is not None else own
    conns = cache.get("connections")
    if conns is None:
        conns = cache["connections"] = Connections()
    return conns


class SqlQuery:
    name = "sql-query"

    def __init__(self) -> None:
        self._own: dict = {}  # connections when run without a runtime (unit tests)

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        cfg = route.sql
        too_large = check_length(state, len(msg.body))
        if too_large is not None:
            return too_large
        try:
            doc = orjson.loads(msg.body)
        except orjson.JSONDecodeError as e:
            return reject(400, "malformed_json", f"request body is not valid JSON: {e}")
        question = doc.get(cfg.question_field) if isinstance(doc, dict) else None
        if not isinstance(question, str) or not question.strip():
            return reject(400, "missing_question", f"the body needs `{cfg.question_field}`: the question, as a string",
                          path=f"/{cfg.question_field}")
        messages = cfg.user_prompt(question)
        chat = {"model": route.model, "messages": messages, "temperature": 0, "max_tokens": cfg.max_tokens}
        body = orjson.dumps(chat)
        state.input_doc = doc
        state.request = InferenceRequest(api="openai", model=route.model, messages=tuple(messages),
                                         max_tokens=cfg.max_tokens, tenant=state.tenant, body=chat)
        state.backend_request = body
        return Mutate(set_headers=((":path", CHAT_PATH), ("content-type", "application/json"),
                                   ("content-length", str(len(body)))), body=body)

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        status = state.response_status or 0
        from_upstream = (state.response_details == "via_upstream" if state.response_details is not None
                         else bool(state.served))
        if state.backend_request is None or (status >= 300 and not from_upstream):
            return Mutate(skip_body=True)  # answered before the model was asked, or Envoy's own error: as it is
        return None

    async def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        cfg = route.sql
        backend = backend_of(state)
        status = state.response_status or 200
        if status >= 300:
            log.warning("route %s: backend %s (%s) answered HTTP %d to request %s; its body, not returned to the "
                        "client: %r", route.name, backend.name, state.served, status, state.request_id,
                        msg.body[:ERROR_LOG_LIMIT])
            return reject(status if 400 <= status < 500 else 502, "backend_error",
                          f"backend {backend.name} answered HTTP {status}; the gateway logged its answer under "
                          f"request id {state.request_id}", backend=backend.name)
        try:
            resp = orjson.loads(msg.body)
            answer = resp["choices"][0]["message"]["content"]
            if not isinstance(answer, str):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return reject(502, "backend_bad_response",
                          f"backend {backend.name} answered with no choices[0].message.content text", backend=backend.name)
        state.usage = backend.adapter.usage(resp)
        sql = extract_sql(answer)
        try:
            checked = check_sql(sql, cfg)
        except SqlRefused as e:
            log.warning("route %s: refused the model's SQL for request %s (%s): %s; SQL: %r", route.name,
                        state.request_id, e.reason, e, sql[:ERROR_LOG_LIMIT])
            return reject(422, "sql_refused", f"the model's SQL was refused ({e.reason}): {e}", reason=e.reason,
                          sql=sql[:ERROR_LOG_LIMIT])
        try:
            result = await asyncio.to_thread(connections(state, self._own).run, cfg, checked)
        except SqlFailed as e:
            log.warning("route %s: the model's SQL for request %s failed (%s): %s; SQL: %r", route.name,
                        state.request_id, e.reason, e, checked.sql[:ERROR_LOG_LIMIT])
            if e.reason == "timeout":
                return reject(504, "sql_timeout", str(e), reason="timeout", sql=checked.sql)
            return reject(502, "sql_error", str(e), reason=e.reason, sql=checked.sql)
        out = result_document(checked, result)
        if route.transform is None:
            body = orjson.dumps(out)
        else:
            out["input"] = state.input_doc
            try:
                body = route.transform.render_json(out)
            except MissingPathError as e:
                return reject(502, "transform_path_missing", f"response transform: {e.path} not found in the result",
                              path=e.path)
        if len(body) > MAX_RESULT_BYTES:
            log.warning("route %s: the result of request %s is %d bytes, over %d (result_too_large); SQL: %r", route.name,
                        state.request_id, len(body), MAX_RESULT_BYTES, checked.sql[:ERROR_LOG_LIMIT])
            return reject(502, "sql_result_too_large", f"the query's result is {len(body)} bytes, over the gateway's "
                          f"{MAX_RESULT_BYTES}", reason="result_too_large", sql=checked.sql)
        return Mutate(set_headers=((":status", "200"), ("content-type", "application/json"),
                                   ("x-adapter-sql-rows", str(len(result.rows)))),
                      remove_headers=("content-length",), body=body)


__all__ = ["SqlQuery"]
