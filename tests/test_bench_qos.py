"""perf/bench_qos.py's pure parts: the two policies' gateway configs (validated by our loader), the traffic
mix, the `--out` JSON shape, and the Jain's index / goodput / budget arithmetic on synthetic records.
No timing, no processes."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "perf"))
_spec = importlib.util.spec_from_file_location("bench_qos", REPO / "perf" / "bench_qos.py")
bq = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_qos", bq)  # dataclasses look their module up
_spec.loader.exec_module(bq)
br = bq.br

FLEET = [(n, None, 20000 + i) for i, n in enumerate(br.FLEET)]


def _load(tmp_path, policy):
    from extproc.config.loader import load_file

    p = tmp_path / f"{policy}.yaml"
    p.write_text(json.dumps(bq.qos_config(policy, FLEET)))
    return load_file(p)


def test_qos_on_has_admission_pool_classes_breaker_and_budgets(tmp_path):
    snap = _load(tmp_path, "qos")
    q = snap.spec.spec.qos
    assert q is not None
    assert [c.name for c in q.classes] == ["P0", "P1", "P2"]
    assert q.engine_priority == ("pool",)
    assert [(r.route, r.objective_header) for r in q.routes] == [("api", "x-gateway-inference-objective")]
    assert [a.backend for a in q.admission] == ["pool"]
    assert q.admission[0].initial_limit == sum(n.max_num_seqs for n in br.FLEET) == 64
    assert tuple(q.admission[0].sheddable) == ("P2",)
    assert q.admission[0].shedding.mode == "gradual"  # the default of --shedding; `immediate` the older rule
    # the breaker watches every tenant; the noisy one is P1 by its tenant entry
    assert {t.tenant: t.glitch_threshold for t in q.tenants} == {t: 6.0 for t in bq.SHARES}
    assert {t.tenant: t.priority_class for t in q.tenants}["noisy"] == "P1"
    assert {s.priority_class: s.ttft for s in q.slos} == bq.TTFT_SLO_S
    assert all(t.budget is not None and t.budget.tokens_per_day == bq.DAY_BUDGET_TOKENS for t in snap.tenants)
    # P0's reserve, and no more in flight than the fleet's running slots
    assert q.admission[0].reserve == 0.25 and q.admission[0].max_limit == 64
    from extproc.qos.queue import admission_of

    pool = admission_of(snap).pools["pool"]
    assert pool.reserve == 0.25 and pool.reserved == frozenset({"P0"})  # the critical class by default
    # the route and the fleet are bench_routing's adapter-gateway ones (least-request with routing=)
    assert snap.spec.spec.routes[0].plugins == ("adapter-gateway",) and len(snap.backends["pool"].endpoints) == 8
    lr = bq.qos_config("qos", FLEET, routing="least-request", max_limit=0, reserve=None)
    assert lr["spec"]["backends"][0]["lbPolicy"] == "leastRequest"
    assert "maxLimit" not in lr["spec"]["qos"]["admission"][0] and "reserve" not in lr["spec"]["qos"]["admission"][0]


def test_qos_off_is_the_same_config_without_qos_and_budgets(tmp_path):
    snap = _load(tmp_path, "none")
    assert snap.spec.spec.qos is None
    assert [t.id for t in snap.tenants] == list(bq.SHARES)
    assert all(t.budget is None for t in snap.tenants)
    on, off = bq.qos_config("qos", FLEET), bq.qos_config("none", FLEET)
    on_spec = dict(on["spec"])
    on_spec.pop("qos")
    on_spec["tenants"] = [{"id": t["id"]} for t in on_spec["tenants"]]
    assert on_spec == off["spec"]  # nothing else differs
    with pytest.raises(ValueError):
        bq.qos_config("bogus", FLEET)


def test_shedding_mode_is_the_only_difference_between_the_two_qos_configs(tmp_path):
    from extproc.config.loader import load_file

    grad, imm = bq.qos_config("qos", FLEET), bq.qos_config("qos", FLEET, "immediate")
    p = tmp_path / "imm.yaml"
    p.write_text(json.dumps(imm))
    assert load_file(p).spec.spec.qos.admission[0].shedding.mode == "immediate"
    grad["spec"]["qos"]["admission"][0]["shedding"] = {"mode": "immediate"}
    assert grad == imm
    with pytest.raises(ValueError):
        bq.qos_config("qos", FLEET, "sometimes")


def test_traffic_noisy_tenant_at_ten_shares_and_classes_by_header():
    who = bq.assign(14000, seed=3)
    assert who == bq.assign(14000, seed=3)  # both policies get the same tenants and classes
    noisy = [w for w in who if w[0] == "noisy"]
    assert 0.69 < len(noisy) / len(who) < 0.74  # 10 of 14 shares
    assert all(c == "P1" and not h for _, c, h in noisy)
    wb = [w for w in who if w[0] != "noisy"]
    assert {t for t, _, _ in wb} == set(bq.WELL_BEHAVED) and all(h for _, _, h in wb)
    p0 = sum(c == "P0" for _, c, _ in wb) / len(wb)
    assert 0.17 < p0 < 0.23
    reqs = bq.with_headers(br.make_requests(br.SHAPES["low-sharing"], 3, salt="t"),
                           [("tenant-1", "P2", True), ("noisy", "P1", False), ("tenant-2", "P0", True)])
    assert [dict(r.headers) for r in reqs] == [
        {"x-tenant-id": "tenant-1", "x-gateway-inference-objective": "P2"}, {"x-tenant-id": "noisy"},
        {"x-tenant-id": "tenant-2", "x-gateway-inference-objective": "P0"}]


def test_jain_index_arithmetic():
    assert bq.jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert bq.jain([1, 0, 0, 0]) == pytest.approx(0.25)  # one has everything: 1/n
    assert bq.jain([1, 2, 3, 4]) == pytest.approx(100 / (4 * 30))
    assert bq.jain([0, 0]) == 1.0 and bq.jain([]) is None


def R(tenant, cls, status=200, ttft=0.1, tokens=32, usage=None):
    ok = status == 200
    return bq.Record(tenant, cls, status, ok, ttft if ok else None, tokens if ok else 0, 32,
                     (usage if usage is not None else 1000 + tokens) if ok else None)


def test_goodput_attainment_and_shed_on_synthetic_records():
    recs = [R("tenant-1", "P0", ttft=0.5), R("tenant-1", "P0", ttft=1.5),  # within 1 s, over it
            R("tenant-2", "P2", status=429), R("tenant-2", "P2", ttft=4.0, tokens=20),
            R("noisy", "P1", status=503), R("noisy", "P1", status=500), R("noisy", "P1", ttft=1.9)]
    rows = {r["class"]: r for r in bq.class_rows("qos", 1.5, recs, window_s=2.0)}
    assert rows["P0"]["ttft_slo_attainment"] == 0.5 and rows["P0"]["goodput_tokens_per_s"] == 16.0
    assert rows["P2"]["shed_rate"] == 0.5 and rows["P2"]["ttft_slo_attainment"] == 0.5
    assert rows["P2"]["attainment_served"] == 1.0 and rows["P2"]["goodput_tokens_per_s"] == 10.0
    p1 = rows["P1"]
    assert p1["shed_rate"] == pytest.approx(1 / 3, abs=1e-4) and p1["errors"] == 1
    assert p1["ttft_slo_attainment"] == pytest.approx(1 / 3, abs=1e-4) and p1["goodput_tokens_per_s"] == 16.0
    # Jain over the well-behaved tenants of goodput / offered: tenant-1 32/64, tenant-2 20/64
    assert bq.jain_well_behaved(recs) == pytest.approx(round(bq.jain([32 / 64, 20 / 64]), 4))
    assert bq.jain_well_behaved(recs, "P0") == 1.0  # tenant-1 alone in P0
    assert bq.jain_well_behaved(recs, "P2") == 1.0 and bq.jain_well_behaved(recs, "P1") is None
    t = bq.tenant_stats(recs, 2.0)
    assert t["tenant-1"]["goodput_of_offered"] == 0.5 and t["noisy"]["shed"] == 1


def test_budget_check_exact_and_off_by_one():
    recs = [R("tenant-1", "P0", usage=1100), R("tenant-1", "P2", status=429), R("noisy", "P1", usage=1050)]
    b = bq.budget_check(recs, {"tenant-1": 1100, "noisy": 1051})
    assert b["tenant-1"] == {"store_tokens": 1100, "usage_tokens": 1100, "exact": True, "answered_without_usage": 0}
    assert b["noisy"]["exact"] is False


def test_out_document_shape():
    recs = [R("tenant-1", "P0"), R("tenant-2", "P1"), R("tenant-3", "P2", status=429), R("noisy", "P1")]
    rows, jains = [], {}
    for policy in bq.POLICIES:
        for load in (1.0, 1.5):
            rows += bq.class_rows(policy, load, recs, 1.0)
            jains.setdefault(policy, {})[load] = bq.jain_well_behaved(recs)
    doc = json.loads(json.dumps(bq.document(rows, jains, [1.0, 1.5], budgets={})))
    assert set(doc["jain_index"]) == {"none", "qos"}
    assert all(isinstance(v, float) for v in doc["jain_index"].values())
    assert len(doc["rows"]) == 6
    assert {(r["policy"], r["class"]) for r in doc["rows"]} == {(p, c) for p in ("none", "qos") for c in bq.CLASSES}
    for r in doc["rows"]:
        assert set(bq.ROW_KEYS) <= set(r) and r["load"] == 1.5
        assert all(isinstance(r[k], (int, float)) for k in bq.ROW_KEYS[2:])
    assert len(doc["load_steps"]) == 12 and {r["load"] for r in doc["load_steps"]} == {1.0, 1.5}
    lines = bq.goals(doc)
    assert any(line.startswith("P0 TTFT SLO attainment") for line in lines)
    assert any("Jain" in line for line in lines)


def test_strict_order_p2_floor_is_zero_at_capacity_and_all_once_p0_p1_alone_exceed_it():
    # P2 is 4 of 14 shares x 40 % = 11.4 % of requests: P0 + P1 alone exceed capacity above 1 / 0.886 = 113 %
    assert bq.strict_order_p2_shed(1.0) == 0.0 and bq.strict_order_p2_shed(0.8) == 0.0
    assert bq.strict_order_p2_shed(1.05) == pytest.approx(0.05 / (1.05 * 0.4 * 4 / 14))
    assert bq.strict_order_p2_shed(1.25) == bq.strict_order_p2_shed(1.5) == 1.0


def test_default_load_steps_resolve_p2_shedding_between_capacity_and_the_goal_point():
    # 150 % stays the goal point (the --out rows); the steps between are at most 10 points apart, so a cliff
    # shows as one step, and the floor between them is printed beside the measured shed rate
    assert max(bq.LOADS) == 1.5 and min(bq.LOADS) == 1.0
    assert list(bq.LOADS) == sorted(set(bq.LOADS)) and len(bq.LOADS) >= 5
    assert all(b - a <= 0.1 + 1e-9 for a, b in zip(bq.LOADS, bq.LOADS[1:]))


def test_goals_p2_line_separates_the_workloads_floor_from_the_rules_step():
    rows = []
    for load, shed in ((1.0, 0.1), (1.1, 0.85), (1.2, 1.0)):
        n = 20
        recs = [R("tenant-1", "P2", status=429) for _ in range(round(shed * n))]
        recs += [R("tenant-1", "P2") for _ in range(n - len(recs))]
        rows += bq.class_rows("qos", load, recs + [R("tenant-2", "P0"), R("noisy", "P1")], 1.0)
    doc = bq.document(rows, {"qos": {1.0: 1.0, 1.1: 1.0, 1.2: 1.0}}, [1.0, 1.1, 1.2], budgets={})
    line = next(g for g in bq.goals(doc) if g.startswith("P2 shed rate"))
    assert "100% 10%, 110% 85%, 120% 100%" in line and "NOT MET" in line  # +75 points: over the 50-point criterion
    floor = bq.strict_order_p2_shed(1.1)  # 0.1 / (1.1 x 0.114) = 80 %: the workload's, not the rule's
    assert f"110% {floor:.0%}" in line
    assert f"100% -> 110%: +75 points measured, {floor * 100:+.0f} of them forced" in line
    assert "shed above the floor per step: 100% +10, 110% +5, 120% +0" in line
