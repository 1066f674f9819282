"""Recorded fleet states for the engine-signal plugins: the worker's real `EngineSignals` (the
metrics scraper) holding samples parsed from the engines' own exposition text (tests/data/metrics),
each with an age on an explicit clock, so formulas and staleness are decided on known numbers.
Where the scraping itself matters the tests scrape real HTTP servers instead."""

from __future__ import annotations

from pathlib import Path

from extproc.datalayer.engine_metrics import EngineSample, parse_metrics
from extproc.runtime import Runtime
from extproc.scheduling.signals import EngineSignals
from tests.extproc.scheduling.conftest import Built, build

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"


def recorded(name: str, engine: str = "vllm") -> EngineSample:
    """The sample a scrape of fixture `name` (tests/data/metrics/<name>.txt) gives."""
    return parse_metrics(engine, (DATA / f"{name}.txt").read_text())


# queue / running / KV of the fixtures used below (each test file checks the numbers it relies on):
VLLM = "vllm"  # queue 3, KV 0.4219, LoRA running finance-lora, legal-lora; waiting sql-lora; max_lora 4
VLLM_V0 = "vllm_v0"  # queue 7, KV 0.9132 (saturated twice over)
SIMULATOR = "simulator"  # queue 2, KV 0.05396, LoRA running finance-lora; waiting legal-lora; max_lora 2
VLLM_DP = "vllm_dp"  # queue 7, KV 0.7


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def fleet(rt: Runtime, samples: dict[str, EngineSample | None], ages: dict[str, float] | None = None,
          clock: Clock | None = None, engine: str = "vllm", interval: float = 0.2) -> EngineSignals:
    """Give `rt` a scraper tracking `samples`' endpoints, each holding that sample (None: tracked, never
    scraped) received `ages[e]` seconds ago (default 0) at scrape interval `interval`."""
    clock = clock or Clock()
    sig = EngineSignals(clock=clock, inflight=rt.inflight.get)
    sig.update({e: (f"http://{e}/metrics", engine) for e in samples})
    for e, sample in samples.items():
        st = sig._states[e]
        st.interval = interval
        if sample is not None:
            st.sample, st.scraped_at = sample, clock.t - (ages or {}).get(e, 0.0)
    rt.signals = sig
    return sig


VLLM_HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: signals}
spec:
  backends:
    - name: pool
      kind: vllm
      models: [m, finance-lora, sql-lora, legal-lora, new-lora, meta-llama/Llama-3.1-8B-Instruct, llama-3-8b]
      endpoints: ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"]
"""


def vllm_gateway(plugins: str, profile: str, head: str = VLLM_HEAD) -> str:
    return (head + "  plugins:\n" + plugins + "  schedulingProfiles:\n    - name: p\n      explain: true\n"
            "      plugins: " + profile + "\n"
            "  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [pool], plugins: [p]}\n")


def built(plugins: str, profile: str, head: str = VLLM_HEAD) -> Built:
    return build(vllm_gateway(plugins, profile, head))


def request_state(b: Built, model: str = "m", content: str = "hi", priority: int | None = None, rid: str = "r"):
    from extproc.request import parse_openai

    st = b.state(rid=rid)
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    if priority is not None:
        body["priority"] = priority
    st.request = parse_openai("/v1/chat/completions", body)
    return st
