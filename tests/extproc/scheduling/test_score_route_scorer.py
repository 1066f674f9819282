"""Scorer `score-route-scorer`: (1 - mem_util) - 0.3 [version != preferred] + nvlink_score (the brief's §2.2)."""

from __future__ import annotations

import itertools

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.datalayer.nvml import GpuStats, NvmlReading
from extproc.scheduling import Scorer
from extproc.scheduling.score_route_scorer import NvmlPoller, ScoreRouteScorer, ScoreRouteScorerParameters
from tests.extproc.scheduling.fleet import (A185, BARE, FLEET, FLEET_HEAD, G0, G1, Clock, built, ctx, fleet, plugin,
                                            signals_with, state)


def scoring(params: str = "{maxNvlinkGBps: 50}", head: str = FLEET_HEAD):
    return built(f"    - {{name: s, type: score-route-scorer, parameters: {params}}}\n"
                 "    - {type: max-score-picker, parameters: {fallbacks: 3}}\n",
                 "[{pluginRef: s}, {pluginRef: max-score-picker}]", head)


def scores(b, model="llama", cands=FLEET, **kw):
    return plugin(b, "s").score(ctx(b, state(b, model, **kw)), cands)


def test_is_an_unbounded_scorer_that_consumes_engine_metrics():
    s = ScoreRouteScorer("s", ScoreRouteScorerParameters(), None)
    assert isinstance(s, Scorer) and s.bounded is False and "engine_metrics" in s.consumes


def test_the_briefs_table_gpu0_beats_gpu1_for_a_v21_request():
    b = scoring()
    got = scores(b, "llama@v2.1", (G0, G1))
    # GPU 0: 1 - 18.2/40 - 0 + 50/50; GPU 1: 1 - 12.7/16 - 0.3 + 0/50
    assert got == pytest.approx({G0: 1 - 18.2 / 40 + 1.0, G1: 1 - 12.7 / 16 - 0.3})
    assert got[G0] == pytest.approx(1.545) and got[G1] == pytest.approx(-0.09375)
    for _ in range(10):
        assert b.decide(state(b, "llama@v2.1"))[0] == G0


@pytest.mark.parametrize("total0, total1", list(itertools.product((18.2, 24, 40, 80), (12.7, 16, 32))))
def test_gpu0_wins_whatever_the_cards_sizes(total0, total1):
    head = FLEET_HEAD.replace('gpuMemTotalGiB: "40"', f'gpuMemTotalGiB: "{total0}"').replace(
        'gpuMemTotalGiB: "16"', f'gpuMemTotalGiB: "{total1}"')
    got = scores(scoring(head=head), "llama@v2.1", (G0, G1))
    assert got[G0] >= 1.0 > 0.7 >= got[G1]


def test_the_version_penalty_applies_only_when_the_request_names_a_version():
    b = scoring("{maxNvlinkGBps: 50, versionPenalty: 0.25}")
    base = scores(b, "llama")
    assert scores(b, "llama@v1.9") == pytest.approx({G0: base[G0] - 0.25, G1: base[G1], A185: base[A185],
                                                     BARE: base[BARE] - 0.25})  # unlabelled: penalised
    assert scores(b, "llama:1.9") == scores(b, "llama@v1.9")  # 1.9 is v1.9


def test_each_term_from_labels():
    head = FLEET_HEAD.replace('        - "10.0.0.4:8000"\n',
                              '        - {address: "10.0.0.4:8000", labels: {gpuMemUtil: "0.9", nvlinkScore: "0.4", '
                              'nvlinkGBps: "50", model-version: "v3, v1.9"}}\n')
    b = scoring(head=head)
    got = scores(b, "llama@v1.9")
    assert got[BARE] == pytest.approx((1 - 0.9) + 0.4)  # nvlinkScore wins over GB/s; a listed version
    assert got[A185] == pytest.approx(0.5 + 0.0)  # no memory figure: unknownMemUtil 0.5; no NVLink figure: 0


def test_values_are_clamped_and_garbage_is_ignored():
    head = FLEET_HEAD.replace('nvlinkGBps: "50"', 'nvlinkGBps: "900"').replace(
        '        - "10.0.0.4:8000"\n', '        - {address: "10.0.0.4:8000", labels: {gpuMemUtil: "1.7", '
                                      'nvlinkScore: "-1", gpuMemUsedGiB: "x"}}\n')
    b = scoring("{maxNvlinkGBps: 600, unknownMemUtil: 0.2}", head=head)
    got = scores(b)
    assert got[G0] == pytest.approx(1 - 18.2 / 40 + 1.0)  # 900/600 clamped to 1
    assert got[BARE] == pytest.approx(0.0)  # util 1.7 -> 1, score -1 -> 0
    assert got[A185] == pytest.approx(0.8)


def test_the_engines_gpu_memory_comes_first_and_a_stale_sample_counts_as_full():
    b = scoring()
    clock = Clock()
    signals_with(b.runtime, {G1: ("triton", "triton.txt"), A185: ("vllm", "vllm.txt")}, clock)
    got = scores(b, "llama@v2.1")
    # Triton: 50 GiB used of 160 over two GPUs, over the 12.7/16 label; vLLM exports no GPU memory
    assert got[G1] == pytest.approx(1 - 50 / 160 - 0.3)
    assert got[A185] == pytest.approx(1 - 0.5 - 0.3)
    clock.t += 8.01  # past 4 x the idle interval: stale
    assert scores(b, "llama@v2.1")[G1] == pytest.approx(0.0 - 0.3)


def test_nvml_fails_soft_to_the_labels_and_reads_local_gpus_when_present():
    head = FLEET_HEAD.replace("pool: shared,", 'pool: shared, nvmlGpu: "0,1",')
    b = scoring(head=head)
    s = plugin(b, "s")
    scores(b)  # the first endpoint asking for a local GPU starts the poller
    assert s.nvml is not None
    for _ in range(300):  # its first read (a failure at once on a host without NVML)
        if s.nvml.reading is not None:
            break
        s.nvml._stop.wait(0.1)
    reading = s.nvml.reading
    assert reading is not None
    if reading.ok:  # a GPU host: the local GPUs' memory
        u = s.nvml.util((0, 1))
        assert scores(b)[G1] == pytest.approx(1 - (u if u is not None else 12.7 / 16))
    else:  # no driver or no pynvml: the reason, and the labels
        assert reading.reason and scores(b)[G1] == pytest.approx(1 - 12.7 / 16)
        s.nvml._thread.join(timeout=30)
        assert not s.nvml._thread.is_alive()  # it does not keep polling what cannot change
    s.close()
    s.nvml._thread.join(timeout=30)
    gib = 1 << 30
    s.nvml.reading = NvmlReading((GpuStats(0, "GPU-a", "V100", 4 * gib, 16 * gib, 0.5),
                                  GpuStats(1, "GPU-b", "V100", 12 * gib, 16 * gib, 0.9)))
    assert s.nvml.util((0, 1)) == pytest.approx(0.5) and s.nvml.util((0,)) == pytest.approx(0.25)
    assert s.nvml.util((2,)) is None
    assert scores(b)[G1] == pytest.approx(1 - 0.5)
    assert NvmlPoller.util(s.nvml, ()) is None


@pytest.mark.parametrize("params, message", [
    ("{versionPenalty: -0.1}", "spec.plugins[0].parameters.versionPenalty"),
    ("{maxNvlinkGBps: 0}", "spec.plugins[0].parameters.maxNvlinkGBps"),
    ("{unknownMemUtil: 2}", "spec.plugins[0].parameters.unknownMemUtil"),
    ("{nvmlIntervalS: 0}", "spec.plugins[0].parameters.nvmlIntervalS"),
    ("{penalty: 0.3}", "spec.plugins[0].parameters.penalty: unknown parameter"),
    ("{versionLabel: ''}", "spec.plugins[0].parameters.versionLabel"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(fleet(f"    - {{name: s, type: score-route-scorer, parameters: {params}}}\n", "[{pluginRef: s}]"),
                  "c.yaml")
    assert message in str(e.value)


def test_in_a_profile_the_scores_are_min_max_normalised():
    b = built("    - {name: s, type: score-route-scorer, parameters: {maxNvlinkGBps: 50}}\n",
              "[{pluginRef: s}]\n      explain: true")
    st = state(b, "llama@v2.1")
    b.decide(st)
    (entry,) = st.attrs["decision"]["scorers"]
    assert entry["normalised"][G0] == 1.0 and entry["normalised"][G1] == 0.0
    raw = entry["raw"]
    assert entry["normalised"][A185] == pytest.approx((raw[A185] - raw[G1]) / (raw[G0] - raw[G1]))


def test_a_reload_reparses_labels_and_parameters():
    b = scoring()
    s = plugin(b, "s")
    assert scores(b, "llama@v2.1", (G0,))[G0] == pytest.approx(1 - 18.2 / 40 + 1.0)
    b.reload(fleet("    - {name: s, type: score-route-scorer, parameters: {maxNvlinkGBps: 100}}\n",
                   "[{pluginRef: s}]"))
    assert plugin(b, "s") is s and scores(b, "llama@v2.1", (G0,))[G0] == pytest.approx(1 - 18.2 / 40 + 0.5)
    b.reload(fleet("    - {name: s, type: score-route-scorer, parameters: {maxNvlinkGBps: 100}}\n", "[{pluginRef: s}]",
                   FLEET_HEAD.replace('gpuMemUsedGiB: "18.2"', 'gpuMemUsedGiB: "30"')), generation=3)
    assert scores(b, "llama@v2.1", (G0,))[G0] == pytest.approx(1 - 30 / 40 + 0.5)
    s.configure(s.params, s.params.model_copy(update={"max_nvlink_gbps": 25.0}))  # same labels, new parameters
    assert scores(b, "llama@v2.1", (G0,))[G0] == pytest.approx(1 - 30 / 40 + 1.0)


# --- mem_util's sources, in the docstring's order ----------------------------------------------------------

def test_mem_util_takes_the_first_source_that_has_a_figure_and_says_which():
    head = FLEET_HEAD.replace("pool: code}", 'pool: code, nvmlGpu: "0"}')  # A185 asks for local GPU 0
    b = scoring("{maxNvlinkGBps: 50, unknownMemUtil: 0.25}", head=head)
    s = plugin(b, "s")
    clock = Clock()
    signals_with(b.runtime, {G1: ("triton", "triton.txt"), BARE: ("vllm", "vllm.txt")}, clock)
    c = ctx(b, state(b))
    labels = b.backend.endpoint_labels
    assert s.mem_util(c, G1, labels[G1]) == (pytest.approx(50 / 160), "engine")  # over its 12.7/16 label
    assert s.mem_util(c, G0, labels[G0]) == (pytest.approx(18.2 / 40), "label")  # no sample
    assert s.mem_util(c, BARE, {}) == (0.25, "unknown")  # vLLM exports no GPU memory; no labels: unknownMemUtil
    s.nvml = FakePoller({0: (30, 40)})
    assert s.mem_util(c, A185, labels[A185]) == (pytest.approx(0.75), "nvml")
    s.nvml = FakePoller({1: (30, 40)})  # GPU 0 not read: the labels (none here), then unknown
    assert s.mem_util(c, A185, labels[A185]) == (0.25, "unknown")
    clock.t += 8.01
    assert s.mem_util(c, G1, labels[G1]) == (1.0, "stale")


class FakePoller:
    """An NvmlPoller's `util` over fixed (used, total) GiB per local GPU index, no thread."""

    def __init__(self, gpus):
        self.gpus = gpus

    def util(self, indices):
        if any(i not in self.gpus for i in indices):
            return None
        return sum(self.gpus[i][0] for i in indices) / sum(self.gpus[i][1] for i in indices)

    def close(self):
        pass


def test_stale_means_older_than_the_endpoints_own_bound():
    b = scoring()
    clock = Clock()
    sig = signals_with(b.runtime, {G1: ("triton", "triton.txt")}, clock)
    assert sig.stale_after(G1) == 8.0  # 4 x the idle interval of a scraped endpoint (not the busy 0.8 s)
    clock.t += 1.0  # stale for a busy endpoint's bound, fresh for this one's
    assert scores(b, "llama@v2.1")[G1] == pytest.approx(1 - 50 / 160 - 0.3)
    clock.t = 1008.0  # exactly the bound: not older than it, so still fresh (stale is age > bound)
    assert scores(b, "llama@v2.1")[G1] == pytest.approx(1 - 50 / 160 - 0.3)
    clock.t = 1008.5
    assert scores(b, "llama@v2.1")[G1] == pytest.approx(0.0 - 0.3)


def test_non_finite_and_half_given_labels_are_ignored():
    head = FLEET_HEAD.replace('gpuMemTotalGiB: "40", nvlinkGBps: "50"', 'gpuMemTotalGiB: "40", nvlinkGBps: "inf"').replace(
        'gpuMemUsedGiB: "12.7", gpuMemTotalGiB: "16", nvlinkGBps: "0"',
        'gpuMemUtil: "nan", gpuMemUsedGiB: "12.7", gpuMemTotalGiB: "16", nvlinkScore: "-inf", nvlinkGBps: "25"').replace(
        "pool: code}", 'pool: code, gpuMemTotalGiB: "40"}').replace(
        '        - "10.0.0.4:8000"\n', '        - {address: "10.0.0.4:8000", labels: {gpuMemUsedGiB: "10"}}\n')
    b = scoring("{maxNvlinkGBps: 50, unknownMemUtil: 0.2}", head=head)
    got = scores(b)
    assert got[G0] == pytest.approx(1 - 18.2 / 40 + 0.0)  # an infinite GB/s is no figure: 0, not a full link
    assert got[G1] == pytest.approx(1 - 12.7 / 16 + 25 / 50)  # NaN util and -inf score skipped for the next source
    assert got[A185] == pytest.approx(1 - 0.2)  # a total without a used figure: unknownMemUtil
    assert got[BARE] == pytest.approx(1 - 0.2)  # a used figure without a total: likewise


def test_labels_are_parsed_once_per_labels_object():
    b = scoring()
    s = plugin(b, "s")
    parsed = []
    real = s.nvlink_score
    s.nvlink_score = lambda labels: parsed.append(labels) or real(labels)
    first = scores(b, "llama@v2.1")
    assert scores(b, "llama@v2.1") == first and scores(b, "llama") is not None
    assert len(parsed) == len(FLEET)  # three decisions, one parse per endpoint
    b.reload(fleet("    - {name: s, type: score-route-scorer, parameters: {maxNvlinkGBps: 50}}\n", "[{pluginRef: s}]",
                   FLEET_HEAD.replace('nvlinkGBps: "50"', 'nvlinkGBps: "25"')))
    assert scores(b, "llama@v2.1")[G0] == pytest.approx(first[G0] - 0.5)  # a new snapshot's labels: parsed anew
    assert len(parsed) == len(FLEET) + 3  # the three labelled ones (BARE's no-labels is one shared empty mapping)


def test_built_from_config_under_its_name_with_the_workers_runtime_and_closes_without_a_poller():
    b = scoring()
    s = plugin(b, "s")
    assert isinstance(s, ScoreRouteScorer) and s.name == "s" and s.runtime is b.runtime
    scores(b)  # no endpoint names a local GPU: no poller
    assert s.nvml is None
    s.close()  # nothing to stop
    head = FLEET_HEAD.replace("pool: shared,", 'pool: shared, nvmlGpu: "x",')  # not GPU indices: ignored
    b = scoring(head=head)
    assert scores(b)[G1] == pytest.approx(1 - 12.7 / 16) and plugin(b, "s").nvml is None


# --- the NVML poller, over a stand-in for extproc.datalayer.nvml.Nvml ------------------------------------------

class FakeNvml:
    """Answers `script`'s readings in turn (then the last forever); `reason` is the permanent failure, if any."""

    instances: list = []

    def __init__(self, script, reason=None):
        self.script, self._reason, self.reads, self.closed = list(script), reason, 0, False

    @property
    def reason(self):
        return self._reason

    def read(self):
        self.reads += 1
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    def close(self):
        self.closed = True


GIB = 1 << 30


def reading(*used_total):
    return NvmlReading(tuple(GpuStats(i, f"GPU-{i}", "A100", u * GIB, t * GIB, 0.5) for i, (u, t) in enumerate(used_total)))


@pytest.fixture
def fake_nvml(monkeypatch):
    from extproc.datalayer import nvml

    made = []

    def install(script, reason=None):
        monkeypatch.setattr(nvml, "Nvml", lambda: made.append(FakeNvml(script, reason)) or made[-1])
        return made

    return install


def wait_for(predicate, what, deadline=10.0):
    import time

    end = time.monotonic() + deadline
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_the_poller_rereads_every_interval_and_rides_out_a_failed_read(fake_nvml):
    made = fake_nvml([reading((10, 40)), NvmlReading(None, "NVML read failed: GPU lost"), reading((20, 40)),
                      reading((30, 40))])
    p = NvmlPoller(0.01)
    try:
        assert p.interval == 0.01 and p._thread.daemon  # never keeps a worker from exiting
        # a failed read with NVML still up (reason None) is not the end: the next reads come
        wait_for(lambda: p.util((0,)) == pytest.approx(0.75), "the fourth reading")
        assert made[0].reads >= 4
    finally:
        p.close()
    p._thread.join(timeout=10)
    assert not p._thread.is_alive() and made[0].closed  # close() stops the thread, which shuts NVML down


def test_the_poller_stops_at_once_and_logs_why_when_nvml_cannot_work(fake_nvml, caplog):
    import logging

    reason = "pynvml is not importable (No module named 'pynvml'); install nvidia-ml-py on GPU hosts"
    made = fake_nvml([NvmlReading(None, reason)], reason=reason)
    with caplog.at_level(logging.WARNING, logger="extproc.scheduling.score_route_scorer"):
        p = NvmlPoller(0.01)
        p._thread.join(timeout=10)
    assert not p._thread.is_alive() and made[0].reads == 1 and made[0].closed
    assert p.reading.reason == reason and p.util((0,)) is None
    (warning,) = [r for r in caplog.records if r.name == "extproc.scheduling.score_route_scorer"]
    assert warning.getMessage() == f"score-route-scorer: {reason}; GPU memory from labels only"


def test_the_scorer_starts_its_poller_at_nvml_interval_s_and_close_stops_it(fake_nvml):
    made = fake_nvml([reading((4, 16), (12, 16))])
    head = FLEET_HEAD.replace("pool: shared,", 'pool: shared, nvmlGpu: "0,1",')
    b = scoring("{maxNvlinkGBps: 50, nvmlIntervalS: 0.02}", head=head)
    s = plugin(b, "s")
    scores(b)  # the first endpoint asking for a local GPU starts it
    try:
        assert s.nvml.interval == 0.02
        wait_for(lambda: made and made[0].reads >= 3, "three reads, one every 20 ms")
        assert scores(b)[G1] == pytest.approx(1 - 16 / 32)  # both GPUs summed, over the label's 12.7/16
    finally:
        s.close()
    s.nvml._thread.join(timeout=10)
    assert not s.nvml._thread.is_alive() and made[0].closed


def test_before_the_pollers_first_read_the_labels_count(monkeypatch):
    import threading

    from extproc.datalayer import nvml

    gate = threading.Event()

    class SlowNvml(FakeNvml):
        def read(self):
            gate.wait(10)  # NVML's first read has not returned yet
            return super().read()

    made = []
    monkeypatch.setattr(nvml, "Nvml", lambda: made.append(SlowNvml([reading((4, 16), (12, 16))])) or made[-1])
    head = FLEET_HEAD.replace("pool: shared,", 'pool: shared, nvmlGpu: "0,1",')
    b = scoring(head=head)
    s = plugin(b, "s")
    try:
        assert scores(b)[G1] == pytest.approx(1 - 12.7 / 16)  # starts the poller; no reading yet: the labels
        assert s.nvml.reading is None and s.nvml.util((0, 1)) is None
        gate.set()
        wait_for(lambda: s.nvml.reading is not None, "the first read")
        assert scores(b)[G1] == pytest.approx(1 - 16 / 32)
    finally:
        gate.set()
        s.close()
    s.nvml._thread.join(timeout=10)
