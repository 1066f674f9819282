"""Scheduling on live engine signals through the real Envoy and processor, over two OpenAI simulators
with `--latency-model vllm` (vLLM's metric names, queueing, LoRA API).

- queue-scorer: one simulator is kept loaded (long streaming requests sent to it directly, one running
  slot, so its own `vllm:num_requests_waiting` > 0); every request through the gateway goes to the other,
  counted by each simulator's own record of the requests it received.
- lora-affinity-scorer with `loadOnDemand`: a request for an adapter neither simulator has makes the
  worker load it on the picked one (`POST /v1/load_lora_adapter`, seen in that simulator's `/v1/models`);
  the adapter's later requests all go there and succeed.
The only waits are polls on the simulators' own state, and one wait of the scraper's idle interval for
the gateway to see the load (the scraper's documented cadence, not a latency threshold).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from extproc.datalayer.scraper import BUSY_INTERVAL_S, IDLE_INTERVAL_S
from tests.e2e.conftest import Simulator as _Simulator
from tests.e2e.test_xds_live import procs  # noqa: F401  (a fixture: started processes, stopped by handle)
from tests.promtext import scrape

pytestmark = pytest.mark.e2e


class Simulator(_Simulator):
    """backends/simulator_openai.py with the vLLM latency model on a free port."""

    def __init__(self, procs: list, *args: str) -> None:
        super().__init__(procs, "--latency-model", "vllm", *args)

    def received(self) -> int:
        """Generation requests this simulator received (its own record, GET /simulator/requests)."""
        reqs = httpx.get(f"{self.url}/simulator/requests", timeout=5).json()["requests"]
        return sum(1 for r in reqs if r["path"] in ("/v1/chat/completions", "/v1/completions"))

    def waiting(self) -> float:
        return scrape(f"{self.url}/metrics").total("vllm:num_requests_waiting")

    def models(self) -> list[str]:
        return [m["id"] for m in httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"]]


def write(path: Path, sims: tuple[Simulator, ...], plugins: list, profile: list, models: list[str]) -> Path:
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "signals"},
        "spec": {
            "backends": [{"name": "pool", "kind": "vllm", "models": models,
                          "endpoints": [s.id for s in sims]}],
            "plugins": [*plugins, {"type": "max-score-picker", "parameters": {"fallbacks": 0}}],
            "schedulingProfiles": [{"name": "p", "plugins": [*profile, {"pluginRef": "max-score-picker"}]}],
            "routes": [{"path": "/v1/", "match": "prefix", "kind": "openai", "targets": ["pool"], "plugins": ["p"]}],
        },
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def until(predicate, what: str, deadline: float = 30.0) -> None:
    end = time.monotonic() + deadline
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def hold_streams(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streaming chat requests to `url`, each read until `stop` (then the connection closes:
    the simulator cancels the request)."""

    def one() -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "write a long report"}],
                "max_tokens": 4000, "stream": True}
        try:
            with httpx.Client(timeout=None) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                for _ in r.iter_raw():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_queue_scorer_sends_requests_away_from_the_endpoint_with_a_queue(tmp_path, procs, stack_factory):
    # `loaded` runs one sequence at a time, each token about 6 ms x 20: three 4000-token streams keep
    # one running and two waiting for minutes; `idle` answers at full speed
    loaded = Simulator(procs, "--max-num-seqs", "1", "--time-scale", "20")
    idle = Simulator(procs)
    cfg = write(tmp_path / "gw.yaml", (loaded, idle), [{"type": "queue-scorer"}], [{"pluginRef": "queue-scorer"}],
                ["m"])
    st = stack_factory(cfg, workers=2, run_dir=str(tmp_path / "run"))
    stop = threading.Event()
    threads = hold_streams(loaded.url, 3, stop)
    try:
        until(lambda: loaded.waiting() >= 2, "two requests waiting on the loaded simulator")
        # the workers scrape an idle endpoint every IDLE_INTERVAL_S: after one such interval (plus a busy
        # one for the answer) every worker's last sample of `loaded` shows its queue
        time.sleep(IDLE_INTERVAL_S + 2 * BUSY_INTERVAL_S)
        before = (loaded.received(), idle.received(), idle.served())
        with httpx.Client(timeout=30) as client:
            for i in range(12):
                r = client.post(f"{st.url}/v1/chat/completions",
                                json={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}],
                                      "max_tokens": 2})
                assert r.status_code == 200, r.text
        assert loaded.received() - before[0] == 0
        assert idle.received() - before[1] == 12 and idle.served() - before[2] == 12
        assert loaded.waiting() >= 2  # still loaded: the comparison held throughout
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def test_a_cold_lora_adapter_is_loaded_on_demand_and_its_requests_follow_it(tmp_path, procs, stack_factory):
    args = ("--enable-lora", "--max-loras", "2", "--lora-load-ms", "200")
    a, b = Simulator(procs, *args), Simulator(procs, *args)
    plugins = [{"type": "lora-affinity-scorer",
                "parameters": {"loadOnDemand": True, "loraPaths": {"fin-lora": "/adapters/fin-lora"}}}]
    cfg = write(tmp_path / "gw.yaml", (a, b), plugins, [{"pluginRef": "lora-affinity-scorer"}], ["m", "fin-lora"])
    st = stack_factory(cfg, workers=1, run_dir=str(tmp_path / "run"))
    assert "fin-lora" not in a.models() and "fin-lora" not in b.models()
    body = {"model": "fin-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    first = httpx.post(f"{st.url}/v1/chat/completions", json=body, timeout=30)
    # the decision does not wait for the load: this request reached its endpoint while the adapter was
    # (most likely) still loading there and got vLLM's 404 for an unknown model, or found it loaded
    assert first.status_code in (200, 404), first.text
    until(lambda: "fin-lora" in a.models() or "fin-lora" in b.models(), "the adapter loaded on one simulator")
    host, other = (a, b) if "fin-lora" in a.models() else (b, a)
    assert "fin-lora" not in other.models()
    before = (host.served(), other.received())
    with httpx.Client(timeout=30) as client:
        for _ in range(8):
            r = client.post(f"{st.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "fin-lora"
    assert host.served() - before[0] == 8 and other.received() == before[1]
    assert "fin-lora" not in other.models()  # loaded once, where the requests go
