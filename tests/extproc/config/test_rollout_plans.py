"""`spec.rollouts[].plan`: compiled into a `canary.control.ControlConfig` (defaults from canary/plan.py
and canary/judge.py, thresholds in percent), refused with file:line, field path and reason; without
a plan a rollout is manual (as before); weight overrides (what the controller publishes) change the
weights and the digest, and survive a bundle round trip."""

from __future__ import annotations

import pytest

from canary.control import ControlConfig
from canary.judge import ErrorRule, JudgeConfig, LatencyRule, WindowConfig
from canary.plan import PlanConfig
from extproc.config.bundle import load_bundle, publish
from extproc.config.compile import override_digest, with_rollout_overrides
from extproc.config.loader import ConfigError, load_text

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: plans}
spec:
  backends:
    - {name: stable, endpoints: ["127.0.0.1:9001"], models: [m]}
    - {name: canary, endpoints: ["127.0.0.1:9002"], models: [m]}
    - {name: other, endpoints: ["127.0.0.1:9003"], models: [m]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: v1, targets: [stable, canary, other]}
  rollouts:
"""
ARMS = "arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 10}]"


def config(plan: str | None, arms: str = ARMS) -> str:
    return HEAD + f"    - {{name: r, route: v1, {arms}" + (f", plan: {plan}" if plan is not None else "") + "}\n"


def test_without_a_plan_block_the_rollout_is_manual_as_before():
    assert load_text(config(None), "gw.yaml").rollouts["r"].control is None


def test_an_empty_plan_block_takes_the_defaults_of_the_plan_and_the_judge():
    c = load_text(config("{}"), "gw.yaml").rollouts["r"].control
    assert c == ControlConfig(plan=PlanConfig(), judge=JudgeConfig(), window=WindowConfig(), interval=60.0)
    assert c.plan.steps_bp == (100, 500, 2500, 5000, 10000) and c.judge.min_samples == 200


def test_every_field_of_a_plan_block():
    c = load_text(config("{steps: [2, 10, 100], minSamples: 40, dwell: 30s, interval: 500ms, arm: canary, "
                         "rollbackWhilePaused: false, window: {size: 500, errorSize: 1000, maxAge: 10m}, "
                         "judge: {alpha: 0.001, errorAlpha: 0.01, minSamples: 30, latency: {marginMs: 5, "
                         "quantiles: [0.5], marginRatio: 0.1}, ttft: {marginMs: 10}, errors: {maxRatePercent: 1, "
                         "marginPercent: 0.5}, metrics: [latency_ms, error]}}"), "gw.yaml").rollouts["r"].control
    assert c.plan == PlanConfig(steps=(2, 10, 100), min_samples=40, dwell_s=30.0, arm="canary",
                                rollback_while_paused=False)
    assert c.interval == 0.5 and c.window == WindowConfig(500, 1000, 600.0)
    assert c.judge == JudgeConfig(alpha=0.001, error_alpha=0.01, min_samples=30,
                                  latency=LatencyRule(5.0, (0.5,), 0.1), ttft=LatencyRule(10.0),
                                  errors=ErrorRule(0.01, 0.005), metrics=("latency_ms", "error"))


def test_the_judges_minimum_follows_a_small_plan_minimum():
    c = load_text(config("{minSamples: 20}"), "gw.yaml").rollouts["r"].control
    assert c.judge.min_samples == 20  # else the judge would stay inconclusive below 200
    assert load_text(config("{minSamples: 0}"), "gw.yaml").rollouts["r"].control.judge.min_samples == 2


REFUSALS = {
    "steps down": ("{steps: [5, 1]}", "spec.rollouts[0].plan.steps[1]", "must be above the step before it"),
    "step over 100": ("{steps: [5, 120]}", "spec.rollouts[0].plan.steps[1]", "between 0 and 100"),
    "no steps": ("{steps: []}", "spec.rollouts[0].plan.steps", "at least one step"),
    "negative samples": ("{minSamples: -1}", "spec.rollouts[0].plan.minSamples", "greater than or equal to 0"),
    "bad dwell": ("{dwell: soon}", "spec.rollouts[0].plan.dwell", "invalid duration"),
    "zero interval": ("{interval: 0}", "spec.rollouts[0].plan.interval", "must be positive"),
    "arm not a canary": ("{arm: stable}", "spec.rollouts[0].plan.arm", "is not a canary"),
    "unknown field": ("{stepz: [1]}", "spec.rollouts[0].plan.stepz", ""),
    "alpha": ("{judge: {alpha: 1.5}}", "spec.rollouts[0].plan.judge.alpha", "less than 1"),
    "quantile": ("{judge: {latency: {quantiles: [2]}}}", "spec.rollouts[0].plan.judge.latency.quantiles[0]",
                 "less than or equal to 1"),
    "metric": ("{judge: {metrics: [cpu]}}", "spec.rollouts[0].plan.judge.metrics[0]", "latency_ms"),
    "no metrics": ("{judge: {metrics: []}}", "spec.rollouts[0].plan.judge.metrics", "non-empty"),
    "window too small": ("{minSamples: 300, window: {size: 100}}", "spec.rollouts[0].plan.window",
                         "can never hold the judge's 200 samples"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal_names_the_file_line_field_and_reason(case):
    plan, path, reason = REFUSALS[case]
    with pytest.raises(ConfigError) as e:
        load_text(config(plan), "gw.yaml")
    issues = e.value.issues
    assert [i.path for i in issues] == [path], issues
    assert reason in issues[0].reason, issues[0].reason
    assert issues[0].where.startswith("gw.yaml:12"), issues[0].where  # the rollout's line (flow style)


def test_a_plan_that_would_move_keys_between_two_canaries_is_refused():
    arms = ("arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 10}, "
            "{name: other, backend: other, weight: 5}]")
    with pytest.raises(ConfigError) as e:
        load_text(config("{arm: canary, steps: [1, 5, 50]}", arms), "gw.yaml")
    [issue] = e.value.issues
    assert issue.path == "spec.rollouts[0].plan.steps[0]" and "not monotone" in issue.reason
    # ramping the last canary is fine
    assert load_text(config("{arm: other, steps: [5, 50, 90]}", arms), "gw.yaml").rollouts["r"].control


def test_weight_overrides_replace_the_weights_on_the_rollout_and_its_routes_and_change_the_digest():
    snap = load_text(config("{}"), "gw.yaml")
    o = {"r": {"weights": {"canary": 2500}, "allow_force": False}}
    new = with_rollout_overrides(snap, o)
    assert new.rollouts["r"].rollout.weight("canary") == 2500 and new.rollouts["r"].rollout.allow_force is False
    assert new.routes["v1"].rollout is new.rollouts["r"]
    assert new.digest == override_digest(snap.digest, o) != snap.digest
    assert with_rollout_overrides(snap, {}) is snap and override_digest(snap.digest, {}) == snap.digest
    with pytest.raises(ConfigError, match="rollout weights for 'gone'"):
        with_rollout_overrides(snap, {"gone": {"weights": {}}})
    with pytest.raises(ConfigError, match="do not fit it"):
        with_rollout_overrides(snap, {"r": {"weights": {"nope": 10}}})


def test_a_bundle_published_with_overrides_loads_with_them_in_every_worker(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(config("{}"))
    o = {"r": {"weights": {"canary": 500}, "allow_force": True}}
    b = publish(tmp_path / "bundles", cfg, 2, rollouts=o)
    assert b.snapshot.rollouts["r"].rollout.weight("canary") == 500
    again = load_bundle(b.path)  # what a worker does on SIGHUP
    assert again.digest == b.digest and again.rollouts["r"].rollout.weight("canary") == 500
    # the same content without overrides is another digest: a plan's step is always republished
    plain = publish(tmp_path / "bundles", cfg, 3, unchanged=b.digest)
    assert plain is not None and plain.digest != b.digest
    assert plain.snapshot.rollouts["r"].rollout.weight("canary") == 1000
