"""The supervisor's canary controller across config reloads (real workers): an invalid `plan:` is
refused with file:line, field path and reason and changes nothing; new thresholds keep the ramp's
step; a new canary backend starts a new ramp; removing `plan:` makes the rollout manual at the
file's weight again. Every accepted change is served by every worker (digest) before it is reported."""

from __future__ import annotations

import httpx
import pytest

from extproc.stack import free_port, free_port_block
from extproc.supervisor import Supervisor

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: sup-canary}}
spec:
  processor: {{stateDir: {state}}}
  backends:
    - {{name: stable, endpoints: ["127.0.0.1:9"], models: [m]}}
    - {{name: canary, endpoints: ["127.0.0.1:9"], models: [m]}}
    - {{name: canary2, endpoints: ["127.0.0.1:9"], models: [m]}}
  routes:
    - {{path: /v1/, match: prefix, kind: openai, name: v1, targets: [stable, canary, canary2]}}
  rollouts:
    - name: ro
      route: v1
      arms: [{{name: stable, backend: stable}}, {{name: canary, backend: {backend}, weight: 10}}]
{plan}"""
PLAN = "      plan: {steps: [10, 50, 100], minSamples: %d, dwell: 1h}\n"


@pytest.fixture
def sup(tmp_path):
    cfg = tmp_path / "gw.yaml"
    write(cfg, PLAN % 1000)
    s = Supervisor(str(cfg), "127.0.0.1", free_port_block(2), 2, free_port(), shutdown_grace=1.0)
    s.start()
    yield s
    s.stop()


def write(cfg, plan: str, backend: str = "canary") -> None:
    cfg.write_text(CONFIG.format(state=cfg.parent / "st", backend=backend, plan=plan))


def served(s: Supervisor) -> int:
    state = httpx.get(f"http://127.0.0.1:{s.admin[1]}/config").json()
    assert {w["digest"] for w in state["workers"]} == {s.snapshot.digest}  # every worker serves it
    return s.snapshot.rollouts["ro"].rollout.weight("canary")


def test_reloads_refuse_keep_reset_or_drop_a_plan(sup, tmp_path):
    cfg = tmp_path / "gw.yaml"
    assert served(sup) == 1000
    sup.canary_action("ro", "promote")
    assert served(sup) == 5000 and (tmp_path / "st" / "ro.plan.json").exists()

    write(cfg, "      plan: {steps: [10, 5]}\n")
    r = sup.reload()
    assert not r.accepted and "gw.yaml:16: spec.rollouts[0].plan.steps[1]: must be above the step before it" in r.errors
    assert served(sup) == 5000

    write(cfg, PLAN % 10)  # a new minimum: the same ramp, same step
    assert sup.reload().accepted and served(sup) == 5000
    assert sup.controller.status("ro")["ro"]["plan"]["min_samples"] == 10

    write(cfg, PLAN % 10, backend="canary2")  # a new canary version: a new ramp at the first step
    assert sup.reload().accepted and served(sup) == 1000
    assert [e["kind"] for e in sup.controller.status("ro")["ro"]["events"]] == ["start"]

    sup.canary_action("ro", "promote")
    assert served(sup) == 5000
    write(cfg, "")  # no plan: manual at the file's 10 %
    assert sup.reload().accepted and served(sup) == 1000
    assert sup.controller.status("ro")["ro"]["plan"] is None


def test_a_step_that_cannot_be_published_is_kept_not_live_until_the_file_compiles(sup, tmp_path):
    cfg = tmp_path / "gw.yaml"
    good = cfg.read_text()
    cfg.write_text(good.replace("dwell: 1h", "dwell: never"))  # the file breaks
    out = sup.canary_action("ro", "promote")
    assert out["applied"] is False and "spec.rollouts[0].plan.dwell" in out["reload"]["errors"]
    st = sup.controller.status("ro")["ro"]
    assert st["plan"]["weight_bp"] == 5000 and st["live"] is False and "plan.dwell" in st["apply_error"]
    assert served(sup) == 1000  # the workers still serve the last published weights
    cfg.write_text(good)
    assert sup.reload().accepted and served(sup) == 5000  # any accepted publish carries the plan's weights
    st = sup.controller.status("ro")["ro"]
    assert st["live"] is True and st["apply_error"] is None
