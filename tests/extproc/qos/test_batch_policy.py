"""Batch policies' arithmetic (extproc/qos/batch_policy.py) on synthetic attainment sequences."""

from __future__ import annotations

import pytest

from extproc.qos.batch_policy import (AimdPolicy, BatchSetting, BriefPolicy, Observation, StaticPolicy, make_policy,
                                      update_batch_size)


def obs(r: float | None, n: int = 100) -> Observation:
    return Observation(r, n if r is not None else 0)


# -- the brief's function, exactly ------------------------------------------------------------------


@pytest.mark.parametrize("ratio, size", [
    (1.0, 48), (0.96, 48), (0.951, 48),  # > 0.95: int(32 * 1.5)
    (0.95, 32), (0.92, 32), (0.9, 32),  # the band [0.9, 0.95] is base itself
    (0.89, 30),  # int(32 * (1 - 0.01 * 5)) = int(30.4)
    (0.85, 23),  # 32 * (1 - 0.05000000000000004 * 5) = 23.999999999999993: float64 rounding, truncated
    (0.8, 16),  # half
    (0.75, 7),  # 7.99999...: the same in Go's float64 on amd64 (no fused multiply-add)
    (0.7, 0),  # the brief's formula reaches 0 here
    (0.5, -32),  # and goes negative below
])
def test_update_batch_size_is_the_briefs_formula(ratio: float, size: int) -> None:
    assert update_batch_size(ratio) == size


def test_update_batch_size_truncates_toward_zero_like_go() -> None:
    # 32 * (1 - (0.9 - 0.71) * 5) = 32 * 0.05 = 1.6 -> 1; 32 * (1 - 0.22 * 5) = -3.2 -> -3 (not -4)
    assert update_batch_size(0.71) == 1
    assert update_batch_size(0.68) == -3


def test_brief_policy_clamps_and_is_memoryless() -> None:
    p = BriefPolicy(delay_us=1000)
    assert p.initial() == BatchSetting(32, 1000)
    assert p.decide(obs(0.5)) == BatchSetting(1, 1000)  # -32 clamped to the server's smallest size
    assert p.decide(obs(0.99)) == BatchSetting(48, 1000)  # straight back up: a function of this window only
    assert p.decide(obs(0.8)) == BatchSetting(16, 1000)
    assert p.decide(obs(0.93)) == BatchSetting(32, 1000)  # the dead band maps to base, not to the last size
    capped = BriefPolicy(delay_us=0, base=64, max_size=80, min_size=4)
    assert capped.decide(obs(1.0)).max_batch_size == 80  # 96 capped
    assert capped.decide(obs(0.0)).max_batch_size == 4


def test_brief_policy_keeps_its_setting_without_evidence() -> None:
    p = BriefPolicy(delay_us=500, min_requests=10)
    p.decide(obs(0.8))
    assert p.decide(obs(None)) == BatchSetting(16, 500)
    assert p.decide(Observation(1.0, 9)) == BatchSetting(16, 500)  # too few requests
    assert p.decide(Observation(1.0, 10)) == BatchSetting(48, 500)


def test_brief_policy_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="low/high"):
        BriefPolicy(delay_us=0, low=0.96, high=0.95)
    with pytest.raises(ValueError, match="base"):
        BriefPolicy(delay_us=0, base=0)


# -- AIMD -------------------------------------------------------------------------------------------


def test_aimd_additive_increase_needs_hold_good_windows_in_a_row() -> None:
    p = AimdPolicy(delay_us=1000, start=8, step=2, hold=3, max_size=12)
    sizes = [p.decide(obs(r)).max_batch_size for r in (1, 1, 1, 1, 1, 1, 1, 1, 1)]
    assert sizes == [8, 8, 10, 10, 10, 12, 12, 12, 12]  # +2 every 3rd good window, capped at 12


def test_aimd_hysteresis_one_good_window_is_not_enough() -> None:
    p = AimdPolicy(delay_us=0, start=8, hold=3, cooldown=0)
    seq = [1, 1, 0.5, 1, 1, 0.96, 1]  # the violation restarts the count
    sizes = [p.decide(obs(r)).max_batch_size for r in seq]
    assert sizes == [8, 8, 4, 4, 4, 6, 6]


def test_aimd_multiplicative_decrease_with_cooldown_and_floor() -> None:
    p = AimdPolicy(delay_us=0, start=48, factor=0.5, cooldown=2, min_size=2, max_size=48)
    sizes = [p.decide(obs(0.1)).max_batch_size for _ in range(10)]
    # halve, then 2 windows of cooldown, halve again ...: 24, 24, 24, 12, 12, 12, 6, 6, 6, 3
    assert sizes == [24, 24, 24, 12, 12, 12, 6, 6, 6, 3]
    q = AimdPolicy(delay_us=0, start=3, cooldown=0, min_size=2)
    assert [q.decide(obs(0.0)).max_batch_size for _ in range(3)] == [2, 2, 2]  # floor(1.5) -> bound 2


def test_aimd_target_is_inclusive_and_empty_windows_change_nothing() -> None:
    p = AimdPolicy(delay_us=0, start=10, target=0.95, hold=2, cooldown=0)
    assert p.decide(obs(0.95)).max_batch_size == 10  # holds (>= target): 1 of 2
    assert p.decide(obs(None)).max_batch_size == 10  # no evidence: neither a good window nor a break
    assert p.decide(obs(0.95)).max_batch_size == 12  # 2 of 2 -> +2
    assert p.decide(obs(0.9499)).max_batch_size == 6  # a violation


def test_aimd_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="factor"):
        AimdPolicy(delay_us=0, factor=1.0)
    with pytest.raises(ValueError, match="start"):
        AimdPolicy(delay_us=0, start=100, max_size=48)


def test_static_and_make_policy() -> None:
    configured = BatchSetting(32, 1000)
    s = make_policy("static", configured)
    assert isinstance(s, StaticPolicy)
    assert [s.decide(obs(r)) for r in (0.0, 1.0, None)] == [configured] * 3
    assert make_policy("brief", configured).initial() == BatchSetting(32, 1000)
    assert make_policy("aimd", configured, max_size=16).initial() == BatchSetting(16, 1000)
    with pytest.raises(ValueError, match="unknown 'pid'"):
        make_policy("pid", configured)
