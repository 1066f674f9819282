"""Faults end to end: backend down, processor down (closed and open), limits, bad config, Ctrl-C, reload."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from extproc.stack import free_port, free_port_block
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
FAULTS = REPO / "tests" / "e2e" / "faults.yaml"
CHAT = {"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_backend_down_and_body_limit(stack_factory):
    st = stack_factory(FAULTS, simulate={"llm"})
    down = httpx.post(f"{st.url}/v1/dead", content=b'{"q": 1}', timeout=10)
    assert down.status_code == 503
    err = down.json()["error"]
    assert err["backend"] == "dead" and "connection" in err["message"]
    small = httpx.post(f"{st.url}/v1/small", content=b'{"q": "' + b"x" * 4096 + b'"}', timeout=10)
    assert small.status_code == 413 and small.json()["error"]["status"] == 413
    fits = httpx.post(f"{st.url}/v1/small", content=b'{"q": "x"}', timeout=10)
    assert fits.status_code == 200 and set(fits.json()) == {"a"}
    health = httpx.get(f"{st.url}/health/adapter?probe=protocol-negotiation", timeout=10)
    assert health.status_code == 503 and health.json()["failed"] == ["backend dead"]


def test_a_backends_own_error_body_is_sanitised_on_an_adapting_route(stack_factory):
    """The simulator answers 500 with its own error body (a real llama.cpp server puts its source file
    and line there); the llm route's client gets the route's error with the status kept, the backend
    named and the request id, and none of the backend's text."""
    st = stack_factory(FAULTS, simulate={"llm"})
    r = httpx.post(f"{st.url}/v1/analyze", content=b'{"query": "Q3"}', headers={"x-simulator-fault": "status=500"},
                   timeout=10)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "backend_error" and err["backend"] == "llm"
    assert "simulated engine failure" not in r.text and "InternalServerError" not in r.text
    assert err.get("request_id") or "request id" in err["message"]
    ok = httpx.post(f"{st.url}/v1/analyze", content=b'{"query": "Q3"}', timeout=10)
    assert ok.status_code == 200  # the next request is served as usual


def test_processor_down_follows_each_routes_failure_mode(stack_factory):
    st = stack_factory(FAULTS, simulate={"llm"})
    assert httpx.post(f"{st.url}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    st.supervisor.stop()  # every worker gone
    closed = httpx.post(f"{st.url}/v1/closed", json=CHAT, timeout=10)
    assert closed.status_code == 503
    assert closed.json()["error"]["status"] == 503 and "ext_proc" in closed.json()["error"]["code"]
    llm = httpx.post(f"{st.url}/v1/analyze", content=b'{"query": "q"}', timeout=10)
    assert llm.status_code == 503  # closed is the default
    opened = httpx.post(f"{st.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert opened.status_code == 200 and opened.json()["object"] == "chat.completion"  # passed through
    health = httpx.get(f"{st.url}/health/adapter", timeout=10)
    assert health.status_code == 503


def test_invalid_config_at_start_exits_non_zero_with_the_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(FAULTS.read_text().replace("target: dead", "target: nowhere"))
    for cmd in (["validate", str(bad)], ["up", str(bad), "--port", str(free_port())]):
        out = subprocess.run([sys.executable, "-m", "extproc", *cmd], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out
        assert f"{bad}:19: spec.routes[2].target: 'nowhere' is neither a declared backend" in out.stderr


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found.update(kids)
                todo.extend(kids)
        except FileNotFoundError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_stops_everything_and_leaves_no_process(tmp_path):
    import yaml

    # the example with free processor ports: its fixed 50051-50052 lie in the kernel's ephemeral range,
    # where a port an earlier test's process still holds can collide
    doc = yaml.safe_load((REPO / "examples" / "finance-llm-adapter.yaml").read_text())
    doc["spec"].setdefault("processor", {}).update(basePort=free_port_block(2), adminPort=free_port())
    cfg = tmp_path / "finance-llm-adapter.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    cmd = [sys.executable, "-m", "extproc", "up", str(cfg), "--simulate",
           "--port", str(free_port()), "--admin-port", str(free_port()), "--workers", "2"]
    env = dict(os.environ)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops everything" in line or not line:
                break
        assert any("is up" in ln for ln in lines), "".join(lines)
        children = _descendants(proc.pid)
        assert len(children) >= 4  # simulator, 2 workers, envoy
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.1)
        assert not [c for c in children if _alive(c)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generations(st, n: int = 12) -> set[int]:
    gens = set()
    for _ in range(n):
        r = httpx.get(f"{st.url}/health/adapter?probe=processor", timeout=10)
        gens.add(r.json()["processor"]["generation"])
    return gens


def test_reload_applies_a_valid_config_and_keeps_the_last_good_one(stack_factory, tmp_path, caplog):
    cfg = tmp_path / "live.yaml"
    cfg.write_text(FAULTS.read_text())
    st = stack_factory(cfg, simulate={"llm"})
    assert _generations(st) == {1}
    cfg.write_text(FAULTS.read_text().replace('"account": $.output.account', '"acct": $.output.account'))
    st.supervisor.reload()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _generations(st) != {2}:
        time.sleep(0.2)
    assert _generations(st) == {2}
    r = httpx.post(f"{st.url}/v1/analyze", content=b'{"query": "q"}', timeout=10)
    assert set(r.json()["voucher"]) == {"amount", "acct"}
    cfg.write_text("apiVersion: adapter.ai/v1\nkind: AdapterGateway\nspec: {routes: []}\n")  # invalid
    caplog.set_level(logging.ERROR, logger="extproc.supervisor")
    refused = st.supervisor.reload()  # returns once the refusal is logged: nothing is left to happen
    assert not refused.accepted and refused.generation == 2 and f"{cfg}:3: spec.routes" in refused.errors
    logged = [r.getMessage() for r in caplog.records if "config reload refused" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("config reload refused, keeping generation 2 ")
    assert f"{cfg}:3: spec.routes" in logged[0]
    state = httpx.get(f"{st.processor_admin_url}/config", timeout=10).json()
    assert state["reloads"] == {"accepted": 1, "refused": 1} and state["generation"] == 2
    assert [w["generation"] for w in state["workers"]] == [2, 2]
    assert _generations(st) == {2}  # refused: still serving the last good config
    assert httpx.post(f"{st.url}/v1/analyze", content=b'{"query": "q"}', timeout=10).status_code == 200
