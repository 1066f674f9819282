"""The core for scheduling through the real Envoy and processor: live reloads, endpoint picks, outcomes.

- Routes, backends and endpoints added and removed by 20+ reloads over 30+ s while a load
  generator runs: no failed request, one Envoy process, each new route answering at once.
- A worker restarted after the config file broke serves the last accepted generation.
- The processor's endpoint pick (`pinned-endpoint`, `least-in-flight`) is where Envoy sends the
  request, checked by each upstream's own request count; a reload that changes the pick's
  parameters applies to the same plugin instance.
- A backend's 500 and a client that goes away mid-stream are counted with their outcomes
  (`backend_error`, `cancelled`), from Envoy's access log.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from extproc.stack import free_port
from tests.e2e.conftest import metric_sum, wait_metric
from tests.promtext import scrape
from tests.e2e.test_xds_live import Load, echo, procs, wait_for  # noqa: F401  (procs is a fixture)

pytestmark = pytest.mark.e2e


def write_config(path: Path, backends: dict[str, list[str]], routes: list[tuple[str, str]],
                 plugins: list[dict] | None = None, route_plugins: dict[str, list[str]] | None = None,
                 kind: str = "passthrough") -> Path:
    """An AdapterGateway file with IP endpoints (so the processor can pick them); ports of the
    listener and processor are the stack's own."""
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "core"},
        "spec": {
            "backends": [{"name": n, "endpoints": eps} for n, eps in backends.items()],
            "routes": [{"path": p, "target": t, "kind": kind, **({"plugins": route_plugins[p]}
                                                               if route_plugins and p in route_plugins else {})}
                       for p, t in routes],
            **({"plugins": plugins} if plugins else {}),
        },
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def test_routes_backends_and_endpoints_change_by_reload_under_load(tmp_path, procs, stack_factory):
    a1, a2, b1, b2 = (echo(procs) for _ in range(4))
    cfg = tmp_path / "gw.yaml"
    backends = {"a": [a1.id]}
    routes = [("/a", "a")]
    write_config(cfg, backends, routes)
    st = stack_factory(cfg, workers=2, run_dir=str(tmp_path / "run"))
    pid = st.envoy_pid
    added_routes: list[str] = []
    a2_seen_while_in = False
    started = time.monotonic()
    with Load(st.url, ["/a"]) as load:
        for i in range(20):
            step = i % 4
            if step == 0:  # a new backend and a new route to it
                backends = {**backends, f"b{i}": [b1.id]}
                routes = [*routes, (f"/live-{i}", f"b{i}")]
            elif step == 1:  # a new endpoint in an existing backend
                backends = {**backends, "a": [a1.id, a2.id]}
            elif step == 2:  # an endpoint removed (its upstream keeps running: in-flight requests end well)
                a2_seen_while_in = a2_seen_while_in or a2.count() > 0
                backends = {**backends, "a": [a1.id]}
            else:  # another endpoint for the newest backend, and a route removed
                newest = next(n for n in reversed(list(backends)) if n.startswith("b"))
                backends = {**backends, newest: [b1.id, b2.id]}
                if len(routes) > 3:
                    gone = routes[1]
                    routes = [r for r in routes if r != gone]
                    load.paths = [p for p in load.paths if p != gone[0]]
            write_config(cfg, backends, routes)
            result = st.reload()
            assert result.accepted and set(result.workers.values()) == {result.generation}, result
            new = [p for p, _ in routes if p not in load.paths]
            for p in new:  # the new route answers at once: Envoy had the files before reload() returned
                r = httpx.get(st.url + p, timeout=5)
                assert r.status_code == 200, (p, r.status_code, r.text)
                added_routes.append(p)
            load.paths = [p for p, _ in routes]
            time.sleep(max(0.0, (i + 1) * 1.5 - (time.monotonic() - started)))
        a2_after_removal = a2.count()
        time.sleep(1.0)
        assert a2.count() == a2_after_removal, "a removed endpoint still got new requests"
    elapsed = time.monotonic() - started
    print(f"\n{load.sent} requests during 20 reloads in {elapsed:.1f}s: {len(load.failed)} failed; "
          f"Envoy pid {pid} throughout")
    assert elapsed >= 30
    assert load.failed == [], load.failed[:10]
    assert load.sent > 500, load.sent
    assert a2_seen_while_in, "the added endpoint never served"
    assert len(added_routes) == 5 and st.envoy_pid == pid and st.envoy.poll() is None


def test_a_worker_restarted_after_the_file_broke_serves_the_last_accepted_generation(tmp_path, procs,
                                                                                    stack_factory):
    a1 = echo(procs)
    cfg = write_config(tmp_path / "gw.yaml", {"a": [a1.id]}, [("/a", "a")])
    st = stack_factory(cfg, workers=2, run_dir=str(tmp_path / "run"))
    write_config(cfg, {"a": [a1.id]}, [("/a", "a"), ("/x", "a")])
    good = st.reload()
    assert good.accepted
    cfg.write_text(cfg.read_text().replace('"routes"', '"routez"'))  # now invalid
    refused = st.reload()
    assert not refused.accepted and "routez" in refused.errors and "gw.yaml:" in refused.errors
    victim = st.supervisor.workers[0]
    old_pid = victim.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    admin = st.processor_admin_url

    def restarted() -> bool:
        doc = httpx.get(f"{admin}/config", timeout=5).json()
        w = next(w for w in doc["workers"] if w["index"] == 0)
        return w["pid"] != old_pid and w["alive"] and w.get("ready", True) and w["generation"] == good.generation

    wait_for(restarted, 30, "worker 0 restarted on the last accepted bundle")
    doc = httpx.get(f"{admin}/config", timeout=5).json()
    assert {w["digest"] for w in doc["workers"]} == {good.digest}
    # both workers serve the route only the last accepted generation has (Envoy still routes to it)
    codes = [httpx.get(f"{st.url}/x", timeout=5).status_code for _ in range(40)]
    assert codes == [200] * 40


def test_the_processor_picks_the_endpoint_envoy_sends_to(tmp_path, procs, stack_factory):
    e1, e2 = echo(procs), echo(procs)
    cfg = tmp_path / "gw.yaml"

    def config(pinned: str) -> None:
        write_config(cfg, {"pool": [e1.id, e2.id]}, [("/pinned", "pool"), ("/spread", "pool")],
                     plugins=[{"name": "pin", "type": "pinned-endpoint", "parameters": {"endpoint": pinned}},
                              {"name": "spread", "type": "least-in-flight"}],
                     route_plugins={"/pinned": ["pin"], "/spread": ["spread"]})

    config(e2.id)
    st = stack_factory(cfg, workers=2, run_dir=str(tmp_path / "run"))
    before = (e1.count(), e2.count())
    for _ in range(30):
        r = httpx.get(f"{st.url}/pinned", timeout=5)
        assert r.status_code == 200 and r.json()["port"] == e2.port
        assert r.json()["destination"] == f"{e2.id},{e1.id}"  # the pick, then the fallback
    assert (e1.count() - before[0], e2.count() - before[1]) == (0, 30)
    config(e1.id)  # same plugin, new parameters: configure() on the instance each worker keeps
    assert st.reload().accepted
    before = (e1.count(), e2.count())
    for _ in range(20):
        assert httpx.get(f"{st.url}/pinned", timeout=5).json()["port"] == e1.port
    assert (e1.count() - before[0], e2.count() - before[1]) == (20, 0)
    # least in flight: sequential requests are all ties, rotated, so both endpoints serve
    ports = {httpx.get(f"{st.url}/spread", timeout=5).json()["port"] for _ in range(20)}
    assert ports == {e1.port, e2.port}
    # the endpoint that served is reported back: the in-flight counts return to zero
    url = f"{st.processor_admin_url}/metrics"
    assert wait_metric(url, "adapter_processor_requests_total", 70, outcome="ok") >= 70


def test_backend_errors_and_client_cancels_are_counted_with_their_outcomes(tmp_path, stack_factory):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: outcomes}
spec:
  backends:
    - {name: llm, endpoints: ["127.0.0.1:1"], models: [m]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, target: llm}
    - {path: /v1/completions, kind: passthrough, target: llm}
""")
    st = stack_factory(cfg, workers=2, simulate=True, simulator_args=("--decode-tokens-per-s", "20"))
    url = f"{st.processor_admin_url}/metrics"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(5):
        r = httpx.post(f"{st.url}/v1/chat/completions", json=chat, headers={"x-simulator-fault": "status=500"},
                       timeout=10)
        assert r.status_code == 500
        r = httpx.post(f"{st.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                       headers={"x-simulator-fault": "status=500"}, timeout=10)
        assert r.status_code == 500
    assert wait_metric(url, "adapter_processor_requests_total", 5, route="v1", outcome="backend_error") == 5
    # passthrough: the ext_proc stream ended at request headers; the outcome came from Envoy's log
    assert wait_metric(url, "adapter_processor_requests_total", 5, route="v1-completions",
                       outcome="backend_error") == 5
    assert metric_sum(url, "adapter_processor_requests_total", route="v1", outcome="ok") == 0
    # a client that leaves mid-stream: 200 tokens at 20 tokens/s, gone after the first chunk
    with httpx.Client(timeout=10) as client:
        for _ in range(3):
            with client.stream("POST", f"{st.url}/v1/chat/completions",
                               json={**chat, "max_tokens": 200, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_raw())
            # leaving the `with` closes the connection with the stream unfinished
    assert wait_metric(url, "adapter_processor_requests_total", 3, route="v1", outcome="cancelled") == 3
    ok = httpx.post(f"{st.url}/v1/chat/completions", json=chat, timeout=10)
    assert ok.status_code == 200
    assert wait_metric(url, "adapter_processor_requests_total", 1, route="v1", outcome="ok") == 1
    s = scrape(url)
    assert s.series("adapter_processor_requests_total") == {  # nothing else was counted, under no other label
        (("outcome", "backend_error"), ("route", "v1")): 5.0, (("outcome", "backend_error"), ("route", "v1-completions")): 5.0,
        (("outcome", "cancelled"), ("route", "v1")): 3.0, (("outcome", "ok"), ("route", "v1")): 1.0}
    # only the passthrough route asks Envoy's access log for its end: five entries, each matched; the
    # backend's first byte is known for every request that reached it (the openai route's from its stream)
    assert s.series("adapter_processor_feedback_entries_total") == {(("result", "matched"),): 5.0}
    assert s.series("adapter_processor_upstream_first_byte_seconds_count") == {
        (("backend", "llm"), ("route", "v1")): 9.0, (("backend", "llm"), ("route", "v1-completions")): 5.0}
    assert s.value("adapter_processor_upstream_first_byte_seconds_bucket", backend="llm", route="v1-completions",
                   le="+Inf") == 5
    assert s.value("adapter_processor_streams_active") == 0
