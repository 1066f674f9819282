"""A canary of an endpoint variant through the real Envoy: one backend, its endpoints labelled by model
version (`version: v1` on two, `version: v2` on one), a rollout whose arms are label selections of that
backend's endpoints (issue 11 item 2: a model version as an endpoint variant). Every request goes to an
endpoint of its arm (each upstream answers with its own port), sticky per user, named in
`x-adapter-variant`; without a picker the processor sends it to the arm's least-loaded endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from canary.assign import Arm, Rollout, assign
from tests.e2e.test_xds_live import echo, procs  # noqa: F401  (procs is a fixture)

pytestmark = pytest.mark.e2e

ROLLOUT = Rollout("llama-v2", canaries=(Arm("v2", 3000),), baseline="v1")  # what the config compiles into


def write(path: Path, v1a: str, v1b: str, v2: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "endpoint-arms"},
        "spec": {
            "backends": [{"name": "llama", "endpoints": [
                {"address": v1a, "labels": {"version": "v1"}}, {"address": v1b, "labels": {"version": "v1"}},
                {"address": v2, "labels": {"version": "v2"}}]}],
            "routes": [{"path": "/gen", "kind": "passthrough", "name": "gen", "target": "llama"}],
            "rollouts": [{"name": "llama-v2", "route": "gen",
                          "arms": [{"name": "v1", "backend": "llama", "endpoints": {"matchLabels": {"version": "v1"}}},
                                   {"name": "v2", "backend": "llama", "endpoints": {"matchLabels": {"version": "v2"}},
                                    "weight": 30}],
                          "key": {"sources": [{"header": "x-user-id"}], "trustedHeaders": ["x-user-id"]}}],
        },
    }))
    return path


def test_each_user_reaches_an_endpoint_of_its_arm_sticky(tmp_path, procs, stack_factory):  # noqa: F811
    v1a, v1b, v2 = (echo(procs) for _ in range(3))
    st = stack_factory(write(tmp_path / "gw.yaml", v1a.id, v1b.id, v2.id), workers=2,
                       run_dir=str(tmp_path / "run"))
    arm_ports = {"v1": {v1a.port, v1b.port}, "v2": {v2.port}}
    users = [f"user-{i}" for i in range(60)]
    seen: dict[str, set[int]] = {}
    with httpx.Client(timeout=10) as client:
        for rnd in range(2):
            for u in users:
                r = client.get(f"{st.url}/gen", headers={"x-user-id": u})
                assert r.status_code == 200, r.text
                arm = assign(ROLLOUT, u).arm
                assert r.headers["x-adapter-variant"] == f"llama-v2/{arm}"
                port = r.json()["port"]
                assert port in arm_ports[arm], (u, arm, port)
                seen.setdefault(arm, set()).add(port)
    assert seen["v2"] == {v2.port}
    assert seen["v1"] == {v1a.port, v1b.port}  # the baseline's requests spread over both of its endpoints
    counts = {e.port: e.count() for e in (v1a, v1b, v2)}
    expected_v2 = 2 * sum(1 for u in users if assign(ROLLOUT, u).arm == "v2")
    assert counts[v2.port] == expected_v2 and counts[v1a.port] + counts[v1b.port] == 120 - expected_v2
