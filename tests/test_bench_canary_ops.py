"""perf/bench_canary_ops.py on 2 rounds (e2e: the real Envoy, 2 processor workers, OpenAI API simulators):
the JSON it writes says every promote, rollback, resume and bundle load applied, no request failed, every
openai answer named its arm, and no answer had an arm or mapping that was not live while it was in
flight; RESULTS.md and the default JSON are left alone with --no-write. The consistency check itself is
shown to catch a wrong arm and a wrong mapping on fabricated records (no stack). About 25 s here; no
timing thresholds. Skipped, saying why, without an Envoy binary."""

from __future__ import annotations

import json

import pytest

from canary.assign import Arm, Rollout, arm_at, bucket
from extproc.envoy_bin import EnvoyNotFound, find_envoy
from tests.conftest import REPO
from tests.perf_scripts import load_perf

pytestmark = pytest.mark.e2e


bco = load_perf("bench_canary_ops")


def test_two_rounds_apply_every_op_with_no_failed_request(tmp_path, monkeypatch):
    try:
        find_envoy()
    except EnvoyNotFound as e:
        pytest.skip(f"needs Envoy: {e}")
    results_md = REPO / "perf" / "RESULTS.md"
    before = results_md.read_bytes()
    monkeypatch.setattr(bco, "RESULTS_JSON", tmp_path / "default.json")
    out = tmp_path / "ops.json"
    code = bco.main(["--ops", "2", "--clients", "6", "--warmup", "0.5", "--no-write", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert results_md.read_bytes() == before and not (tmp_path / "default.json").exists()
    r = doc["requests"]
    assert r["failed"] == 0 and r["sent"] > 0 and set(r["by_status"]) == {"200"}, (r["failures"], r["failure_samples"])
    assert r["missing_variant"] == 0 and r["wrong_arm"] == 0 and r["wrong_mapping"] == 0, r["check_samples"]
    assert r["checked"] == r["sent"] and all(r["by_kind"][k] > 0 for k in bco.KINDS)
    assert set(r["variants_seen"]) == {"ro/stable", "ro/canary"}
    assert {"b1", "b2"} <= set(r["mappings_seen"]) <= {"file", "b1", "b2"}  # each load changed the mapping
    assert {k: (v["attempted"], v["succeeded"]) for k, v in doc["ops"].items()} == {
        "promote": (2, 2), "rollback": (2, 2), "resume": (2, 2), "bundle": (2, 2)}, doc["failed_ops"]
    assert "judge" not in doc["stats"]["last_events_by"]  # no judge decision in between: only ours (and the start)
    assert doc["ok"] is True and code == 0 and doc["simulated"] is True and "simulator" in doc["note"]
    text = bco.results_text(doc)
    assert text.startswith("\n## ") and "--ops 2" in text and "simulators" in text


def test_the_consistency_check_catches_a_wrong_arm_and_a_wrong_mapping():
    rollout = Rollout("ro", (Arm("canary", 1000),), salt="s")
    salt = rollout.hash_salt
    key = next(f"k{i}" for i in range(1000) if bucket(salt, f"k{i}") < 1000)  # canary at 10 %, stable at 0 %
    assert arm_at(rollout.with_weight("canary", 1000), bucket(salt, key)) == "canary"
    ops = [{"t_start": 10.0, "t_end": 11.0, "state": (0, "file")},  # rollback 10 % -> 0 %
           {"t_start": 20.0, "t_end": 21.0, "state": (0, "b1")}]  # a bundle load: file -> b1
    good = [("chat", 1.0, 2.0, key, 200, "ro/canary", None, True),  # at 10 %
            ("chat", 10.5, 12.0, key, 200, "ro/canary", None, True),  # in flight during the rollback: either
            ("chat", 12.0, 13.0, key, 200, "ro/stable", None, True),
            ("summarize", 19.0, 20.5, key, 200, None, "b1", True),  # in flight during the load: either
            ("summarize", 19.0, 19.5, key, 200, None, "file", True)]
    bad = [("chat", 12.0, 13.0, key, 200, "ro/canary", None, True),  # after the rollback, still the canary
           ("chat-keyless", 12.0, 13.0, None, 200, None, None, True),  # no x-adapter-variant
           ("summarize", 21.5, 22.0, key, 200, None, "file", True)]  # after the load, the old mapping
    c = bco.check(good, ops, (1000, "file"), salt, rollout)["counts"]
    assert c["checked"] == 5 and not (c.get("wrong_arm") or c.get("wrong_mapping") or c.get("missing_variant"))
    c = bco.check(bad, ops, (1000, "file"), salt, rollout)["counts"]
    assert (c["wrong_arm"], c["missing_variant"], c["wrong_mapping"]) == (1, 1, 1)
