"""canary/control.py: the control loop on fed samples with a fake clock: promotion step by step on
identical arms (min samples and dwell honoured), rollback on canary errors, stale samples cut off
at a step, operator actions and their refusals, state resumed by a new controller (a restart),
reset when the arms change, kept when only thresholds change."""

from __future__ import annotations

import json
import random

import pytest

from canary.control import Controller, NoPlan, UnknownRollout, fingerprint
from canary.feed import Sample, variant_key
from canary.plan import PlanError
from extproc.config.loader import load_text

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: control}}
spec:
  backends:
    - {{name: stable, endpoints: ["127.0.0.1:9001"], models: [m]}}
    - {{name: canary, endpoints: ["127.0.0.1:9002"], models: [m]}}
    - {{name: canary2, endpoints: ["127.0.0.1:9003"], models: [m]}}
  routes:
    - {{path: /v1/, match: prefix, kind: openai, name: v1, targets: [stable, canary, canary2]}}
    - {{path: /v2/, match: prefix, kind: openai, name: v2, targets: [stable, canary]}}
  rollouts:
    - name: ro
      route: v1
      arms: [{{name: stable, backend: stable}}, {{name: canary, backend: {backend}, weight: 10}}]
      key: {{sources: [{{header: x-user-id}}], trustedHeaders: [x-user-id]}}
      plan: {plan}
    - name: manual
      route: v2
      arms: [{{name: a, backend: stable}}, {{name: b, backend: canary, weight: 30}}]
"""
PLAN = "{steps: [10, 50, 100], minSamples: 50, dwell: 10s, interval: 1s, judge: {minSamples: 50}}"


def snapshot(plan: str = PLAN, backend: str = "canary"):
    return load_text(CONFIG.format(plan=plan, backend=backend), "gw.yaml")


class Clock:
    def __init__(self) -> None:
        self.wall = 1_000_000.0
        self.mono = 500.0

    def step(self, s: float) -> None:
        self.wall += s
        self.mono += s


def controller(tmp_path, clock: Clock) -> Controller:
    return Controller(tmp_path / "state", None, clock=lambda: clock.wall, mono=lambda: clock.mono)


def feed(ctl: Controller, clock: Clock, n: int, *, canary_errors: float = 0.0, rng: random.Random) -> None:
    """n requests per arm, now: identical latency distributions; canary errors at the given rate."""
    out = []
    for arm in ("stable", "canary"):
        for _ in range(n):
            err = arm == "canary" and rng.random() < canary_errors
            out.append(Sample(clock.mono, variant_key(f"ro/{arm}"), float("nan") if err else rng.gauss(20, 2),
                              float("nan") if err else rng.gauss(8, 1), err))
    ctl.observe(out)


def start(tmp_path, clock: Clock, snap=None) -> Controller:
    ctl = controller(tmp_path, clock)
    snap = snap or snapshot()
    pending = ctl.prepare(snap)
    assert pending.overrides() == {"ro": {"weights": {"canary": 1000}, "allow_force": True}}  # the first step
    ctl.commit(pending)
    ctl.set_manual(snap)
    return ctl


def apply(ctl: Controller, snap=None) -> None:
    """What the supervisor does when tick() says the weights changed: republish, then commit."""
    assert ctl.needs_apply()
    ctl.commit(ctl.prepare(snap or snapshot()))
    assert not ctl.needs_apply()


def test_identical_arms_promote_step_by_step_honouring_min_samples_and_dwell(tmp_path):
    clock, rng = Clock(), random.Random(1)
    ctl = start(tmp_path, clock)
    weights = [ctl.overrides()["ro"]["weights"]["canary"]]
    for step in range(2):
        feed(ctl, clock, 30, rng=rng)
        assert not ctl.tick()  # inconclusive: 30 < 50 samples per arm
        assert ctl.status("ro")["ro"]["verdict"]["verdict"] == "inconclusive"
        feed(ctl, clock, 30, rng=rng)
        clock.step(1)
        assert not ctl.tick()  # pass, but the dwell (10 s) is not over
        assert "dwell" in ctl.status("ro")["ro"]["last_hold"]["reason"]
        clock.step(10)
        assert ctl.tick()  # promoted
        weights.append(ctl.overrides()["ro"]["weights"]["canary"])
        st = ctl.status("ro")["ro"]
        assert st["live"] is False and st["events"][-1]["kind"] == "promote"
        clock.step(1)
        assert not ctl.tick()  # not judged while the new weights are not live
        apply(ctl)
    assert weights == [1000, 5000, 10000]
    st = ctl.status("ro")["ro"]
    assert st["plan"]["status"] == "completed" and st["arms"]["canary"]["weight_percent"] == 100
    assert [e["kind"] for e in st["events"]] == ["start", "promote", "promote"]
    ev = st["events"][1]
    assert ev["by"] == "judge" and ev["evidence"]["verdict"]["verdict"] == "pass"
    assert ev["evidence"]["samples"] == {"stable": 60, "canary": 60}


def test_canary_errors_roll_back_to_zero_with_forcing_off_and_the_evidence_logged(tmp_path, caplog):
    clock, rng = Clock(), random.Random(2)
    ctl = start(tmp_path, clock)
    feed(ctl, clock, 60, canary_errors=0.5, rng=rng)
    clock.step(1)
    with caplog.at_level("INFO", logger="canary.control"):
        assert ctl.tick()
    assert ctl.overrides()["ro"] == {"weights": {"canary": 0}, "allow_force": False}
    st = ctl.status("ro")["ro"]
    assert st["plan"]["status"] == "rolled_back" and st["verdict"]["verdict"] == "fail"
    [line] = [r.getMessage() for r in caplog.records if '"kind": "rollback"' in r.getMessage()]
    doc = json.loads(line.removeprefix("canary "))  # one structured line with its evidence
    failed = [m for m in doc["evidence"]["verdict"]["metrics"] if m["verdict"] == "fail"]
    assert [m["metric"] for m in failed] == ["error"] and failed[0]["errors_canary"] > 0
    apply(ctl)
    feed(ctl, clock, 60, rng=rng)  # a rolled-back plan stays rolled back whatever the verdict
    clock.step(20)
    assert not ctl.tick() and ctl.overrides()["ro"]["weights"]["canary"] == 0


def test_samples_older_than_the_step_going_live_are_stale(tmp_path):
    clock, rng = Clock(), random.Random(3)
    ctl = start(tmp_path, clock)
    t0 = clock.mono
    clock.step(1)
    ctl.commit(ctl.prepare(snapshot()))  # same weights: nothing goes stale
    old = [Sample(t0 - 0.5, variant_key("ro/canary"), 1.0, 1.0, False)]
    assert ctl.observe(old) == 0  # before the weights went live (the start)
    assert ctl.observe([Sample(t0, variant_key("ro/canary"), 1.0, 1.0, False, 99)]) == 1
    assert ctl._rollouts["ro"].windows.units("canary")["latency_ms"] == [99]  # the key's unit, for the judge
    assert ctl.observe([Sample(clock.mono, variant_key("other/x"), 1.0, 1.0, False)]) == 0  # not a rollout's
    assert ctl.status("ro")["ro"]["feed"]["stale"] == 1


def test_operator_actions_and_their_refusals(tmp_path):
    clock, rng = Clock(), random.Random(4)
    ctl = start(tmp_path, clock)
    with pytest.raises(UnknownRollout, match="no rollout named 'nope'"):
        ctl.action("nope", "pause")
    with pytest.raises(NoPlan, match="'manual' has no plan"):
        ctl.action("manual", "promote")
    with pytest.raises(ValueError, match="unknown action"):
        ctl.action("ro", "explode")
    assert ctl.action("ro", "pause", "looking")["kind"] == "pause"
    assert ctl.status("ro")["ro"]["plan"]["paused"] is True
    feed(ctl, clock, 60, rng=rng)
    clock.step(30)
    assert not ctl.tick()  # paused: no automatic promotion
    ev = ctl.action("ro", "promote")
    assert ev["by"] == "operator" and ev["to_weight_bp"] == 5000
    apply(ctl)
    ev = ctl.action("ro", "rollback", "bad smell")
    assert ev["to_weight_bp"] == 0 and "bad smell" in ev["reason"]
    with pytest.raises(PlanError, match="cannot pause a plan that is rolled_back"):
        ctl.action("ro", "pause")
    assert ctl.action("ro", "resume")["to_weight_bp"] == 1000  # from the first step
    manual = ctl.status("manual")["manual"]
    assert manual["plan"] is None and manual["arms"]["b"]["weight_percent"] == 30


def test_a_restarted_controller_resumes_at_the_saved_step_and_weight_not_the_files(tmp_path):
    clock, rng = Clock(), random.Random(5)
    ctl = start(tmp_path, clock)
    ctl.action("ro", "promote")
    apply(ctl)
    ctl.action("ro", "pause")
    again = controller(tmp_path, clock)  # a new supervisor on the same state directory
    pending = again.prepare(snapshot())
    assert pending.overrides()["ro"]["weights"] == {"canary": 5000}  # the file says 10
    again.commit(pending)
    st = again.status("ro")["ro"]
    assert st["plan"]["status"] == "paused" and st["plan"]["step"] == 1
    assert [e["kind"] for e in st["events"]] == ["start", "promote", "pause"]  # the events file


def test_changed_arms_reset_the_ramp_keeping_the_old_files_and_changed_thresholds_keep_it(tmp_path):
    clock = Clock()
    ctl = start(tmp_path, clock)
    ctl.action("ro", "promote")
    apply(ctl)
    fp = fingerprint(snapshot().rollouts["ro"])
    # thresholds, min samples, dwell: the same ramp goes on with the new numbers
    looser = snapshot("{steps: [10, 50, 100], minSamples: 10, dwell: 1s, judge: {alpha: 0.001}}")
    assert fingerprint(looser.rollouts["ro"]) == fp
    ctl.commit(ctl.prepare(looser))
    assert ctl.overrides()["ro"]["weights"] == {"canary": 5000}
    assert ctl.status("ro")["ro"]["plan"]["min_samples"] == 10
    # another backend for the canary (a new version): a new ramp, at the first step
    other = snapshot(backend="canary2")
    ctl.commit(ctl.prepare(other))
    assert ctl.overrides()["ro"]["weights"] == {"canary": 1000}
    # a restart with the new arms: no reset (the saved state is the new ramp's)
    again = controller(tmp_path, clock)
    again.commit(again.prepare(other))
    assert again.overrides()["ro"]["weights"] == {"canary": 1000}
    # a restart that finds a state for other arms resets it and keeps the old files as *.prev
    third = controller(tmp_path, clock)
    third.commit(third.prepare(snapshot()))
    assert third.overrides()["ro"]["weights"] == {"canary": 1000}
    assert (tmp_path / "state" / "ro.plan.json.prev").exists()
    assert (tmp_path / "state" / "ro.control.json.prev").exists()


def test_a_rollout_whose_plan_block_goes_away_is_manual_again(tmp_path):
    clock = Clock()
    ctl = start(tmp_path, clock)
    text = CONFIG.format(plan=PLAN, backend="canary").replace(f"      plan: {PLAN}\n", "")
    snap = load_text(text, "gw.yaml")
    pending = ctl.prepare(snap)
    assert pending.overrides() == {}
    ctl.commit(pending)
    ctl.set_manual(snap)
    assert ctl.controlled == () and ctl.status("ro")["ro"]["plan"] is None
    with pytest.raises(NoPlan):
        ctl.action("ro", "promote")


def test_holds_are_logged_when_their_reason_changes_not_every_tick(tmp_path, caplog):
    clock, rng = Clock(), random.Random(6)
    ctl = start(tmp_path, clock)
    with caplog.at_level("INFO", logger="canary.control"):
        for _ in range(5):  # inconclusive five times: one line
            feed(ctl, clock, 5, rng=rng)
            clock.step(1)
            ctl.tick()
    holds = [r for r in caplog.records if '"kind": "hold"' in r.getMessage()]
    assert len(holds) == 1 and "inconclusive" in holds[0].getMessage()
    assert ctl.status("ro")["ro"]["last_hold"]["evidence"]["samples"] == {"stable": 25, "canary": 25}
    saved = json.loads((tmp_path / "state" / "ro.control.json").read_text())
    assert "inconclusive" in saved["last_hold"]["reason"]  # kept in the state with its evidence
    again = controller(tmp_path, clock)
    again.commit(again.prepare(snapshot()))
    assert "inconclusive" in again.status("ro")["ro"]["last_hold"]["reason"]


def test_a_plan_move_during_a_publish_is_kept_and_published_next(tmp_path):
    clock = Clock()
    ctl = start(tmp_path, clock)
    pending = ctl.prepare(snapshot())  # a reload begins: the config is compiled with 10 %
    assert pending.overrides()["ro"]["weights"] == {"canary": 1000}
    ctl.action("ro", "promote")  # meanwhile: 50 %
    ctl.commit(pending)  # the published config serves 10 %
    assert ctl.overrides()["ro"]["weights"] == {"canary": 5000}  # the move is not lost ...
    assert ctl.needs_apply()  # ... and not taken for live
    assert ctl.status("ro")["ro"]["live"] is False
    apply(ctl)
    assert ctl.status("ro")["ro"]["plan"]["weight_bp"] == 5000
