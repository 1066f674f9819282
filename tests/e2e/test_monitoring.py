"""The monitoring kit (examples/monitoring/) against the real tools: `promtool` checks the alert rules and
runs their unit tests, and a real Prometheus server (Debian's, installed by `make setup`) scrapes a running
stack (Envoy + processor + OpenAI API simulators) and evaluates every dashboard query and every alert
expression without an error, the key panels with data."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from extproc.stack import free_port, stop_process
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
KIT = REPO / "examples" / "monitoring"
CONFIG = REPO / "examples" / "inference-backends.yaml"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (make setup installs "
                                    "Debian's prometheus package as root)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (make setup installs "
                                      "Debian's prometheus package as root)")


def dashboard_queries() -> list[tuple[str, str]]:
    doc = json.loads((KIT / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", ())]


def test_dashboard_is_valid_grafana_json_with_unique_panel_ids_and_a_prometheus_datasource():
    doc = json.loads((KIT / "grafana-dashboard.json").read_text())
    assert doc["uid"] == "adapter-gateway" and doc["schemaVersion"] >= 36
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in doc["templating"]["list"]}
    assert {"datasource", "route"} <= names
    queries = dashboard_queries()
    assert len(queries) >= 20 and all(q.strip() for _, q in queries)
    for p in doc["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["type"] == "prometheus" and p["targets"], p["title"]


@needs_promtool
def test_promtool_checks_the_rules_the_config_and_runs_the_rule_unit_tests():
    for args in (["check", "rules", "alerts.yaml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", "alerts-test.yaml"]):
        r = subprocess.run([PROMTOOL, *args], cwd=KIT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert "SUCCESS" in r.stdout


@needs_prometheus
def test_a_real_prometheus_scraping_a_stack_evaluates_every_dashboard_query_and_alert(stack_factory, tmp_path):
    # the example config with latency attribution on its OpenAI route (metrics only), for the attribution panels
    text = CONFIG.read_text()
    route = "      kind: openai\n      targets: [vllm-finance, vllm-general]\n"
    assert text.count(route) == 1
    config_file = tmp_path / CONFIG.name
    config_file.write_text(text.replace(route, route + "      serverTiming: metrics\n"))
    st = stack_factory(config_file, simulate=frozenset({"vllm-finance", "vllm-general"}))
    client = openai.OpenAI(base_url=f"{st.url}/v1", api_key="unused", max_retries=0, timeout=30)
    for model in ("llama-3-8b", "qwen2.5-finance"):
        for _ in range(3):
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    shutil.copy(KIT / "alerts.yaml", tmp_path / "alerts.yaml")
    processor = st.processor_admin_url.split("//")[1]
    envoy = st.admin_url.split("//")[1]
    config.write_text(f"""global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [alerts.yaml]
scrape_configs:
  - {{job_name: adapter-processor, static_configs: [{{targets: ["{processor}"]}}]}}
  - {{job_name: adapter-envoy, metrics_path: /stats/prometheus, static_configs: [{{targets: ["{envoy}"]}}]}}
""")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        def query(expr: str) -> list:
            r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10)
            # 503 "Service Unavailable" (text) while Prometheus starts: not ready yet, polled again below
            assert r.status_code == 200, (expr, r.status_code, r.text[:200])
            body = r.json()
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        deadline = time.monotonic() + 60
        ready = False
        while time.monotonic() < deadline:
            try:
                ups = {s["metric"]["job"]: s["value"][1] for s in query("up")}
                ttft = query("gen_ai_server_time_to_first_token_seconds_count")
                if ups.get("adapter-processor") == "1" and ups.get("adapter-envoy") == "1" and ttft:
                    # two scrapes after the requests: rate() over the series has two points
                    # (Envoy's share comes with its access-log entry, at most a flush interval later)
                    if all(query(f"count_over_time({series}[1m])")[0]["value"][1] not in ("0", "1")
                           for series in ("gen_ai_server_time_to_first_token_seconds_count",
                                          'adapter_processor_latency_seconds_count{component="envoy"}')):
                        ready = True
                        break
            except (httpx.HTTPError, AssertionError, IndexError, KeyError):
                pass
            time.sleep(0.5)
        assert ready, (tmp_path / "prometheus.log").read_text()[-2000:]
        results = {}
        for title, expr in dashboard_queries():
            results[(title, expr)] = query(expr.replace("$__rate_interval", "1m").replace("$route", ".*"))
        with_data = {title for (title, _), res in results.items() if res}
        # the attribution panels split by component, Envoy's share (from its access log) among them
        (attribution,) = [res for (title, _), res in results.items()
                          if title == "Latency attribution: mean per request by component"]
        assert {"envoy", "processor_request_headers", "upstream_ttfb", "upstream_first_token"} <= \
            {r["metric"]["component"] for r in attribution}, attribution
        for must in ("Requests/s by route and outcome", "Time to first token (p50, p99) by model",
                     "Tokens/s by type (estimated = gateway estimate)", "Requests/s by serving endpoint",
                     "Config generation: accepted, and workers per generation",
                     "Envoy downstream requests/s by response class",
                     "Latency attribution: mean per request by component", "Latency attribution: p99 by component"):
            assert must in with_data, (must, sorted(with_data))
        # every alert rule loaded and evaluated without an error; none firing on a healthy stack
        def evaluated(rule: dict) -> bool:  # Prometheus reports a rule never evaluated at the zero time
            return not rule.get("lastEvaluation", "0001").startswith("0001")

        deadline = time.monotonic() + 20
        while True:
            groups = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if (rules and all(map(evaluated, rules))) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(rules) == 11 and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError"))
                                                                              for r in rules]
        firing = [r["name"] for r in rules if r.get("state") == "firing"]
        assert not {"AdapterProcessorDown", "AdapterEnvoyDown", "AdapterBackendErrorRatioHigh"} & set(firing), firing
    finally:
        stop_process(proc)
        log.close()
