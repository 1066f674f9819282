"""The per-request cost of the canary feed (canary/feed.py) at `on_done`, and of the supervisor's tail.

What: calls `FeedObserver` N times on a finished request with a variant (one record each, into a real
ring file in a temporary directory) and on one without (the check that returns), and times
`FeedReader.read()` over what was written. Prints microseconds per call; no thresholds.
Run: `.venv/bin/python perf/bench_canary_feed.py [N]` (default 200,000; a few seconds).
"""

from __future__ import annotations

import sys
import tempfile
import time

from canary.feed import FeedObserver, FeedReader, FeedWriter
from extproc.lifecycle import Completion
from extproc.types import Outcome, RequestState


def main(n: int = 200_000) -> None:
    with tempfile.TemporaryDirectory() as d:
        obs = FeedObserver(FeedWriter(d, worker=0, capacity=1 << 20))
        with_variant = RequestState(snapshot=None, route=None, started=time.monotonic())
        with_variant.variant = "bench/canary"
        with_variant.completion = Completion(200, duration=0.02, first_upstream_byte=0.005)
        without = RequestState(snapshot=None, route=None, started=time.monotonic())
        for st, label in ((without, "no rollout (variant None)"), (with_variant, "with a rollout (one record)")):
            obs(st, Outcome.OK)
            t = time.perf_counter()
            for _ in range(n):
                obs(st, Outcome.OK)
            print(f"on_done feed, {label}: {(time.perf_counter() - t) / n * 1e6:.3f} us/request")
        reader = FeedReader(d)
        t = time.perf_counter()
        got = reader.read()
        print(f"supervisor tail: {len(got)} records in {(time.perf_counter() - t) * 1e3:.1f} ms "
              f"({(time.perf_counter() - t) / max(len(got), 1) * 1e6:.3f} us/record)")
        reader.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)
