"""perf/bench_canary.py on tiny settings: the JSON it writes has the documented shape, and every check is
computed from the code it verifies, not written down: a deliberately broken assignment fails the split,
the stickiness and the monotone-ramp checks, a regressed "A/A" canary fails the A/A check, an
unregressed canary fails detection, and the Flagger #1532 cookie affinity fails the drift check.
Simulated arms and a simulated clock; no timing thresholds."""

from __future__ import annotations

import hashlib
import json

import pytest

from canary.assign import Assignment, arm_at, assign, bucket
from tests.conftest import REPO
from tests.perf_scripts import load_perf


bc = load_perf("bench_canary")


# deliberately broken assignments (the stickiness check imports these by name in its subprocesses)

def short_digest_assign(rollout, key, *, rng=None):
    """A one-byte digest: buckets 0..255 only, so a 1 % canary (buckets < 100) gets ~39 % of the keys."""
    if key is None:
        return assign(rollout, None, rng=rng)
    b = hashlib.blake2b(f"{rollout.hash_salt}:{key}".encode(), digest_size=1).digest()[0]
    return Assignment(rollout.name, arm_at(rollout, b), "hash", b)


def hash_assign(rollout, key, *, rng=None):
    """Python's hash(): salted per process (PYTHONHASHSEED), so workers disagree."""
    if key is None:
        return assign(rollout, None, rng=rng)
    b = hash((rollout.hash_salt, key)) % 10_000
    return Assignment(rollout.name, arm_at(rollout, b), "hash", b)


def weight_salted_assign(rollout, key, *, rng=None):
    """The weight in the salt: every step reshuffles the canary (keys leave it on a step up)."""
    if key is None:
        return assign(rollout, None, rng=rng)
    b = bucket(f"{rollout.hash_salt}/{rollout.weight(rollout.canaries[0].name)}", key)
    return Assignment(rollout.name, arm_at(rollout, b), "hash", b)


# --------------------------------------------------------------------------------------------------


def test_main_writes_the_documented_json_and_leaves_results_md_alone(tmp_path, monkeypatch):
    results_md = REPO / "perf" / "RESULTS.md"
    before = results_md.read_bytes()
    monkeypatch.setattr(bc, "RESULTS_JSON", tmp_path / "default.json")
    out = tmp_path / "canary.json"
    assert bc.main(["--quick", "--trials", "2", "--checks", "split,stickiness,aa,detection", "--no-write",
                    "--out", str(out)]) == 0
    assert results_md.read_bytes() == before and not (tmp_path / "default.json").exists()
    doc = json.loads(out.read_text())
    assert {"schema", "bench", "simulated", "note", "date", "machine", "git", "python", "command", "seed", "quick",
            "trials", "elapsed_s", "model", "checks", "ok"} <= set(doc)
    assert doc["simulated"] is True and "simulated" in doc["note"] and doc["date"].endswith("UTC")
    assert doc["trials"] == 2 and doc["quick"] is True and doc["machine"] and doc["git"]
    assert set(doc["checks"]) == {"split", "stickiness", "aa", "detection"}
    assert doc["ok"] == all(c["ok"] for c in doc["checks"].values())
    assert doc["model"]["plan"] == {"steps": [1, 5, 25, 50, 100], "min_samples": 500, "dwell_s": 300.0}
    assert doc["model"]["arm"]["engine"]["step_base_s"] == 0.0062  # the simulator's vLLM formula
    assert doc["model"]["judge_by"] == "key"

    split = doc["checks"]["split"]
    assert len(split["rows"]) == len(bc.SPLIT_SALTS) * len(bc.SPLIT_WEIGHTS_PCT)
    for r in split["rows"]:
        assert abs(r["share_pct"] - 100 * r["canary_keys"] / 10_000) < 1e-9
        assert r["within"] == (abs(r["deviation_pp"]) <= 1.0)
    assert split["worst_deviation_pp"] == max(abs(r["deviation_pp"]) for r in split["rows"])
    assert split["binomial"]["max_abs_z"] < 3.3  # the real hash shows no bias
    assert split["keyless"]["seeds"] == 200 and split["keyless"]["tolerance_pp"] == 10.0

    st = doc["checks"]["stickiness"]
    assert [p["pythonhashseed"] for p in st["processes"]] == ["0", "12345", "random"]
    assert all(p["mismatches"] == 0 for p in st["processes"]) and st["ok"]
    assert st["assignments_compared"] == 3 * 5 * 10_000
    assert st["monotone"]["left_canary_on_step_up"] == 0 and st["monotone"]["not_on_baseline_after_rollback"] == 0

    aa = doc["checks"]["aa"]
    assert aa["trials"] == 2 and aa["false_rollbacks"] + aa["completed"] + aa["running_at_end"] == 2
    assert 0 <= aa["ci95_wilson"][0] <= aa["rate"] <= aa["ci95_wilson"][1] <= 1
    below = aa["trials_min_p_below"]
    assert set(below) == {"0.001", "0.0001", "1e-05"}
    assert all(below["0.001"][m] >= below["0.0001"][m] >= below["1e-05"][m] >= 0 for m in ("latency_ms", "ttft_ms"))
    det = doc["checks"]["detection"]
    assert [c["case"] for c in det["cases"]] == ["ttft_x1.2", "errors_1pct"]
    assert det["window_canary_requests"] == bc.DETECTION_WINDOW
    for c in det["cases"]:
        assert c["trials"] == 2 and c["within_window"] <= c["rolled_back"] <= 2
        assert c["ok"] == (c["within_window"] >= 0.95 * 2)

    text = bc.results_text(doc)
    assert text.startswith("\n## ") and "perf/bench_canary.py --quick --trials 2" in text
    assert doc["machine"] in text and "| A/A |" in text and "simulated" in text and "judged by key" in text


def test_a_broken_assignment_fails_the_split_check():
    good = bc.split_check(keys=2000, keyless_seeds=10)
    bad = bc.split_check(short_digest_assign, keys=2000, keyless_seeds=10)
    assert bad["ok"] is False and bad["worst_deviation_pp"] > 5
    assert bad["binomial"]["max_abs_z"] > 3.3
    assert good["binomial"]["max_abs_z"] < bad["binomial"]["max_abs_z"]


def test_a_per_process_hash_fails_stickiness_and_a_weight_salted_hash_fails_the_ramp():
    c = bc.stickiness_check("tests.test_bench_canary:hash_assign", keys=300, hashseeds=("0", "12345"))
    assert c["ok"] is False
    assert sum(p["mismatches"] > 0 for p in c["processes"]) >= 1  # at most one seed can match the parent's
    r = bc.ramp_check(weight_salted_assign, keys=2000)
    assert r["ok"] is False and r["left_canary_on_step_up"] > 0
    assert bc.ramp_check(keys=2000)["ok"] is True


def test_a_regressed_canary_fails_a_a_and_an_identical_one_fails_detection():
    pop = bc.Population.build(users=2000)
    regressed = bc.aa_check(2, pop=pop, canary=bc.ArmModel(ttft_scale=2.0))
    assert regressed["ok"] is False and regressed["false_rollbacks"] == 2
    assert regressed["false_rollback_metrics"]  # the judge said which metric
    same = bc.detection_check(2, pop=pop, cases=[("identical", bc.ArmModel())])
    assert same["ok"] is False and same["cases"][0]["rolled_back"] == 0


def test_drift_sticky_hash_holds_and_cookie_affinity_drifts_toward_the_canary():
    sticky = bc.drift_run(bc.HashArms(1000), hours=2, seed=1)
    cookie = bc.drift_run(bc.CookieAffinity(1000), hours=2, seed=1)
    assert sticky["ok"] is True and len(sticky["slices"]) == 2
    assert cookie["ok"] is False
    shares = [s["canary_share_pct"] for s in cookie["slices"]]
    assert shares[-1] > shares[0] > 20 and cookie["slope_pp_per_hour"] > 1


def test_drift_check_summarises_populations():
    d = bc.drift_check(2, populations=2, users=5000)
    assert d["populations"]["runs"] == 2 and len(d["populations"]["slope_pp_per_hour"]) == 2
    toward = d["populations"]["toward_canary_pp"]
    assert toward == [round(x * 2, 3) for x in d["populations"]["slope_pp_per_hour"]]
    assert d["ok"] == all(t < 1.0 for t in toward) and d["counterexample"]["ok"] is False
    assert d["trend_ok"] is (d["toward_canary_pp"] < 1.0) and d["counterexample_toward_canary_pp"] > 1.0
    assert d["activity"]["share_sd_from_user_choice_pp"] > 0


def test_user_sigma_gives_each_user_a_fixed_prompt_factor_and_zero_changes_nothing():
    alike = bc.Population.build(users=500)
    assert alike.scales is None
    a = bc.Population.build(users=500, user_sigma=0.5)
    assert a.scales == bc.Population.build(users=500, user_sigma=0.5).scales and len(set(a.scales)) == 500
    assert a.buckets == alike.buckets
    import random
    m = bc.ArmModel()
    assert m.sample(random.Random(3)) == m.sample(random.Random(3), 1.0)
    assert m.sample(random.Random(3), 4.0)[1] > m.sample(random.Random(3))[1]  # longer prompts: later first token


def test_judge_by_key_gives_each_user_the_feeds_unit_and_request_none(monkeypatch):
    from canary.assign import unit

    keyed = bc.Population.build(users=300)
    assert keyed.units == [unit(bc.ROLLOUT, f"user-{i}") for i in range(300)]
    assert bc.Population.build(users=300, judge_by="request").units == [None] * 300
    # one A/A plan trial by key: the judge's evidence names the clustered test
    from canary.judge import Windows

    seen = []
    real = bc.judge_windows

    def spy(w: Windows, b, c, now, cfg):
        v = real(w, b, c, now, cfg)
        seen.extend(m.evidence.get("test", "") for m in v.metrics if m.metric == "ttft_ms")
        return v

    monkeypatch.setattr(bc, "judge_windows", spy)
    bc.plan_trial(5, bc.ArmModel(), keyed, max_s=1800.0)
    assert any(t.startswith("clustered rank-sum") for t in seen), seen


def test_wilson_interval():
    lo, hi = bc.wilson(0, 100)
    assert lo == 0 and hi == pytest.approx(0.0370, abs=1e-4)
    lo, hi = bc.wilson(1, 100)
    assert lo == pytest.approx(0.00177, abs=1e-4) and hi == pytest.approx(0.0545, abs=1e-4)


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        bc.main(["--checks", "nope", "--no-write"])
    with pytest.raises(SystemExit):
        bc.main(["--trials", "0", "--no-write"])
    with pytest.raises(SystemExit):
        bc.main(["--judge-every", "0", "--no-write"])
    with pytest.raises(SystemExit):
        bc.main(["--user-sigma", "-1", "--no-write"])
    with pytest.raises(SystemExit):
        bc.main(["--judge-by", "user", "--no-write"])


def test_the_drift_goal_fails_for_a_split_that_drifts_toward_the_canary():
    d = bc.drift_check(3, populations=2, users=5000, make_arms=lambda: bc.CookieAffinity(1000))
    assert d["ok"] is False and all(t > 1.0 for t in d["populations"]["toward_canary_pp"])
