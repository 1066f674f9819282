"""perf/bench_decision.py runs end to end on tiny settings: the JSON it writes has the documented shape
and every policy decided (a positive p50). No timing thresholds: a benchmark reports, never fails on a number."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.perf_scripts import load_perf


bd = load_perf("bench_decision")


def test_main_writes_rows_and_plugin_p50s(tmp_path, monkeypatch):
    results_md = REPO / "perf" / "RESULTS.md"
    before = results_md.read_bytes()
    monkeypatch.setattr(bd, "RESULTS_JSON", tmp_path / "default.json")  # --no-write leaves it alone anyway
    out = tmp_path / "decision.json"
    assert bd.main(["--requests", "20", "--idle-ms", "0,1", "--no-write", "--out", str(out)]) == 0
    assert results_md.read_bytes() == before and not (tmp_path / "default.json").exists()
    doc = json.loads(out.read_text())
    assert {"rows", "plugins", "machine", "date", "git"} <= set(doc)
    assert isinstance(doc["machine"], str) and doc["machine"] and doc["git"] and doc["date"].endswith("UTC")
    assert [(r["policy"], r["idle_ms"]) for r in doc["rows"]] == [(p, i) for p in bd.POLICIES for i in (0.0, 1.0)]
    for r in doc["rows"]:
        assert set(r) == {"policy", "idle_ms", "decision_p50_us", "decision_p90_us"}
        assert 0 < r["decision_p50_us"] <= r["decision_p90_us"]
    assert set(doc["plugins"]) == set(bd.POLICIES)
    for policy, plugins in doc["plugins"].items():
        assert plugins and all(v > 0 for v in plugins.values()), policy
    # each profile's own plugins are the ones timed
    assert "random-picker" in doc["plugins"]["random"]
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "max-score-picker"} <= set(
        doc["plugins"]["epp-default"])
    assert {"saturation-filter", "prefix-cache-scorer", "max-score-picker"} <= set(doc["plugins"]["adapter-gateway"])


def test_policies_option_and_results_text(tmp_path):
    out = tmp_path / "one.json"
    assert bd.main(["--policies", "random", "--requests", "5", "--idle-ms", "0", "--no-write", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["rows"]] == ["random"] and list(doc["plugins"]) == ["random"]
    text = bd.results_text(doc, [0.0], ["random"], ["--policies", "random"], "3.x")
    assert text.startswith("\n## ") and "perf/bench_decision.py --policies random" in text
    assert doc["machine"] in text and "| random |" in text
    with pytest.raises(SystemExit):
        bd.main(["--policies", "oracle", "--no-write"])


def test_in_flight_counts_are_released(tmp_path):
    b = bd.build("adapter-gateway", str(tmp_path / "state"))
    try:
        bd.decisions(b, 10, "t", 0.0)
        assert not b.held and all(b.runtime.inflight.get(e) == 0 for e in b.endpoints)
        b.dispatched((b.endpoints[0],), b.states(1, "x")[0])
        assert b.runtime.inflight.get(b.endpoints[0]) == 1
    finally:
        b.close()
    assert b.runtime.inflight.get(b.endpoints[0]) == 0
