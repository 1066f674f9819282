"""perf/bench_scaling.py: the arithmetic and parsing around the measurements (no servers, no timing).

- worker counts: `--workers` parsing (sorted, duplicates dropped, refusals) and the default 1, 2, 4, ...
  up to the CPU count, which must include the CPU count itself on any machine size;
- `--envoy-concurrency` (match or fixed) and the core plan (wrk pinned only with >= 4 cores);
- efficiency = rps(N) / (N x rps(1)), per route, on rows built from synthetic bench_overhead Points;
- the verdict says when the figures cannot judge scaling (nothing pinned).
"""

from __future__ import annotations

import pytest

from tests.perf_scripts import load_perf


bo = load_perf("bench_overhead")
bs = load_perf("bench_scaling")


@pytest.mark.parametrize("cpus, expected", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (12, [1, 2, 4, 8, 12]),
                                            (16, [1, 2, 4, 8, 16]), (64, [1, 2, 4, 8, 16, 32, 64])])
def test_default_workers_go_up_to_the_cpu_count(cpus, expected):
    assert bs.default_workers(cpus) == expected
    assert bs.parse_workers(None, cpus) == expected
    assert bs.parse_workers(" ", cpus) == expected


def test_parse_workers_sorts_and_drops_duplicates():
    assert bs.parse_workers("1,2,4,8,16", 2) == [1, 2, 4, 8, 16]  # not capped by this machine's cores
    assert bs.parse_workers("4, 1,4,", 2) == [1, 4]


@pytest.mark.parametrize("text", ["0", "-1", "two", "1,x", "1.5", ","])
def test_parse_workers_refuses_anything_but_positive_integers(text):
    with pytest.raises(ValueError):
        bs.parse_workers(text, 2)


def test_envoy_concurrency_matches_or_is_fixed():
    assert bs.envoy_concurrency("match", 8) == 8
    assert bs.envoy_concurrency("3", 8) == 3
    for bad in ("0", "auto", "-2"):
        with pytest.raises(ValueError):
            bs.envoy_concurrency(bad, 8)


def test_cpu_plan_pins_wrk_only_with_four_cores_or_more():
    assert bs.plan_cpus([0, 1]) == ([], [])
    assert bs.plan_cpus([0, 1, 2]) == ([], [])
    assert bs.plan_cpus([0, 1, 2, 3]) == ([0, 1, 2], [3])
    assert bs.plan_cpus(list(range(16))) == (list(range(12)), [12, 13, 14, 15])
    assert bs.plan_cpus([7, 3, 5, 1], wrk_cpus=2) == ([1, 3], [5, 7])  # the highest-numbered usable cores
    with pytest.raises(ValueError):
        bs.plan_cpus(list(range(4)), wrk_cpus=4)  # nothing left for the servers


def test_cpu_list_notation():
    assert bs.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert bs.cpu_list([3]) == "3"
    assert bs.cpu_list([12, 13, 14, 15]) == "12-15"


def test_efficiency_is_rps_over_n_times_single_worker_rps():
    assert bs.efficiency({1: 1000.0, 2: 1600.0, 4: 3200.0, 8: 4000.0}) == {1: 1.0, 2: 0.8, 4: 0.8, 8: 0.5}
    assert bs.efficiency({2: 1600.0, 4: 3000.0}) == {2: None, 4: None}  # no N=1: no baseline
    assert bs.efficiency({1: 0.0, 2: 10.0}) == {1: None, 2: None}


def _point(n: int, route: str, rps: float, proc_cpu: float) -> "bo.Point":
    wrk = bo.WrkResult(p50=5.0, p90=8.0, p99=12.0, rps=rps, requests=int(rps * 4), non2xx=0, socket_errors=0)
    return bo.Point(f"w{n}", route, 64, wrk, {"processor": proc_cpu, "envoy": 0.5, "upstream": 0.1},
                    foreign=0.4, steal=0.0, handler_s=0.2, msgs_per_req=1.0)


def test_rows_carry_efficiency_per_route_and_cpu_per_request():
    points = [_point(1, "headers", 1000.0, 3.6), _point(2, "headers", 1500.0, 7.2),
              _point(1, "llm", 500.0, 3.8), _point(2, "llm", 900.0, 7.6)]
    rows = bs.build_rows(points, duration=4.0, envoy_c={1: 1, 2: 2})
    by = {(r["workers"], r["route"]): r for r in rows}
    assert by[(2, "headers")]["efficiency"] == 0.75  # 1500 / (2 x 1000): against its own route's N=1
    assert by[(2, "llm")]["efficiency"] == 0.9  # 900 / (2 x 500)
    assert by[(1, "llm")]["efficiency"] == 1.0
    assert by[(2, "headers")]["processor_cpu_us"] == 1200.0  # 7.2 s over 6000 requests
    assert by[(2, "headers")]["processor_cores_busy"] == 1.8  # 7.2 s over 4 s measured
    assert by[(2, "llm")]["envoy_concurrency"] == 2
    assert by[(1, "headers")]["other_load_cores"] == 0.1
    table = bs.fmt_table(rows)
    assert "| headers | 2 | 2 | 64 | 1,500 | 0.75 |" in table
    assert "headers N=2: 0.75x linear (goal >= 0.8: not met); llm N=2: 0.90x linear (goal >= 0.8: met)" in bs.verdict(rows)
    assert "Not a judgement" not in bs.verdict(rows, judged=True)
    assert "Not a judgement" in bs.verdict(rows, judged=False)


def test_verdict_without_a_single_worker_row():
    rows = bs.build_rows([_point(2, "llm", 900.0, 7.6)], duration=4.0, envoy_c={2: 2})
    assert rows[0]["efficiency"] is None
    assert bs.verdict(rows) == "no N > 1 with an N=1 row: no efficiency."
