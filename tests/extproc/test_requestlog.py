"""extproc/requestlog.py: records only while a follower's file is fresh (the highest level asked wins),
what a record holds at info and debug, secrets redacted and bodies cut, rotation; and the CLI's Tail and
pretty printer (extproc/logs_cli.py)."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import orjson

from backends.base import Usage
from canary.assign import Assignment
from extproc.lifecycle import Completion
from extproc.logs_cli import Tail, keep, pretty
from extproc.requestlog import BODY_LIMIT, FOLLOW_FILE, REDACTED, RequestLog, body_view, record, redact
from extproc.types import Outcome, RequestState

ROUTE = SimpleNamespace(name="v1", kind="openai", pipeline=SimpleNamespace(stages=(
    SimpleNamespace(name="admit"), SimpleNamespace(name="openai-parse"), SimpleNamespace(name="dispatch"))))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def follow(d, level="info", pid=1, age=0.0):
    p = d / f"{FOLLOW_FILE}.{pid}"
    p.write_text(json.dumps({"level": level}))
    if age:
        t = time.time() - age
        os.utime(p, (t, t))
    return p


def state(**kw) -> RequestState:
    st = RequestState(snapshot=None, route=ROUTE, started=time.monotonic() - 0.25, request_id="rid-1",
                      tenant="acme")
    st.backend, st.endpoint, st.variant = "llm", "10.0.0.5:8000", "r/canary"
    st.attrs["canary.assignment"] = Assignment("r", "canary", "hash", 1234, "header:x-user-id", ())
    st.completion = Completion(status=200, upstream="10.0.0.5:8000", duration=0.25)
    st.usage = Usage(prompt_tokens=5, completion_tokens=7)
    st.input_doc = {"query": "Q3", "api_key": "sk-live-123", "nested": {"Authorization": "Bearer x"}}
    st.backend_request = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                       "password": "hunter2"})
    for k, v in kw.items():
        setattr(st, k, v)
    return st


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_nothing_is_written_without_a_fresh_follower(tmp_path):
    clock = Clock()
    log = RequestLog(tmp_path, 0, clock=clock)
    log(state(), Outcome.OK)
    follow(tmp_path, age=60)  # a stale follower (its CLI died)
    clock.t += 2
    log(state(), Outcome.OK)
    assert not log.path.exists()


def test_a_follower_gets_info_records_and_debug_when_any_follower_asks(tmp_path):
    clock = Clock()
    log = RequestLog(tmp_path, 3, clock=clock)
    follow(tmp_path, "info", pid=1)
    log(state(), Outcome.OK)
    (rec,) = lines(log.path)
    assert rec["worker"] == 3 and rec["route"] == "v1" and rec["tenant"] == "acme" and rec["status"] == 200
    assert rec["outcome"] == "ok" and rec["duration_ms"] == 250.0 and rec["served"] == "10.0.0.5:8000"
    assert rec["variant"] == "r/canary" and rec["assignment"]["source"] == "header:x-user-id"
    assert rec["usage"] == {"prompt_tokens": 5, "completion_tokens": 7}
    assert "backend_request" not in rec and "input" not in rec
    follow(tmp_path, "debug", pid=2)
    log(state(), Outcome.OK)  # within the second: the level is not read again yet
    clock.t += 1.5
    log(state(), Outcome.OK)
    debug = lines(log.path)[-1]
    assert debug["stages"] == ["admit", "openai-parse", "dispatch"]
    assert debug["input"]["api_key"] == REDACTED and debug["input"]["nested"]["Authorization"] == REDACTED
    assert debug["backend_request"]["password"] == REDACTED and debug["backend_request"]["model"] == "m"
    assert "sk-live-123" not in log.path.read_text() and "hunter2" not in log.path.read_text()
    for p in tmp_path.glob(FOLLOW_FILE + ".*"):
        p.unlink()
    clock.t += 1.5
    log(state(), Outcome.OK)  # the followers left: nothing more
    assert len(lines(log.path)) == 3 and log._file is None


def test_bodies_are_cut_and_non_json_secrets_removed():
    big = b'{"text": "' + b"x" * (BODY_LIMIT * 2) + b'"}'
    view = body_view(big)
    assert isinstance(view, str) and len(view) <= BODY_LIMIT + 1 and view.endswith("…")
    form = body_view(b"user=a&password=secret123&token=abc x-api-key: k9")
    assert "secret123" not in form and "abc" not in form and "k9" not in form and "user=a" in form
    assert body_view(None) is None
    assert redact({"a": [{"refresh_token": "t"}], "b": 1}) == {"a": [{"refresh_token": REDACTED}], "b": 1}


def test_an_error_answer_records_the_processors_code_and_status():
    st = state(reply_status=404, reply_code="model_not_found", completion=None, usage=None)
    rec = record(st, Outcome.REJECTED, 0, "info")
    assert rec["status"] == 404 and rec["error"] == "model_not_found" and rec["outcome"] == "rejected"


def test_rotation_keeps_one_older_file(tmp_path, monkeypatch):
    import extproc.requestlog as rl

    monkeypatch.setattr(rl, "MAX_BYTES", 2000)
    clock = Clock()
    log = RequestLog(tmp_path, 0, clock=clock)
    follow(tmp_path)
    for _ in range(20):
        log(state(), Outcome.OK)
    assert (tmp_path / "requests-0.jsonl.1").exists() and log.path.stat().st_size <= 2000 + 1000


def test_tail_reads_new_lines_of_every_worker_across_rotation(tmp_path):
    a, b = tmp_path / "requests-0.jsonl", tmp_path / "requests-1.jsonl"
    a.write_text(json.dumps({"n": 1}) + "\n")
    t = Tail(str(tmp_path), from_end=True)
    assert list(t.poll()) == []
    with open(a, "a") as f:
        f.write(json.dumps({"n": 2}) + "\n" + '{"n": 3')  # a partial line waits for its end
    b.write_text(json.dumps({"n": 10}) + "\n")
    assert list(t.poll()) == [{"n": 2}, {"n": 10}]
    with open(a, "a") as f:
        f.write("}\n")
    assert list(t.poll()) == [{"n": 3}]
    os.replace(a, tmp_path / "requests-0.jsonl.1")
    a.write_text(json.dumps({"n": 4}) + "\n")  # the rotated worker's new file: from its start
    assert list(t.poll()) == [{"n": 4}]
    assert [r["n"] for r in Tail(str(tmp_path), from_end=False).poll()] == [4, 10]


def test_pretty_and_filters():
    rec = record(state(), Outcome.OK, 1, "debug")
    text = pretty(rec)
    first, *rest = text.splitlines()
    assert "w1 v1 tenant=acme 200 ok 250.0ms" in first and "variant=r/canary (hash header:x-user-id)" in first
    assert any(line.strip().startswith("backend_request:") for line in rest)
    assert keep(rec, "v1", None) and not keep(rec, "v2", None) and keep(rec, None, "acme") and not keep(rec, None, "x")
