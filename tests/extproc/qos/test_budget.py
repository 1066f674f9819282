"""Token-budget arithmetic: windows, reset times, estimates, reconciliation, the headers' binding window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from backends.base import Usage
from extproc.qos.budget import (Limits, WindowState, estimate, go_duration, header_values, reconciled_tokens, remaining,
                                reset_after, window_indexes)
from extproc.request import parse_openai

T0 = 1_796_000_000.0  # a unix time: 1796000000 = 20787 days + 3200 s, i.e. 53 min 20 s into its day


def test_window_indexes_and_reset_times_are_aligned_to_utc_minutes_and_days():
    assert window_indexes(T0) == (int(T0 // 60), 20787)
    assert reset_after(T0, 0) == pytest.approx(40.0)  # 1796000000 % 60 == 20
    assert reset_after(T0, 1) == pytest.approx(86400 - 3200)
    assert reset_after(T0 + 40, 0) == pytest.approx(60.0)  # exactly on a boundary: a whole new window
    assert window_indexes(T0 + 40)[0] == window_indexes(T0)[0] + 1


@pytest.mark.parametrize("seconds,text", [(0.25, "250ms"), (0.0, "0ms"), (1, "1s"), (12.5, "12.5s"), (59.999, "59.999s"),
                                          (60, "1m0s"), (90, "1m30s"), (3700.5, "1h1m40.5s"), (86400, "24h0m0s")])
def test_reset_is_formatted_as_openai_does_go_durations(seconds, text):
    assert go_duration(seconds) == text


def limits(**kw) -> Limits:
    return Limits((kw.get("rpm"), kw.get("tpm")), (kw.get("rpd"), kw.get("tpd")), kw.get("ect", 256))


def test_estimate_is_prompt_characters_over_four_plus_max_tokens_or_the_default():
    chat = parse_openai("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * 41}],
                                                 "max_tokens": 7})
    assert estimate(chat, "openai", limits(tpm=100)) == (10, 7)
    no_max = parse_openai("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "abcd"}]})
    assert estimate(no_max, "openai", limits(tpm=100, ect=33)) == (1, 33)
    emb = parse_openai("/v1/embeddings", {"model": "m", "input": "y" * 80})
    assert estimate(emb, "openai", limits(tpm=100)) == (20, 0)
    # kinds that are not generative count requests only
    assert estimate(chat, "kserve", limits(tpm=100)) == (0, 0)
    assert estimate(None, "openai", limits(tpm=100)) == (0, 0)


def test_reconciled_tokens_prefer_reported_usage_then_nothing_for_processor_replies_then_the_estimate():
    with_usage = SimpleNamespace(usage=Usage(12, 30), reply_status=None, attrs={})
    assert reconciled_tokens(with_usage, 99) == 42
    answered = SimpleNamespace(usage=None, reply_status=404, attrs={})
    assert reconciled_tokens(answered, 99) == 0
    streamed = SimpleNamespace(usage=None, reply_status=None, attrs={"genai.sse_events": 6})
    assert reconciled_tokens(streamed, 10) == 10 + 5  # 6 JSON events: 5 tokens + the finish chunk
    unknown = SimpleNamespace(usage=None, reply_status=None, attrs={})
    assert reconciled_tokens(unknown, 10) == 10


def test_headers_report_the_binding_window_and_remaining_uses_the_peak():
    lim = limits(rpm=10, tpm=1000, rpd=100, tpd=1500)
    # minute: 3 requests, tokens 400 now but 700 at their peak; day: 95 requests, 1100 tokens
    windows = (WindowState(3, 400, 700, 20.0), WindowState(95, 1100, 1100, 5000.0))
    assert remaining(lim, windows) == {"requests": (100, 5, 5000.0), "tokens": (1000, 300, 20.0)}
    assert header_values(lim, windows) == {
        "limit-requests": "100", "remaining-requests": "5", "reset-requests": "1h23m20s",
        "limit-tokens": "1000", "remaining-tokens": "300", "reset-tokens": "20s"}
    # only the units with a limit get headers; remaining never goes below 0
    assert header_values(limits(rpm=2), (WindowState(5, 0, 0, 1.0), WindowState(5, 0, 0, 9.0))) == {
        "limit-requests": "2", "remaining-requests": "0", "reset-requests": "1s"}
