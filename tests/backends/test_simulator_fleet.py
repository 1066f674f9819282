"""The simulator's fleet features: ``--latency-model vllm`` (continuous batching, prefix cache,
KV-bounded queueing), vLLM's LoRA API, the oracle's introspection endpoints, and that the defaults
are unchanged.

Simulators run as real subprocesses (``python -m backends.simulator_openai``), driven with the
``openai`` client and ``httpx``; metrics are read with prometheus_client's own parser.  No timing
thresholds: assertions are on counts, states and orderings of events.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.simulator_engine import BlockPool, LatencyParams, block_hashes
from backends.simulator_openai import SimulatorSettings, _parse_args, count_tokens
from extproc.stack import free_port

pytestmark = pytest.mark.timeout(90)

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE = "qwen2.5-finance"
BLOCK = 16
SYSTEM = ("You are a careful financial analyst. Answer with figures from the filing, cite the page, "
          "and never speculate beyond the reported quarter. ") * 6  # 828 bytes: 12 full blocks of 64 bytes


# -- simulator processes -------------------------------------------------------


@dataclass
class Sim:
    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=30)

    def state(self, hashes: bool = True) -> dict:
        response = httpx.get(f"{self.url}/simulator/state", params=None if hashes else {"hashes": "0"}, timeout=5)
        assert response.status_code == 200
        return response.json()

    def metrics(self) -> dict:
        """{(sample name, frozenset(labels)): value} and {family: type}, via prometheus_client's parser."""
        response = httpx.get(f"{self.url}/metrics", timeout=5)
        assert response.status_code == 200
        samples, types = {}, {}
        for family in text_string_to_metric_families(response.text):
            types[family.name] = family.type
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in samples, f"{key} exposed twice"
                samples[key] = sample.value
        return {"samples": samples, "types": types}


def _value(metrics: dict, name: str, **labels: str) -> float:
    return metrics["samples"][(name, frozenset(labels.items()))]


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def _await_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _start(tmp: Path, *args: str) -> Sim:
    port = free_port()
    log_path = tmp / f"sim-{port}.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "backends.simulator_openai", "--port", str(port), *args],
            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log_file)
    sim = Sim(process, port)

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"simulator exited with {process.returncode}: {log_path.read_text()}")
        try:
            return httpx.get(f"{sim.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _wait_until(healthy, 20, "the simulator's /health")
    except BaseException:
        _stop(sim)
        raise
    return sim


def _stop(sim: Sim) -> None:
    if sim.process.poll() is None:
        sim.process.send_signal(signal.SIGTERM)
        try:
            sim.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            sim.process.kill()
            sim.process.wait(timeout=5)


@pytest.fixture(scope="module")
def vllm_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """The vLLM latency model at calibration speed, a LoRA adapter preloaded."""
    sim = _start(tmp_path_factory.mktemp("vllm"), "--latency-model", "vllm", "--models", BASE,
                 "--lora-modules", "fin-lora=/adapters/fin", "--max-loras", "2")
    yield sim
    _stop(sim)


@pytest.fixture
def make_sim(tmp_path: Path) -> Iterator[Callable[..., Sim]]:
    started: list[Sim] = []

    def make(*args: str) -> Sim:
        started.append(_start(tmp_path, *args))
        return started[-1]

    yield make
    for sim in started:
        _stop(sim)


def _chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def _stream(client: httpx.AsyncClient, name: str, body: dict, events: list[tuple[str, int]]) -> int:
    """Stream a chat completion, appending (name, token index) to ``events`` as content arrives."""
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                events.append((name, tokens))
                tokens += 1
    return tokens


# -- the latency model and its parts, in process ---------------------------------


def test_step_time_formula() -> None:
    params = LatencyParams(step_base_s=0.006, step_per_seq_s=0.0005, prefill_s_per_token=1e-5,
                           speed=0.5, time_scale=10)
    # (6 ms + 4 x 0.5 ms + 200 x 10 us) x 10 / 0.5
    assert params.step_seconds(4, 200) == pytest.approx(0.2)
    assert params.step_seconds(8, 0) > params.step_seconds(4, 0)  # decode slows as the batch grows
    defaults = LatencyParams()
    assert (defaults.step_base_s, defaults.step_per_seq_s, defaults.prefill_s_per_token) == (0.0062, 0.0003, 33e-6)
    with pytest.raises(ValueError):
        LatencyParams(speed=0)


def test_block_hashes_chain_like_vllm() -> None:
    prefix = "a" * (4 * BLOCK * 3)  # exactly three blocks
    first = block_hashes([prefix + "first question " * 5], BLOCK)  # 75 more bytes: one more full block
    second = block_hashes([prefix + "other question " * 5], BLOCK)
    assert len(first) == count_tokens(prefix + "first question " * 5) // BLOCK == 4
    assert first[:3] == second[:3] and first[3] != second[3]  # a hash covers its whole prefix
    assert set(block_hashes([prefix], BLOCK, lora="fin-lora")).isdisjoint(first)  # adapters never share
    assert block_hashes([list(range(48))], BLOCK) != block_hashes(["x" * 192], BLOCK)
    assert len(block_hashes([list(range(47))], BLOCK)) == 2  # only full blocks are hashed
    # block i depends on block i-1: the same tokens after a different first block hash differently
    assert block_hashes(["b" * 64 + "a" * 64], BLOCK)[1] != block_hashes(["a" * 128], BLOCK)[1]


def test_block_pool_lru_evicts_least_recently_freed() -> None:
    pool = BlockPool(4)
    first = [pool.allocate(), pool.allocate()]
    pool.register(first[0], "h0")
    pool.register(first[1], "h1")
    pool.release(first)  # freed tail first: h1's block is evicted before h0's
    assert pool.lookup(["h0", "h1"], 8) == first and pool.usage == 0.0
    others = [pool.allocate(), pool.allocate()]  # the two never-used blocks go first
    assert set(others).isdisjoint(first) and pool.usage == 0.5
    pool.allocate()
    assert pool.lookup(["h0", "h1"], 8) == [first[0]]  # h1 evicted, h0 still cached
    pool.touch([first[0]])  # reused by a request: no longer free, survives the next allocation
    assert pool.available == 0 and pool.usage == 1.0
    pool.release([first[0]])
    assert pool.lookup(["h0"], 8) == [first[0]] and pool.available == 1


# -- prefix reuse ------------------------------------------------------------------


def test_prefix_reuse_reports_cached_tokens_and_counts_hits(vllm_sim: Sim) -> None:
    client = vllm_sim.client()
    before = vllm_sim.metrics()
    hits_before = _value(before, "vllm:prefix_cache_hits_total", model_name=BASE)
    queries_before = _value(before, "vllm:prefix_cache_queries_total", model_name=BASE)
    unique = f"[run {time.time_ns()}] "  # a prefix no earlier test sent
    system = unique + SYSTEM

    first = client.chat.completions.create(model=BASE, messages=_chat(system, "What was Q3 revenue?"),
                                           max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model=BASE, messages=_chat(system, "And the Q3 margin?"),
                                            max_tokens=4)
    # the leading full blocks of the shared system prompt are reused: 64-byte blocks before the question
    shared_blocks = len(system.encode()) // (4 * BLOCK)
    assert second.usage.prompt_tokens_details.cached_tokens == shared_blocks * BLOCK > 0
    assert second.usage.prompt_tokens == count_tokens(system + "And the Q3 margin?")

    other = client.chat.completions.create(model=BASE, messages=_chat("Different. " + system, "Q3?"),
                                           max_tokens=4)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # block 0 differs, so every block does

    after = vllm_sim.metrics()
    assert _value(after, "vllm:prefix_cache_hits_total", model_name=BASE) - hits_before == shared_blocks * BLOCK
    assert _value(after, "vllm:gpu_prefix_cache_hits_total", model_name=BASE) == \
        _value(after, "vllm:prefix_cache_hits_total", model_name=BASE)
    queried = first.usage.prompt_tokens + second.usage.prompt_tokens + other.usage.prompt_tokens
    assert _value(after, "vllm:prefix_cache_queries_total", model_name=BASE) - queries_before == queried

    # the same prompt under a LoRA adapter has its own cache entries, as in vLLM
    lora = client.chat.completions.create(model="fin-lora", messages=_chat(system, "What was Q3 revenue?"),
                                          max_tokens=2)
    assert lora.usage.prompt_tokens_details.cached_tokens == 0


def test_state_and_cached_prefix_expose_the_true_cache(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--kv-capacity", "4096")
    state = sim.state()
    assert state["latency_model"] == "vllm" and state["block_size"] == BLOCK
    engine = state["engines"][BASE]
    assert (engine["num_blocks"], engine["free_blocks"], engine["cached_blocks"]) == (256, 256, 0)
    assert engine["cached_block_hashes"] == []

    messages = _chat(SYSTEM, "Summarise the cash flow statement.")
    text = SYSTEM + "Summarise the cash flow statement."
    probe = httpx.post(f"{sim.url}/simulator/cached_prefix", json={"model": BASE, "messages": messages}, timeout=5)
    assert probe.json()["cached_tokens"] == 0 and probe.json()["prompt_tokens"] == count_tokens(text)

    sim.client().chat.completions.create(model=BASE, messages=messages, max_tokens=3)
    expected = block_hashes([text], BLOCK)
    engine = sim.state()["engines"][BASE]
    assert engine["cached_block_hashes"] == sorted(expected)  # exactly the prompt's full blocks
    assert engine["num_running"] == engine["num_waiting"] == 0
    assert engine["free_blocks"] == 256 and engine["kv_cache_usage"] == 0.0  # freed, contents kept
    assert "cached_block_hashes" not in sim.state(hashes=False)["engines"][BASE]

    probe = httpx.post(f"{sim.url}/simulator/cached_prefix", json={"messages": messages}, timeout=5).json()
    assert probe["cached_blocks"] == probe["prompt_blocks"] == len(expected)
    assert probe["cached_tokens"] == min(len(expected), (count_tokens(text) - 1) // BLOCK) * BLOCK
    # a prompt of exactly 5 blocks sent twice: the last block is recomputed (as vLLM, never a full hit)
    exact = "z" * (4 * BLOCK * 5)
    assert sim.client().completions.create(model=BASE, prompt=exact, max_tokens=2).usage.prompt_tokens == 80
    repeat = sim.client().completions.create(model=BASE, prompt=exact, max_tokens=2)
    assert repeat.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
    partial = httpx.post(f"{sim.url}/simulator/cached_prefix",
                         json={"messages": _chat(SYSTEM, "A different question")}, timeout=5).json()
    assert partial["cached_blocks"] == len(SYSTEM.encode()) // (4 * BLOCK)


def test_lru_eviction_when_the_cache_is_full(make_sim: Callable[..., Sim]) -> None:
    """20 blocks: each prompt takes 12 of them, so the third evicts the first one's blocks."""
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--kv-capacity", "320")
    prompts = [chr(ord("a") + i) * (4 * BLOCK * 11 + 8) for i in range(3)]  # 11 full blocks + 2 tokens each

    def cached(prompt: str) -> int:
        return httpx.post(f"{sim.url}/simulator/cached_prefix", json={"prompt": prompt}, timeout=5).json()[
            "cached_blocks"]

    client = sim.client()
    client.completions.create(model=BASE, prompt=prompts[0], max_tokens=2)
    client.completions.create(model=BASE, prompt=prompts[1], max_tokens=2)
    assert (cached(prompts[0]), cached(prompts[1])) == (8, 11)  # the second allocation evicted 3 of the first
    client.completions.create(model=BASE, prompt=prompts[2], max_tokens=2)
    assert (cached(prompts[0]), cached(prompts[1]), cached(prompts[2])) == (0, 8, 11)
    # touching the second prompt again makes it the most recently used: the first one's return evicts the third's
    again = client.completions.create(model=BASE, prompt=prompts[1], max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 8 * BLOCK
    client.completions.create(model=BASE, prompt=prompts[0], max_tokens=2)
    assert (cached(prompts[0]), cached(prompts[1]), cached(prompts[2])) == (11, 8, 0)


# -- queueing ----------------------------------------------------------------------


async def _one_at_a_time(sim: Sim, first: dict, second: dict) -> list[tuple[str, int]]:
    """Stream ``first``; once it runs, queue ``second``; return the content events in arrival order."""
    events: list[tuple[str, int]] = []
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as http:
        async def state() -> dict:
            return (await http.get("/simulator/state", params={"hashes": "0"})).json()

        a = asyncio.create_task(_stream(http, "A", first, events))
        await _await_until(lambda: bool(events), 20, "A's first token")
        b = asyncio.create_task(_stream(http, "B", second, events))
        deadline = time.monotonic() + 20
        while (current := await state())["num_waiting"] != 1:
            assert time.monotonic() < deadline, "B never queued"
            await asyncio.sleep(0.01)
        assert current["num_running"] == 1  # A runs, B waits
        assert not any(name == "B" for name, _ in events)
        counts = await asyncio.wait_for(asyncio.gather(a, b), 60)
    assert counts == [first["max_tokens"], second["max_tokens"]]
    return events


async def test_max_num_seqs_1_serves_the_second_after_the_first(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--max-num-seqs", "1", "--time-scale", "10")
    body = {"model": BASE, "messages": _chat(SYSTEM, "first"), "max_tokens": 30}
    events = await _one_at_a_time(sim, body, {**body, "messages": _chat(SYSTEM, "second"), "max_tokens": 5})
    last_a = max(i for i, (name, _) in enumerate(events) if name == "A")
    first_b = min(i for i, (name, _) in enumerate(events) if name == "B")
    assert last_a < first_b  # B's first token came after A's last
    assert sim.state()["engines"][BASE]["num_running"] == 0


async def test_a_full_kv_cache_queues_the_next_request(make_sim: Callable[..., Sim]) -> None:
    """Each request needs 13 of the cache's 20 blocks, so two cannot run together (slots are plenty)."""
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--kv-capacity", "320", "--time-scale", "20")
    prompt_a, prompt_b = "x" * 4 * 180, "y" * 4 * 180  # 180 prompt tokens + 20 generated: 13 blocks each
    body = {"model": BASE, "messages": [{"role": "user", "content": prompt_a}], "max_tokens": 20}
    events = await _one_at_a_time(sim, body, {**body, "messages": [{"role": "user", "content": prompt_b}]})
    names = [name for name, _ in events]
    assert names == ["A"] * 20 + ["B"] * 20
    metrics = sim.metrics()
    assert _value(metrics, "vllm:request_queue_time_seconds_count", model_name=BASE) == 2
    assert _value(metrics, "vllm:num_preemptions_total", model_name=BASE) == 0


async def test_admission_is_strict_fcfs_on_memory(make_sim: Callable[..., Sim]) -> None:
    """A small request that would fit does not jump ahead of a large one waiting for memory."""
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--kv-capacity", "320", "--time-scale", "20")
    big = {"model": BASE, "max_tokens": 20}
    events: list[tuple[str, int]] = []
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as http:
        async def waiting() -> int:
            return (await http.get("/simulator/state", params={"hashes": "0"})).json()["num_waiting"]

        a = asyncio.create_task(_stream(http, "A", {**big, "messages": [{"role": "user", "content": "x" * 720}]},
                                        events))
        await _await_until(lambda: bool(events), 20, "A's first token")
        b = asyncio.create_task(_stream(http, "B", {**big, "messages": [{"role": "user", "content": "y" * 720}]},
                                        events))
        deadline = time.monotonic() + 20
        while await waiting() != 1:
            assert time.monotonic() < deadline, "B never queued"
            await asyncio.sleep(0.01)
        c = asyncio.create_task(_stream(http, "C", {"model": BASE, "max_tokens": 3,
                                                    "messages": [{"role": "user", "content": "tiny"}]}, events))
        while await waiting() != 2:  # C needs 1 block of the 7 free, yet queues behind B
            assert time.monotonic() < deadline, "C never queued"
            await asyncio.sleep(0.01)
        assert [name for name, _ in events if name != "A"] == []
        await asyncio.wait_for(asyncio.gather(a, b, c), 60)
    names = [name for name, _ in events]
    assert len(names) - 1 - names[::-1].index("A") < names.index("C")


async def test_continuous_batching_interleaves_running_requests(make_sim: Callable[..., Sim]) -> None:
    """With room for both, the second request joins the running batch: tokens interleave."""
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--time-scale", "10")
    events: list[tuple[str, int]] = []
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as http:
        a = asyncio.create_task(_stream(http, "A", {"model": BASE, "messages": _chat("a", "a"), "max_tokens": 30},
                                        events))
        await _await_until(lambda: bool(events), 20, "A's first token")
        b = asyncio.create_task(_stream(http, "B", {"model": BASE, "messages": _chat("b", "b"), "max_tokens": 5},
                                        events))
        await asyncio.wait_for(asyncio.gather(a, b), 60)
    names = [name for name, _ in events]
    assert names.index("B") < len(names) - 1 - names[::-1].index("A")  # B started before A ended
    assert names[-1] == "A"  # and, shorter, finished before A


async def test_speed_orders_identical_requests(make_sim: Callable[..., Sim]) -> None:
    fast = make_sim("--latency-model", "vllm", "--models", BASE, "--time-scale", "5")
    slow = make_sim("--latency-model", "vllm", "--models", BASE, "--time-scale", "5", "--speed", "0.2")
    finished: list[str] = []

    async def ask(name: str, sim: Sim) -> None:
        client = sim.async_client()
        await client.chat.completions.create(model=BASE, messages=_chat(SYSTEM, "go"), max_tokens=20)
        finished.append(name)
        await client.close()

    await asyncio.wait_for(asyncio.gather(ask("slow", slow), ask("fast", fast)), 60)
    assert finished == ["fast", "slow"]
    assert fast.state()["speed"] == 1.0 and slow.state()["speed"] == 0.2


# -- metrics -----------------------------------------------------------------------


def test_metrics_use_vllm_names_types_and_counts(vllm_sim: Sim) -> None:
    before = vllm_sim.metrics()
    vllm_sim.client().chat.completions.create(model=BASE, messages=_chat("count", "me"), max_tokens=5)
    after = vllm_sim.metrics()
    types = after["types"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info"):
        assert types[name] == "gauge", name
    for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
                 "vllm:gpu_prefix_cache_queries", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:request_success", "vllm:num_preemptions"):
        assert types[name] == "counter", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert types[name] == "histogram", name

    def delta(name: str, **labels: str) -> float:
        labels = {"model_name": BASE, **labels}
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4  # 5 tokens: 4 gaps
    assert delta("vllm:time_per_output_token_seconds_count") == 4
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert _value(after, "vllm:cache_config_info", block_size="16", enable_prefix_caching="True",
                  num_gpu_blocks=str(65536 // 16)) == 1
    [lora_info] = [labels for (name, labels) in after["samples"] if name == "vllm:lora_requests_info"]
    assert dict(lora_info) == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}


# -- LoRA ------------------------------------------------------------------------


async def test_lora_load_list_serve_unload(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--lora-modules", "fin-lora=/adapters/fin",
                   "--lora-load-ms", "2000")
    client = sim.async_client()
    models = {m.id: m.to_dict() for m in (await client.models.list()).data}
    assert models["fin-lora"]["parent"] == BASE and models["fin-lora"]["root"] == "/adapters/fin"
    assert models[BASE]["parent"] is None

    with pytest.raises(openai.NotFoundError) as cold:  # not loaded: vLLM answers 404 for the model
        await client.chat.completions.create(model="tax-lora", messages=_chat("s", "q"), max_tokens=2)
    assert cold.value.body == {"message": "The model `tax-lora` does not exist.", "type": "NotFoundError",
                               "param": "model", "code": 404}

    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as http:
        load = asyncio.create_task(http.post("/v1/load_lora_adapter",
                                             json={"lora_name": "tax-lora", "lora_path": "/adapters/tax"}))
        deadline = time.monotonic() + 10
        while "tax-lora" not in (await http.get("/simulator/state")).json()["loras"]["loading"]:
            assert time.monotonic() < deadline and not load.done(), "the load never showed as loading"
            await asyncio.sleep(0.01)
        while_loading = await http.post("/v1/chat/completions", json={
            "model": "tax-lora", "messages": _chat("s", "q"), "max_tokens": 2})
        assert not load.done() and while_loading.status_code == 404  # still loading: not served yet
        loaded = await load
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'tax-lora' added successfully."

        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "tax-lora", "lora_path": "/x"})
        assert again.status_code == 400 and again.json()["error"]["type"] == "InvalidUserInput"
        assert "has already been loaded" in again.json()["error"]["message"]
        inplace = await http.post("/v1/load_lora_adapter",
                                  json={"lora_name": "tax-lora", "lora_path": "/adapters/tax2", "load_inplace": True})
        assert inplace.status_code == 200
        missing = await http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 400
        assert missing.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."

        served = await client.chat.completions.create(model="tax-lora", messages=_chat("s", "q"), max_tokens=3)
        assert served.model == "tax-lora" and served.usage.completion_tokens == 3
        models = {m.id: m.to_dict() for m in (await client.models.list()).data}
        assert models["tax-lora"]["parent"] == BASE and models["tax-lora"]["root"] == "/adapters/tax2"

        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "tax-lora"})
        assert unloaded.status_code == 200
        assert unloaded.text == "Success: LoRA adapter 'tax-lora' removed successfully."
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "tax-lora"})
        assert gone.status_code == 404
        assert gone.json()["error"] == {"message": "The lora adapter 'tax-lora' cannot be found.",
                                        "type": "NotFoundError", "param": None, "code": 404}
        assert (await http.post("/v1/unload_lora_adapter", json={})).status_code == 400
    assert "tax-lora" not in {m.id for m in (await client.models.list()).data}
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="tax-lora", messages=_chat("s", "q"), max_tokens=2)
    await client.close()


async def test_max_loras_limits_adapters_in_the_batch(make_sim: Callable[..., Sim]) -> None:
    """--max-loras 1: a second adapter waits while the first runs, a base-model request does not."""
    sim = make_sim("--latency-model", "vllm", "--models", BASE, "--max-loras", "1", "--time-scale", "10",
                   "--lora-modules", "lora-a=/a", "lora-b=/b")
    events: list[tuple[str, int]] = []
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as http:
        a = asyncio.create_task(_stream(http, "A", {"model": "lora-a", "messages": _chat("a", "a"),
                                                    "max_tokens": 25}, events))
        await _await_until(lambda: bool(events), 20, "lora-a's first token")
        b = asyncio.create_task(_stream(http, "B", {"model": "lora-b", "messages": _chat("b", "b"),
                                                    "max_tokens": 3}, events))
        deadline = time.monotonic() + 20
        while (await http.get("/simulator/state")).json()["num_waiting"] != 1:
            assert time.monotonic() < deadline, "lora-b never queued"
            await asyncio.sleep(0.01)
        text = (await http.get("/metrics")).text
        [info] = [s.labels for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
                  for s in f.samples]
        assert info == {"max_lora": "1", "running_lora_adapters": "lora-a", "waiting_lora_adapters": "lora-b"}
        base = asyncio.create_task(_stream(http, "base", {"model": BASE, "messages": _chat("c", "c"),
                                                          "max_tokens": 3}, events))
        await asyncio.wait_for(asyncio.gather(a, b, base), 60)
    names = [name for name, _ in events]
    assert names.index("base") < names.index("B")  # the base request skipped past the waiting adapter
    assert len(names) - 1 - names[::-1].index("A") < names.index("B")  # lora-b ran only after lora-a


# -- defaults ------------------------------------------------------------------------


def test_defaults_are_the_simple_model(make_sim: Callable[..., Sim]) -> None:
    assert _parse_args([]) == SimulatorSettings()
    assert SimulatorSettings().latency_model == "simple"
    sim = make_sim("--models", BASE)
    client = sim.client()
    for _ in range(2):
        result = client.chat.completions.create(model=BASE, messages=_chat(SYSTEM, "same"), max_tokens=3)
        assert result.usage.prompt_tokens == count_tokens(SYSTEM + "same")
        assert result.usage.prompt_tokens_details is None  # no prefix cache, no details field
    raw = httpx.post(f"{sim.url}/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2}, timeout=5)
    assert set(raw.json()["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    metrics = sim.metrics()
    assert "vllm:cache_config_info" not in metrics["types"]
    assert "vllm:lora_requests_info" not in metrics["types"]  # no adapter, as before
    assert _value(metrics, "vllm:prefix_cache_hits_total", model_name=BASE) == 0
    assert _value(metrics, "vllm:generation_tokens_total", model_name=BASE) == 8
    state = sim.state()
    assert state["latency_model"] == "simple" and state["engines"][BASE]["cached_block_hashes"] == []
    assert state["speed"] == 1.0 and state["time_scale"] == 1.0
