"""What the fuzz targets share: the suite's fixed hypothesis settings, a per-case time limit, and
how a refusal's message becomes its class.

Each target (tests/fuzz/test_fuzz_<target>.py) exposes `CASES` (a hypothesis strategy of cases) and
`check(case) -> str | None`: it raises `Finding` (or lets any other exception escape) when a
property is broken, and otherwise returns the class of the refusal the case got (None when the case
was accepted). The suite runs each target with `SUITE` (derandomized: the same examples every run);
`perf/fuzz.py` runs the same `CASES` and `check` for as many cases as it is asked, in seeded slices.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import threading
import time

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# the suite's profile: deterministic (derandomize: examples derived from the test's name), no
# example database (nothing carried between runs), no wall-clock deadline (the machine is shared)
SUITE = settings(max_examples=200, derandomize=True, database=None, deadline=None, print_blob=False,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much, HealthCheck.large_base_example])
CASE_LIMIT_S = 10.0  # a case running longer than this is a hang (a case takes milliseconds)


class Finding(AssertionError):
    """A property of the target does not hold for this case."""


class Hang(Finding):
    """The case ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float = CASE_LIMIT_S):
    """Raise `Hang` in the main thread when the block runs past `seconds` (SIGALRM; a no-op in
    another thread, where signals cannot be delivered)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise Hang(f"case ran past its {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    start = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)  # an outer timer (pytest-timeout's) is put back after
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`[^`]*`")
_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_POINTER = re.compile(r"#/\S*")
_SPACE = re.compile(r"\s+")


def refusal_class(message: str, limit: int = 120) -> str:
    """A refusal message with what varies per case taken out (quoted text, numbers, JSON pointers),
    so refusals group by kind: "line N, column N: invalid escape '…' in string"."""
    text = _QUOTED.sub("'…'", message)
    text = _POINTER.sub("#/…", text)
    text = _NUMBER.sub("N", text)
    text = _SPACE.sub(" ", text).strip()
    return text[:limit]


@functools.cache
def _sampled(options: tuple) -> st.SearchStrategy:
    return st.sampled_from(options)


def pick(options) -> st.SearchStrategy:
    """`st.sampled_from(options)` built once per distinct (hashable) option list: inside a composite
    strategy, building and validating a new strategy on every draw costs more than the draw."""
    return _sampled(tuple(options))
