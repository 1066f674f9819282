"""A recorded fleet for the context-aware plugins' tests: the brief's §2.2 GPUs and a few others.

G0, G1 are the brief's table (GPU 0: 18.2 GiB in use, NVLink 50 GB/s, serves v2.1; GPU 1: 12.7 GiB,
no NVLink, no v2.1), here on a 40 GiB A100 and a 16 GiB V100 (the table gives no card size);
A185 is an A100 with TensorRT 8.5 running v1.9; BARE has no labels at all."""

from __future__ import annotations

from extproc.request import parse_openai
from extproc.types import RequestState
from tests.extproc.scheduling.conftest import build

G0, G1, A185, BARE = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
FLEET = (G0, G1, A185, BARE)

FLEET_HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: fleet}
spec:
  backends:
    - name: pool
      models: [llama, "llama@v2.1", "llama@v1.9", "llama@v3", "llama:2.1"]
      endpoints:
        - {address: "10.0.0.1:8000", labels: {accelerator: a100, tensorrt: "8.6", nvlink: "true", model-version: v2.1,
                                              pool: gold, gpuMemUsedGiB: "18.2", gpuMemTotalGiB: "40", nvlinkGBps: "50"}}
        - {address: "10.0.0.2:8000", labels: {accelerator: v100, model-version: v1.9, pool: shared,
                                              gpuMemUsedGiB: "12.7", gpuMemTotalGiB: "16", nvlinkGBps: "0"}}
        - {address: "10.0.0.3:8000", labels: {accelerator: a100, tensorrt: "8.5", nvlink: "true", model-version: v1.9,
                                              pool: code}}
        - "10.0.0.4:8000"
"""


def fleet(plugins: str, profile: str, head: str = FLEET_HEAD) -> str:
    """A config with the fleet, `plugins` (spec.plugins items) and profile `p` listing `profile` refs."""
    return (head + "  plugins:\n" + plugins + "  schedulingProfiles:\n    - name: p\n      plugins: " + profile + "\n"
            "  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [pool], plugins: [p]}\n")


def state(b, model: str = "llama", tenant: str | None = None, prompt: str = "hi", stream: bool = False,
          priority: int | None = None, **attrs: str) -> RequestState:
    """A request state on the built config `b` (conftest.Built): the parsed chat request, the tenant
    as the processor's tenancy would set it, and hint headers as the stream keeps them."""
    st = RequestState(snapshot=b.snap, route=b.route, started=0.0, request_id="rid", runtime=b.runtime, tenant=tenant)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if priority is not None:
        body["priority"] = priority
    st.request = parse_openai("/v1/chat/completions", body)
    st.attrs.update({k.replace("_", "-"): v for k, v in attrs.items()})
    return st


def built(plugins: str, profile: str, head: str = FLEET_HEAD):
    return build(fleet(plugins, profile, head))


def ctx(b, st: RequestState):
    from extproc.scheduling import SchedulingContext

    return SchedulingContext(st, b.backend, st.request, b.runtime, b.backend.endpoint_labels, "p")


def plugin(b, name: str):
    return b.runtime.plugin(b.snap.plugins[name])


METRICS = __import__("pathlib").Path(__file__).resolve().parents[2] / "data" / "metrics"


class Clock:
    """A clock the tests move by hand (the scraper's `clock`): ages are set, never waited for."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def signals_with(runtime, samples: dict, clock: Clock):
    """Gives `runtime` engine signals (a MetricsScraper on `clock`, what `runtime.signals` is) holding,
    per endpoint, the sample parsed from a recorded exposition: {endpoint: (engine, fixture file)},
    scraped at `clock`'s present time at the idle interval (so stale after 8 s)."""
    from extproc.datalayer.engine_metrics import parse_metrics
    from extproc.datalayer.scraper import MetricsScraper

    s = MetricsScraper(clock=clock)
    s.update({ep: (f"http://{ep}/metrics", engine) for ep, (engine, _) in samples.items()})
    for ep, (engine, fixture) in samples.items():
        st = s._states[ep]
        st.sample = parse_metrics(engine, (METRICS / fixture).read_text())
        st.scraped_at = clock()
    runtime.signals = s
    return s
