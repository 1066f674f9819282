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

from extproc.errors import reject
from extproc.semantic.sql import (Connections, SqlFailed, SqlRefused, check_sql, extract_sql, result_document)
from extproc.stages.adapter_steps import (ERROR_LOG_LIMIT, ask_model, client_json, model_answer, model_answered,
                                          render_result, worker_cache)
from extproc.types import HttpMessage, Mutate, Reject, RequestState, Verdict

CACHE = "sql"
MAX_RESULT_BYTES = 1024 * 1024  # the encoded rows, at most (a query can build huge values within its timeout)
log = logging.getLogger(__name__)


def connections(state: RequestState, own: dict) -> Connections:
    """The worker's connections (`Runtime.cache("sql")`); a stage used without a runtime keeps its own."""
    cache = worker_cache(state, CACHE, own)
    conns = cache.get("connections")
    if conns is None:
        conns = cache["connections"] = Connections()
    return conns


def _content_text(resp: dict) -> str:
    """The model's answer text (`choices[0].message.content`); TypeError when it is no string."""
    answer = resp["choices"][0]["message"]["content"]
    if not isinstance(answer, str):
        raise TypeError
    return answer


class SqlQuery:
    name = "sql-query"

    def __init__(self) -> None:
        self._own: dict = {}  # connections when run without a runtime (unit tests)

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        cfg = route.sql
        doc = client_json(state, msg)
        if isinstance(doc, Reject):
            return doc
        question = doc.get(cfg.question_field) if isinstance(doc, dict) else None
        if not isinstance(question, str) or not question.strip():
            return reject(400, "missing_question", f"the body needs `{cfg.question_field}`: the question, as a string",
                          path=f"/{cfg.question_field}")
        messages = cfg.user_prompt(question)
        chat = {"model": route.model, "messages": messages, "temperature": 0, "max_tokens": cfg.max_tokens}
        return ask_model(state, doc, chat)

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        return model_answered(state, state.backend_request is not None)

    async def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        cfg = route.sql
        answer = model_answer(state, msg, log, "choices[0].message.content text", _content_text)
        if isinstance(answer, Reject):
            return answer
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
        body = render_result(state, result_document(checked, result))
        if isinstance(body, Reject):
            return body
        if len(body) > MAX_RESULT_BYTES:
            log.warning("route %s: the result of request %s is %d bytes, over %d (result_too_large); SQL: %r", route.name,
                        state.request_id, len(body), MAX_RESULT_BYTES, checked.sql[:ERROR_LOG_LIMIT])
            return reject(502, "sql_result_too_large", f"the query's result is {len(body)} bytes, over the gateway's "
                          f"{MAX_RESULT_BYTES}", reason="result_too_large", sql=checked.sql)
        return Mutate(set_headers=((":status", "200"), ("content-type", "application/json"),
                                   ("x-adapter-sql-rows", str(len(result.rows)))),
                      remove_headers=("content-length",), body=body)


__all__ = ["SqlQuery"]
