"""`adapterctl canary status|promote|rollback|pause|resume` against a real supervisor (real workers):
the JSON and text status, actions applied as a republished generation every worker serves, the
refusals and their exit codes (1 not allowed now, 3 unknown rollout or no plan, 4 unreachable), the
`--config` default admin port, and plan state resumed by a restarted supervisor."""

from __future__ import annotations

import json

import httpx
import pytest

from extproc.cli import main
from extproc.stack import free_port, free_port_block
from extproc.supervisor import Supervisor

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: cli-canary}}
spec:
  processor: {{adminPort: {admin}}}
  backends:
    - {{name: stable, endpoints: ["127.0.0.1:9"], models: [m]}}
    - {{name: canary, endpoints: ["127.0.0.1:9"], models: [m]}}
  routes:
    - {{path: /v1/, match: prefix, kind: openai, name: v1, targets: [stable, canary]}}
    - {{path: /v2/, match: prefix, kind: openai, name: v2, targets: [stable, canary]}}
  rollouts:
    - name: ro
      route: v1
      arms: [{{name: stable, backend: stable}}, {{name: canary, backend: canary, weight: 10}}]
      plan: {{steps: [10, 50, 100], minSamples: 1000, dwell: 1h}}
    - name: manual
      route: v2
      arms: [{{name: a, backend: stable}}, {{name: b, backend: canary, weight: 30}}]
"""


@pytest.fixture
def gateway(tmp_path):
    admin = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(CONFIG.format(admin=admin))
    started: list[Supervisor] = []

    def start() -> Supervisor:
        sup = Supervisor(str(cfg), "127.0.0.1", free_port_block(2), 2, admin, shutdown_grace=1.0)
        started.append(sup)
        sup.start()
        return sup

    yield cfg, admin, start
    for sup in started:
        sup.stop()


def ctl(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["canary", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def weight(sup: Supervisor) -> int:
    return sup.snapshot.rollouts["ro"].rollout.weight("canary")


def test_status_actions_refusals_and_a_restart(gateway, capsys, tmp_path):
    cfg, admin, start = gateway
    sup = start()
    url = f"http://127.0.0.1:{admin}"
    code, out, _ = ctl(capsys, "status", "--admin", url, "--json")
    assert code == 0
    doc = json.loads(out)["rollouts"]
    assert set(doc) == {"ro", "manual"}
    ro = doc["ro"]
    assert ro["plan"]["status"] == "running" and ro["plan"]["steps_percent"] == [10, 50, 100]
    assert ro["arms"]["canary"]["weight_percent"] == 10 and ro["arms"]["stable"]["backend"] == "stable"
    assert ro["arms"]["canary"]["samples"] == {"latency_ms": 0, "ttft_ms": 0, "error": 0}
    assert ro["live"] is True and ro["events"][0]["kind"] == "start"
    assert doc["manual"]["plan"] is None and doc["manual"]["arms"]["b"]["weight_percent"] == 30
    assert (tmp_path / ".adapter-state" / "ro.plan.json").exists()  # the default state dir

    code, out, _ = ctl(capsys, "status", "ro", "--config", str(cfg))  # the admin port from the file
    assert code == 0
    assert "rollout ro (routes v1): running; step 1 of 3 (10 -> 50 -> 100 %), canary at 10 %" in out
    assert "verdict:" in out

    generation = sup.snapshot.generation
    code, out, _ = ctl(capsys, "pause", "ro", "--admin", url, "--reason", "watching")
    assert code == 0 and "ro: pause (running 10 % -> paused 10 %)" in out
    code, out, _ = ctl(capsys, "promote", "ro", "--admin", url)
    assert code == 0 and "-> paused 50 %" in out
    # applied as a new generation that every worker acknowledged, with the plan's weight
    assert sup.snapshot.generation > generation and weight(sup) == 5000
    state = httpx.get(f"{url}/config").json()
    assert {w["digest"] for w in state["workers"]} == {sup.snapshot.digest}
    code, out, _ = ctl(capsys, "status", "ro", "--admin", url)
    assert "paused, PAUSED; step 2 of 3" in out and "promote by operator" in out

    code, _, err = ctl(capsys, "pause", "ro", "--admin", url)
    assert code == 1 and "cannot pause a plan that is paused" in err
    code, _, err = ctl(capsys, "promote", "manual", "--admin", url)
    assert code == 3 and "'manual' has no plan" in err
    code, _, err = ctl(capsys, "rollback", "nope", "--admin", url)
    assert code == 3 and "no rollout named 'nope'" in err
    code, _, err = ctl(capsys, "status", "nope", "--admin", url)
    assert code == 3 and "no rollout named 'nope'" in err
    code, _, err = ctl(capsys, "status", "--admin", f"http://127.0.0.1:{free_port()}")
    assert code == 4 and "supervisor unreachable" in err
    assert httpx.post(f"{url}/canary/ro/explode").status_code == 404

    # a restarted supervisor resumes at the saved step and weight, not the file's 10 %
    sup.stop()
    sup = start()
    assert sup.snapshot.generation == 1 and weight(sup) == 5000
    code, out, _ = ctl(capsys, "status", "ro", "--admin", url, "--json")
    ro = json.loads(out)["rollouts"]["ro"]
    assert ro["plan"]["status"] == "paused" and ro["arms"]["canary"]["weight_percent"] == 50
    assert [e["kind"] for e in ro["events"]] == ["start", "pause", "promote"]
    code, out, _ = ctl(capsys, "rollback", "ro", "--admin", url, "--json")
    assert code == 0 and json.loads(out)["event"]["to_weight_bp"] == 0
    assert weight(sup) == 0 and sup.snapshot.rollouts["ro"].rollout.allow_force is False
