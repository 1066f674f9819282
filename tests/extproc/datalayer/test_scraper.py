"""The metrics scraper: pure decisions (interval, staleness bound, the EPP saturation rule) with
explicit clocks, then the task against real HTTP servers serving fixture text: latest sample kept,
busy cadence from the sample or the gateway's in-flight count, a server that dies (sample kept, age
grows, saturated once stale, recovery), bad answers, reloads and stop. Waits are polls with deadlines."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from extproc.datalayer.engine_metrics import EngineSample, parse_metrics
from extproc.datalayer.scraper import (
    BUSY_INTERVAL_S, EPP_STALENESS_S, IDLE_INTERVAL_S, KV_THRESHOLD, QUEUE_THRESHOLD, STALE_FACTOR, MetricsScraper,
    is_saturated, next_interval, sample_age, stale_bound)

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"
IDLE_TEXT = (DATA / "simulator.txt").read_text().replace(
    'vllm:num_requests_running{model_name="llama-3-8b"} 2.0', 'vllm:num_requests_running{model_name="llama-3-8b"} 0.0'
).replace('vllm:num_requests_waiting{model_name="llama-3-8b"} 2.0', 'vllm:num_requests_waiting{model_name="llama-3-8b"} 0.0')
BUSY_TEXT = (DATA / "vllm.txt").read_text()  # 12 running, 3 waiting, KV 0.42: busy, not saturated
FULL_TEXT = (DATA / "sglang.txt").read_text()  # 2826 queued: saturated


# --- pure decisions --------------------------------------------------------------------------------------

def test_defaults_are_the_documented_ones():
    assert (BUSY_INTERVAL_S, IDLE_INTERVAL_S) == (0.2, 2.0)
    assert (QUEUE_THRESHOLD, KV_THRESHOLD, EPP_STALENESS_S, STALE_FACTOR) == (5, 0.8, 0.2, 4.0)
    assert stale_bound(BUSY_INTERVAL_S) == pytest.approx(0.8)
    assert stale_bound(IDLE_INTERVAL_S) == pytest.approx(8.0)


def test_next_interval():
    idle = EngineSample(engine="vllm", queue=0, running=0)
    assert next_interval(None) == IDLE_INTERVAL_S
    assert next_interval(None, inflight=1) == BUSY_INTERVAL_S
    assert next_interval(idle) == IDLE_INTERVAL_S
    assert next_interval(idle, inflight=2) == BUSY_INTERVAL_S
    assert next_interval(EngineSample(engine="vllm", queue=1, running=0)) == BUSY_INTERVAL_S
    assert next_interval(EngineSample(engine="vllm", queue=0, running=1)) == BUSY_INTERVAL_S
    assert next_interval(EngineSample(engine="onnxruntime", queue=None), busy_interval=0.1, idle_interval=5) == 5
    assert next_interval(EngineSample(engine="onnxruntime", queue=3), busy_interval=0.1, idle_interval=5) == 0.1


def test_is_saturated_is_the_epp_rule():
    ok = EngineSample(engine="vllm", queue=5, running=9, kv_usage=0.8)  # at the thresholds: not above
    assert not is_saturated(ok, age=0.1, stale_after=0.8)
    assert is_saturated(None, age=0.0, stale_after=0.8)  # no sample
    assert is_saturated(ok, age=0.81, stale_after=0.8)  # stale
    assert not is_saturated(ok, age=0.8, stale_after=0.8)
    assert is_saturated(EngineSample(engine="vllm", queue=6, kv_usage=0.1), age=0.0, stale_after=1)
    assert is_saturated(EngineSample(engine="vllm", queue=0, kv_usage=0.81), age=0.0, stale_after=1)
    assert not is_saturated(EngineSample(engine="onnxruntime", queue=2), age=0.0, stale_after=1)  # no KV series
    assert not is_saturated(EngineSample(engine="vllm", queue=6), age=0.0, stale_after=1, queue_threshold=10)
    assert is_saturated(EngineSample(engine="vllm", kv_usage=0.5), age=0.0, stale_after=1, kv_threshold=0.4)


def test_sample_age():
    assert sample_age(None, 10.0) == math.inf
    assert sample_age(9.5, 10.0) == 0.5
    assert sample_age(10.5, 10.0) == 0.0


def test_intervals_must_be_ordered():
    with pytest.raises(ValueError):
        MetricsScraper(busy_interval=2.0, idle_interval=1.0)


# --- against real HTTP servers ---------------------------------------------------------------------------

class MetricsServer:
    """A real HTTP server on a free port answering GET with `body` and `status`, changeable while it runs."""

    def __init__(self, body: str, status: int = 200, port: int = 0):
        self.body, self.status, self.hits = body, status, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                server.hits += 1
                data = server.body.encode()
                self.send_response(server.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[MetricsServer] = []

    def make(body: str, status: int = 200, port: int = 0) -> MetricsServer:
        made.append(MetricsServer(body, status, port))
        return made[-1]

    yield make
    for s in made:
        try:
            s.close()
        except OSError:
            pass


@pytest.fixture
async def scrapers():
    made: list[MetricsScraper] = []

    def make(**kw) -> MetricsScraper:
        made.append(MetricsScraper(**kw))
        return made[-1]

    yield make
    for s in made:
        await s.stop()


async def until(predicate, what: str, deadline: float = 15.0):
    end = time.monotonic() + deadline
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_scrapes_a_real_server_and_keeps_the_latest_sample(servers, scrapers):
    srv = servers(BUSY_TEXT)
    sc = scrapers(busy_interval=0.02, idle_interval=0.05)
    sc.start({srv.endpoint: (srv.url, "vllm")})
    ep = srv.endpoint
    await until(lambda: sc.sample(ep) is not None, "the first sample")
    got = sc.sample(ep)
    assert got == parse_metrics("vllm", BUSY_TEXT)  # the first one has no previous: no queue-time delta
    assert 0.0 <= sc.age(ep) < math.inf and sc.scraped_at(ep) <= time.monotonic()
    assert sc.interval(ep) == 0.02  # 12 running, 3 waiting
    assert not sc.saturated(ep, stale_after=60)
    srv.body = (DATA / "vllm_dp.txt").read_text()
    await until(lambda: sc.sample(ep).queue == 7, "the changed exposition")
    assert sc.sample(ep).running == 17 and sc.errors(ep) == 0
    stats = sc.stats()[ep]
    assert stats["engine"] == "vllm" and stats["scrapes"] >= 2 and stats["errors"] == 0 and stats["last_error"] is None


async def test_a_saturated_engine_is_saturated_while_fresh(servers, scrapers):
    full, fine = servers(FULL_TEXT), servers(BUSY_TEXT)
    sc = scrapers(busy_interval=0.02, idle_interval=0.05)
    sc.start({full.endpoint: (full.url, "sglang"), fine.endpoint: (fine.url, "vllm")})
    await until(lambda: sc.sample(full.endpoint) and sc.sample(fine.endpoint), "both samples")
    assert sc.saturated(full.endpoint, stale_after=60)  # 2826 queued
    assert not sc.saturated(fine.endpoint, stale_after=60)


async def test_in_flight_requests_make_an_idle_endpoint_busy(servers, scrapers):
    srv = servers(IDLE_TEXT)
    inflight = {}
    sc = scrapers(busy_interval=0.02, idle_interval=3600.0, inflight=lambda ep: inflight.get(ep, 0))
    ep = srv.endpoint
    sc.start({ep: (srv.url, "simulator")})
    await until(lambda: sc.sample(ep) is not None, "the first sample")
    assert sc.interval(ep) == 3600.0 and not sc.sample(ep).busy
    assert sc.stale_after(ep) == pytest.approx(4 * 3600.0)  # idle: the bound follows the idle interval
    srv.body = BUSY_TEXT
    await asyncio.sleep(0.2)
    assert sc.stats()[ep]["scrapes"] == 1  # idle: the next scrape is an hour away
    inflight[ep] = 1  # the gateway sends it requests: scraped at the busy interval from now on
    assert sc.interval(ep) == 0.02
    await until(lambda: sc.sample(ep).running == 12, "a scrape prompted by the in-flight count")
    inflight[ep] = 0
    assert sc.interval(ep) == 0.02  # the new sample itself is busy
    assert sc.stale_after(ep) == pytest.approx(4 * 0.02)


async def test_a_server_that_dies_keeps_its_sample_ages_then_is_saturated_and_recovers(servers, scrapers):
    srv = servers(IDLE_TEXT)
    port = srv.port
    sc = scrapers(busy_interval=0.02, idle_interval=0.05)
    ep = srv.endpoint
    sc.start({ep: (srv.url, "vllm")})
    await until(lambda: sc.sample(ep) is not None, "the first sample")
    srv.close()
    await until(lambda: sc.errors(ep) >= 2, "failed scrapes")
    kept, at = sc.sample(ep), sc.scraped_at(ep)
    assert kept is not None and kept.queue == 0
    assert "ConnectError" in sc.stats()[ep]["last_error"]
    # the decision with explicit clocks
    assert not sc.saturated(ep, stale_after=1.0, now=at + 0.5)
    assert sc.saturated(ep, stale_after=1.0, now=at + 1.5)
    assert sc.age(ep, now=at + 1.5) == pytest.approx(1.5)
    # and with the real one: the age grows while the sample stays
    first_age = sc.age(ep)
    await until(lambda: sc.age(ep) > first_age + 0.05, "the age to grow")
    await until(lambda: sc.saturated(ep, stale_after=0.3), "staleness")
    await until(lambda: sc.saturated(ep), "the default bound, 4 x 0.05 s")
    assert sc.sample(ep) is kept and sc.scraped_at(ep) == at
    # back on the same port: fresh samples again
    servers(BUSY_TEXT, port=port)
    await until(lambda: sc.scraped_at(ep) != at, "a scrape after recovery")
    assert sc.sample(ep).running == 12 and sc.stats()[ep]["last_error"] is None
    assert not sc.saturated(ep, stale_after=60)


async def test_bad_answers_keep_the_previous_sample_and_count_errors(servers, scrapers):
    srv = servers(BUSY_TEXT)
    sc = scrapers(busy_interval=0.02, idle_interval=0.05)
    ep = srv.endpoint
    sc.start({ep: (srv.url, "vllm")})
    await until(lambda: sc.sample(ep) is not None, "the first sample")
    kept = sc.sample(ep)
    srv.status = 503
    await until(lambda: sc.errors(ep) >= 1, "an HTTP error")
    assert sc.stats()[ep]["last_error"] == "_ScrapeError: HTTP 503" and sc.sample(ep) is kept
    srv.status, srv.body = 200, 'vllm:num_requests_waiting{model_name="m" 3\n'
    await until(lambda: "MetricsParseError" in (sc.stats()[ep]["last_error"] or ""), "a parse error")
    assert sc.sample(ep) is kept


async def test_an_oversized_body_is_an_error(servers, scrapers):
    srv = servers(BUSY_TEXT)
    sc = scrapers(busy_interval=0.02, idle_interval=0.05, max_body=1000)
    ep = srv.endpoint
    sc.start({ep: (srv.url, "vllm")})
    await until(lambda: sc.errors(ep) >= 1, "the size error")
    assert sc.sample(ep) is None and "body over 1000 bytes" in sc.stats()[ep]["last_error"]
    assert sc.saturated(ep)  # no sample at all


async def test_update_keeps_endpoints_still_present(servers, scrapers):
    a, b = servers(BUSY_TEXT), servers(IDLE_TEXT)
    sc = scrapers(busy_interval=0.02, idle_interval=0.05)
    sc.start({a.endpoint: (a.url, "vllm")})
    await until(lambda: sc.sample(a.endpoint) is not None, "a's sample")
    kept_state = sc.stats()[a.endpoint]["scrapes"]
    sc.update({a.endpoint: (a.url, "vllm"), b.endpoint: (b.url, "simulator")})
    assert sc.sample(a.endpoint) is not None and sc.stats()[a.endpoint]["scrapes"] >= kept_state
    assert sc.sample(b.endpoint) is None and sc.saturated(b.endpoint)
    await until(lambda: sc.sample(b.endpoint) is not None, "the new endpoint scraped")
    assert sc.endpoints() == (a.endpoint, b.endpoint)
    sc.update({b.endpoint: (b.url, "vllm")})  # "simulator" is vLLM's names: same engine, state kept
    assert sc.endpoints() == (b.endpoint,) and sc.sample(b.endpoint) is not None
    assert sc.sample(a.endpoint) is None and sc.saturated(a.endpoint) and sc.age(a.endpoint) == math.inf
    sc.update({b.endpoint: (b.url.replace("/metrics", "/other"), "vllm")})  # a new URL starts over
    assert sc.sample(b.endpoint) is None


async def test_stop_ends_the_task_and_a_scraper_runs_once(servers):
    srv = servers(IDLE_TEXT)
    sc = MetricsScraper(busy_interval=0.02, idle_interval=0.05)
    sc.start({srv.endpoint: (srv.url, "vllm")})
    assert sc.running
    with pytest.raises(RuntimeError, match="already running"):
        sc.start({})
    await until(lambda: sc.sample(srv.endpoint) is not None, "a sample")
    await sc.stop()
    assert not sc.running
    with pytest.raises(RuntimeError, match="start"):
        await sc.scrape(srv.endpoint)
    await sc.stop()  # twice is fine


async def test_unknown_endpoints_and_engines():
    sc = MetricsScraper()
    assert sc.sample("10.0.0.1:80") is None and sc.saturated("10.0.0.1:80") and sc.age("10.0.0.1:80") == math.inf
    assert sc.interval("10.0.0.1:80") is None and sc.errors("10.0.0.1:80") == 0
    with pytest.raises(ValueError, match="unknown engine"):
        sc.update({"10.0.0.1:80": ("http://10.0.0.1/metrics", "tgi")})


# --- the bulk pass saturation-filter uses ------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_STATE = st.one_of(st.none(), st.tuples(
    st.one_of(st.none(), st.floats(0, 20)),  # queue
    st.one_of(st.none(), st.floats(0, 1)),  # KV use
    st.one_of(st.none(), st.floats(0, 30)),  # age (None: never scraped)
    st.sampled_from([0.2, 2.0]),  # the interval chosen at the last attempt
    st.booleans()))  # whether a sample is there at all


@settings(max_examples=300, deadline=None, derandomize=True)
@given(states=st.lists(_STATE, min_size=0, max_size=8), queue=st.floats(0, 10), kv=st.floats(0, 1),
       stale=st.one_of(st.none(), st.floats(0.05, 10)))
def test_unsaturated_is_is_saturated_on_each_tracked_endpoint_and_keeps_the_untracked(states, queue, kv, stale):
    now = 1000.0
    s = MetricsScraper(clock=lambda: now)
    eps = tuple(f"10.0.0.{i}:8000" for i in range(len(states)))
    s.update({e: (f"http://{e}/metrics", "vllm") for e, x in zip(eps, states) if x is not None})
    for e, x in zip(eps, states):
        if x is None:
            continue
        q, k, age, interval, has = x
        stt = s._states[e]
        stt.interval = interval
        stt.sample = EngineSample("vllm", queue=q, kv_usage=k) if has else None
        stt.scraped_at = None if age is None else now - age
    expected = [e for e, x in zip(eps, states) if x is None or not is_saturated(
        s.sample(e), s.age(e), s.stale_after(e) if stale is None else stale, queue, kv)]
    assert s.unsaturated(eps, queue, kv, stale) == expected
