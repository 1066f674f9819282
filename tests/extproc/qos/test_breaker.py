"""The glitch breaker's arithmetic (extproc/qos/breaker.py): trips after exactly `windows` windows in a row
over the tenant's P99 threshold, skips quiet windows up to maxGap, recovers after recoveryWindows calm
windows; per tenant with the brief's thresholds (tenant-a 8.5 ms, tenant-b 12.0 ms)."""

from __future__ import annotations

from extproc.qos.breaker import BreakerConfig, GlitchBreaker

A, B = 0.0085, 0.012


def breaker(**kw) -> GlitchBreaker:
    g = GlitchBreaker()
    g.configure(BreakerConfig(**kw), {"tenant-a": A, "tenant-b": B})
    return g


def window(g: GlitchBreaker, index: int, **latencies: list[float]):
    for tenant, values in latencies.items():
        for v in values:
            g.record(tenant.replace("_", "-"), v)
    return g.close(index)


def test_trips_on_the_third_window_over_the_threshold_not_before():
    g = breaker()
    slow = [0.009] * 10  # p99 9 ms > 8.5 ms
    assert window(g, 0, tenant_a=slow) == [] and not g.is_open("tenant-a")
    assert window(g, 1, tenant_a=slow) == [] and not g.is_open("tenant-a")
    [t] = window(g, 2, tenant_a=slow)
    assert t.tenant == "tenant-a" and t.opened and t.p99 == 0.009 and t.threshold == A
    assert g.is_open("tenant-a") and not g.is_open("tenant-b") and g.tenants["tenant-a"].trips == 1


def test_the_p99_decides_not_the_mean():
    g = breaker()
    # 100 requests, one at 50 ms: the nearest-rank p99 is the 99th value, 5 ms: not over
    for i in range(3):
        assert window(g, i, tenant_a=[0.005] * 99 + [0.05]) == []
    # two slow in 100: the 99th value is slow
    for i in range(3, 5):
        window(g, i, tenant_a=[0.005] * 98 + [0.05, 0.05])
    assert not g.is_open("tenant-a")
    window(g, 5, tenant_a=[0.005] * 98 + [0.05, 0.05])
    assert g.is_open("tenant-a")


def test_a_window_within_the_threshold_resets_the_run():
    g = breaker()
    window(g, 0, tenant_a=[0.009])
    window(g, 1, tenant_a=[0.009])
    window(g, 2, tenant_a=[0.008])  # 8 ms <= 8.5 ms
    window(g, 3, tenant_a=[0.009])
    window(g, 4, tenant_a=[0.009])
    assert not g.is_open("tenant-a")
    window(g, 5, tenant_a=[0.009])
    assert g.is_open("tenant-a")


def test_thresholds_are_per_tenant():
    g = breaker()
    for i in range(3):
        window(g, i, tenant_a=[0.010], tenant_b=[0.010])  # 10 ms: over a's 8.5, under b's 12
    assert g.is_open("tenant-a") and not g.is_open("tenant-b")
    assert list(g.open_tenants()) == ["tenant-a"]
    g.record("unknown", 1.0)  # a tenant without a threshold is not tracked
    assert "unknown" not in g.tenants


def test_quiet_windows_are_skipped_up_to_max_gap():
    g = breaker(max_gap=2)
    window(g, 0, tenant_a=[0.009])
    window(g, 1)
    window(g, 2)  # two quiet windows: still a run of 1
    window(g, 3, tenant_a=[0.009])
    assert g.tenants["tenant-a"].run == 2
    window(g, 4)
    window(g, 5)
    window(g, 6)  # a third quiet window in a row: more than max_gap, the run is over
    assert g.tenants["tenant-a"].run == 0
    window(g, 7, tenant_a=[0.009])
    assert not g.is_open("tenant-a")


def test_min_samples_makes_a_thin_window_quiet():
    g = breaker(min_samples=3)
    for i in range(5):
        window(g, i, tenant_a=[0.009, 0.009])
    assert not g.is_open("tenant-a") and g.tenants["tenant-a"].run == 0
    for i in range(5, 8):
        window(g, i, tenant_a=[0.009] * 3)
    assert g.is_open("tenant-a")


def test_recovers_after_recovery_windows_calm_windows_and_an_over_window_restarts_the_count():
    g = breaker(recovery_windows=3)
    for i in range(3):
        window(g, i, tenant_a=[0.02])
    assert g.is_open("tenant-a")
    window(g, 3, tenant_a=[0.001])
    window(g, 4)  # quiet counts as calm: a shed tenant may have nothing left to show
    window(g, 5, tenant_a=[0.02])  # the spike is back: calm restarts
    window(g, 6, tenant_a=[0.001])
    window(g, 7, tenant_a=[0.001])
    assert g.is_open("tenant-a")
    [t] = window(g, 8)
    assert not t.opened and not g.is_open("tenant-a")
    # and it can trip again, after three new windows over
    for i in range(9, 11):
        window(g, i, tenant_a=[0.02])
    assert not g.is_open("tenant-a")
    window(g, 11, tenant_a=[0.02])
    assert g.is_open("tenant-a") and g.tenants["tenant-a"].trips == 2


def test_configure_keeps_a_tenant_whose_threshold_stays():
    g = breaker()
    for i in range(3):
        window(g, i, tenant_a=[0.02])
    kept = g.tenants["tenant-a"]
    g.configure(BreakerConfig(), {"tenant-a": A, "tenant-b": 0.001})
    assert g.tenants["tenant-a"] is kept and g.is_open("tenant-a")
    g.configure(BreakerConfig(), {"tenant-a": 0.5})
    assert not g.is_open("tenant-a") and "tenant-b" not in g.tenants
