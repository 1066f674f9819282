"""`backends[].lbPolicy`: Envoy's own balancing when the processor names no endpoint (the override-host
fallback), rendered per backend and accepted by Envoy; unknown values refused at load."""

from __future__ import annotations

import pytest

from extproc.cli import envoy_validate
from extproc.config.loader import ConfigError, load_file

from extproc.envoy_render import render, render_yaml

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: t}}
spec:
  backends:
    - {{name: rr, kind: vllm, endpoints: ["127.0.0.1:9001", "127.0.0.1:9002"]{rr}}}
    - {{name: plain, kind: vllm, endpoints: ["127.0.0.1:9003"]}}
  routes:
    - {{path: /a/, match: prefix, kind: openai, targets: [rr]}}
    - {{path: /b/, match: prefix, kind: openai, targets: [plain]}}
"""


def fallback_of(boot, cluster):
    c = {c["name"]: c for c in boot["static_resources"]["clusters"]}[cluster]
    policy = c["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    return policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]


@pytest.mark.parametrize("value, name, typ", [
    ("roundRobin", "envoy.load_balancing_policies.round_robin", "round_robin.v3.RoundRobin"),
    ("random", "envoy.load_balancing_policies.random", "random.v3.Random"),
    ("leastRequest", "envoy.load_balancing_policies.least_request", "least_request.v3.LeastRequest"),
])
def test_lb_policy_is_the_override_host_fallback_and_envoy_accepts_it(value, name, typ, tmp_path):
    p = tmp_path / "gw.yaml"
    p.write_text(CONFIG.format(rr=f", lbPolicy: {value}"))
    snap = load_file(p)
    assert snap.backends["rr"].lb_policy == value
    boot = render(snap, workers=1)
    fb = fallback_of(boot, "rr")
    assert fb["name"] == name
    assert fb["typed_config"]["@type"].endswith("envoy.extensions.load_balancing_policies." + typ)
    # the default stays least request
    assert fallback_of(boot, "plain")["name"] == "envoy.load_balancing_policies.least_request"
    out = tmp_path / "envoy.yaml"
    out.write_text(render_yaml(snap, workers=1))
    ok, output = envoy_validate(str(out))
    assert ok, output


def test_an_unknown_lb_policy_is_refused(tmp_path):
    p = tmp_path / "gw.yaml"
    p.write_text(CONFIG.format(rr=", lbPolicy: maglev"))
    with pytest.raises(ConfigError, match="lbPolicy"):
        load_file(p)
