"""OpenAI-API (vLLM-flavoured) backend simulator for testing the gateway.

This is a *simulator*, not a model: it speaks the OpenAI / vLLM HTTP wire
protocol faithfully (paths, JSON shapes, SSE streaming, error bodies, the
``/metrics`` names vLLM exports) but its answers are deterministic pseudo-text
or schema-valid JSON derived from a hash of the request.  It lets the gateway
be tested end to end without a GPU.

Serving
    A raw ASGI application (no framework) served by hypercorn, so one port
    speaks HTTP/1.1 and cleartext HTTP/2 with prior knowledge (h2c).
    ``python -m backends.simulator_openai --port 8101`` prints one readiness
    line and exits 0 on SIGTERM/SIGINT.  In-process use: :func:`build_app`,
    :class:`SimulatorSettings`, :func:`serve`.

Endpoints
    ``POST /v1/chat/completions``, ``POST /v1/completions``,
    ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health``,
    ``GET|POST /ping``, ``GET /version``, ``GET /metrics``.
    ``GET /simulator/requests`` (a simulator-only test hook, like the
    ``x-simulator-fault`` header; vLLM has no such endpoint): the last
    ``RECEIVED_KEPT`` requests received, oldest first, as ``{"requests": [...]}``,
    each with ``method``, ``path`` and ``body_bytes``, and, once a generation or
    embedding request reached its engine, the ``model`` and the ``priority`` the
    engine queued it with.  Lets a test see what a gateway forwarded (requests
    with an ``x-adapter-probe`` header, the gateway's own protocol-negotiation
    probes, extproc/negotiate.py, are not recorded).
    ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?}``
    and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: vLLM's runtime LoRA
    API (vLLM serves it with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; here it
    is always on).  Success is 200 with vLLM's plain-text body ("Success: LoRA
    adapter 'x' added successfully." / "... removed successfully."); errors as
    vLLM: 400 ``InvalidUserInput`` for a missing name or path and for an adapter
    already loaded (unless ``load_inplace``), 404 ``NotFoundError`` "The lora
    adapter 'x' cannot be found." on unload.  A load takes ``--lora-load-ms``
    (times ``--time-scale``); until it completes the adapter is not served.
    A request naming an adapter that is not loaded gets vLLM's 404 for an
    unknown model (no LoRA resolver is simulated).  ``/v1/models`` lists the
    loaded adapters with ``parent`` = their base model and ``root`` = their path.
    ``GET /simulator/state`` and ``POST /simulator/cached_prefix`` (simulator-only
    introspection for an oracle router; vLLM has neither): the state is
    ``{"latency_model", "block_size", "speed", "time_scale", "max_num_seqs",
    "num_running", "num_waiting", "engines": {model: {"num_running",
    "num_waiting", "waiting_prompt_tokens", "kv_cache_usage", "num_blocks",
    "free_blocks", "reserved_blocks", "cached_blocks", "cached_block_hashes",
    ...}}, "loras": {"loaded", "loading", "max_loras", "running", "waiting"}}``
    (``?hashes=0`` leaves the hash lists out; the hashes are those of
    :func:`backends.simulator_engine.block_hashes`, so an oracle can also hash
    prompts itself).  ``cached_prefix`` takes ``{"model"?, "messages" | "prompt"}``
    and answers ``{"prompt_tokens", "prompt_blocks", "cached_blocks",
    "cached_tokens", ...}``: the leading blocks of that prompt cached right now,
    and the cached tokens a request sent now would report.

Content
    * Free text: words from a fixed vocabulary, one word per token; exactly
      ``max_tokens`` (``max_completion_tokens`` for chat) tokens, 16 when not
      given.  ``finish_reason`` is ``"length"`` when the client set a limit
      (the text was cut there) and ``"stop"`` otherwise.
    * ``response_format`` ``json_schema``: a JSON document valid against the
      schema (:mod:`backends.simulator_schema`); ``json_object``: a JSON
      object.  Structured content is never truncated by ``max_tokens`` and
      always ends with ``"stop"``; it streams as 4-character token chunks.
    * Deterministic: values come from a hash of (model, messages/prompt,
      response_format, request ``seed``, simulator ``--seed``, choice index).
    * Token counting approximation: a prompt has ``ceil(utf8_bytes / 4)``
      tokens, where the bytes are the concatenated message contents (text
      parts only) or the prompt string; a list of token ids counts its length.
      Structured completions count ``ceil(len(json_text) / 4)`` tokens.

Engine model
    Each base model is an independent simulated engine (its LoRA adapters share
    it), with ``max_num_seqs`` running slots and a KV cache of
    ``kv_cache_tokens``.  A request waits, ordered by ``(priority, arrival)``
    (lower priority value first, as in vLLM), until a slot is free and the KV
    cache can *reserve* its whole footprint (prompt plus all planned completion
    tokens, so no preemption is ever needed).  The KV usage gauge reports what
    running sequences actually *hold*: prompt tokens once prefilled plus the
    tokens generated so far.  Prefill takes ``prompt_tokens /
    prefill_tokens_per_s``; every further token ``1 / decode_tokens_per_s``
    (sequences decode in parallel; a speed of 0 means instant).  TTFT is queue
    time plus prefill.  A request with ``n`` choices is one sequence group: one
    slot, one KV reservation.  A client disconnect (HTTP/1.1 connection close
    or HTTP/2 RST_STREAM) cancels the request and frees its slot.  ``--speed``
    divides and ``--time-scale`` multiplies these durations (both 1 by default).

Engine model with ``--latency-model vllm`` (for fleet benchmarks)
    A continuous-batching engine per base model (:mod:`backends.simulator_engine`,
    whose docstring has the formula and the vLLM figures it is calibrated from):
    one asyncio task steps every running sequence together; a step lasts
    ``(step_base + step_per_seq * seqs + prefill_per_token * uncached_prefill_tokens)
    * time_scale / speed``, with chunked prefill under a per-step token budget,
    so TTFT and inter-token latency emerge from load.  The KV cache holds
    ``--kv-capacity // --block-size`` blocks with vLLM-style prefix caching
    (chained block hashes, LRU reuse of freed blocks): a prompt's cached leading
    blocks skip prefill and are reported as ``usage.prompt_tokens_details.
    cached_tokens`` (as vLLM with ``--enable-prompt-tokens-details``; the simple
    model leaves the field out).  Requests queue FCFS (by ``(priority,
    arrival)``) for a slot and KV blocks for their whole footprint;
    ``--max-loras N`` allows at most N distinct adapters in the running batch
    (a request for another waits, requests behind it may run).  Prompt tokens
    are counted as above.  Flags: ``--speed``, ``--time-scale``,
    ``--kv-capacity`` (alias of ``--kv-cache-tokens``), ``--block-size``,
    ``--max-num-batched-tokens``, ``--step-base-ms``, ``--step-per-seq-ms``,
    ``--prefill-us-per-token``, ``--no-enable-prefix-caching``; LoRA (either
    model): ``--lora-modules name=path ...`` (or vLLM's JSON form with
    ``base_model_name``; the default base is the first model), ``--max-loras``,
    ``--lora-load-ms``, ``--enable-lora``.  ``--prefill-tokens-per-s`` and
    ``--decode-tokens-per-s`` belong to the simple model only.

Metrics
    vLLM's names, one label set per engine (``model_name`` = the base model;
    LoRA traffic counts under its base, as in vLLM).  ``vllm:request_success_total``
    counts cancelled requests with ``finished_reason="abort"``.  Also
    ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (in
    tokens; zero without a prefix cache) and their older ``vllm:gpu_prefix_cache_*``
    names, ``vllm:num_preemptions_total`` (always 0), the inter-token histogram
    as ``vllm:inter_token_latency_seconds`` and the older
    ``vllm:time_per_output_token_seconds`` (one observation per token after the
    first), and with ``--latency-model vllm`` ``vllm:cache_config_info{block_size,
    enable_prefix_caching, num_gpu_blocks}``.  With LoRA enabled (``--lora``,
    ``--lora-modules``, ``--max-loras``, ``--enable-lora`` or a runtime load) the
    ``vllm:lora_requests_info{max_lora, running_lora_adapters,
    waiting_lora_adapters}`` gauge is exported too (one series, the current one;
    ``max_lora`` is ``--max-loras``, else the number of adapters given at start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import base64
import bisect
import collections
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import logging
import math
import random
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .asgi_body import BodyTooLarge, Disconnected, read_body
from .simulator_engine import BatchEngine, LatencyParams, block_hashes
from .simulator_schema import instance_for

__all__ = ["SimulatorApp", "SimulatorSettings", "build_app", "count_tokens", "main", "serve"]

log = logging.getLogger("backends.simulator")

VERSION = "simulator-0.1"
DEFAULT_MAX_TOKENS = 16
EMBEDDING_DIM = 16
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_N = 128
RECEIVED_KEPT = 256  # requests kept for GET /simulator/requests
SHUTDOWN_GRACE_S = 0.5  # in-flight requests get this long to finish on shutdown, then are aborted

_VOCAB = (
    "the", "market", "simulated", "answer", "returns", "a", "steady", "signal",
    "of", "quarterly", "growth", "while", "risk", "remains", "within", "bounds",
    "and", "the", "portfolio", "holds", "balanced", "assets", "across", "sectors",
    "with", "modest", "volatility", "expected", "yield", "tracks", "the", "index",
)
_JSON_OBJECT_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "simulated": {"const": True},
    },
    "required": ["answer", "confidence", "simulated"],
}

# Bucket boundaries modelled on vLLM's.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_FINISHED_REASONS = ("stop", "length", "abort")
LATENCY_MODELS = ("simple", "vllm")


# --------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SimulatorSettings:
    """Configuration of one simulator process (one simulated vLLM server)."""

    host: str = "127.0.0.1"
    port: int = 8101
    models: tuple[str, ...] = ("qwen2.5-finance", "llama-3-8b")
    loras: tuple[tuple[str, str], ...] = ()  # (adapter name, base model)
    prefill_tokens_per_s: float = 0.0  # 0 = instant
    decode_tokens_per_s: float = 0.0  # 0 = instant
    max_num_seqs: int = 256
    kv_cache_tokens: int = 65536
    max_model_len: int = 32768  # reported and enforced as min(this, kv_cache_tokens)
    seed: int = 0
    log_level: str = "warning"
    # -- fleet simulation (defaults keep the simple model above) --
    latency_model: str = "simple"  # "simple" or "vllm" (backends/simulator_engine.py)
    speed: float = 1.0  # a GPU this many times as fast (0.5: an older node)
    time_scale: float = 1.0  # every simulated duration is multiplied by this
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    step_base_ms: float = 6.2
    step_per_seq_ms: float = 0.3
    prefill_us_per_token: float = 33.0
    enable_prefix_caching: bool = True
    lora_modules: tuple[tuple[str, str, str], ...] = ()  # (adapter name, path, base model)
    max_loras: int | None = None  # None: no limit in the batch; max_lora reports the static adapters
    lora_load_ms: float = 0.0  # simulated time of POST /v1/load_lora_adapter
    enable_lora: bool = False  # export vllm:lora_requests_info even with no adapter yet
    # vLLM's --scheduling-policy: "priority" queues by (priority, arrival); "fcfs" (vLLM's own default)
    # refuses a request with a non-zero `priority` with 400, as vLLM does. The simulator defaults to
    # "priority" (the behaviour its tests and benches were written against); pass fcfs to mirror a
    # vLLM started without the flag.
    scheduling_policy: str = "priority"

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "loras", tuple((str(n), str(b)) for n, b in self.loras))
        modules = []
        for module in self.lora_modules:
            name, path, *base = module
            modules.append((str(name), str(path), str(base[0]) if base and base[0] else ""))
        if not self.models or any(not m for m in self.models):
            raise ValueError("the simulator needs at least one non-empty model name")
        modules = [(n, p, b or self.models[0]) for n, p, b in modules]
        object.__setattr__(self, "lora_modules", tuple(modules))
        names = list(self.models) + [name for name, _ in self.loras] + [name for name, _, _ in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model or LoRA names: {names}")
        for name, base in self.loras + tuple((n, b) for n, _, b in modules):
            if base not in self.models:
                raise ValueError(f"LoRA {name!r} names unknown base model {base!r}")
        if self.prefill_tokens_per_s < 0 or self.decode_tokens_per_s < 0:
            raise ValueError("token speeds must be >= 0 (0 means instant)")
        if self.max_num_seqs < 1 or self.kv_cache_tokens < 1 or self.max_model_len < 1:
            raise ValueError("max_num_seqs, kv_cache_tokens and max_model_len must be >= 1")
        if self.latency_model not in LATENCY_MODELS:
            raise ValueError(f"latency_model must be one of {LATENCY_MODELS}, not {self.latency_model!r}")
        if self.speed <= 0 or self.time_scale <= 0:
            raise ValueError("speed and time_scale must be > 0")
        if self.block_size < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size and max_num_batched_tokens must be >= 1")
        if self.latency_model == "vllm" and self.kv_cache_tokens < self.block_size:
            raise ValueError("the KV cache must hold at least one block of block_size tokens")
        if min(self.step_base_ms, self.step_per_seq_ms, self.prefill_us_per_token, self.lora_load_ms) < 0:
            raise ValueError("step, prefill and LoRA load costs must be >= 0")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")

    @property
    def effective_max_model_len(self) -> int:
        return min(self.max_model_len, self.kv_cache_tokens)

    def latency_params(self) -> LatencyParams:
        return LatencyParams(
            step_base_s=self.step_base_ms / 1e3, step_per_seq_s=self.step_per_seq_ms / 1e3,
            prefill_s_per_token=self.prefill_us_per_token / 1e6,
            max_num_batched_tokens=self.max_num_batched_tokens, speed=self.speed, time_scale=self.time_scale)


def count_tokens(text: str) -> int:
    """The simulator's token approximation: ceil(utf-8 bytes / 4)."""
    return math.ceil(len(text.encode("utf-8")) / 4)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class _HTTPError(Exception):
    """An error answered as vLLM does: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.headers = list(headers)

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def _bad_request(message: str, param: str | None = None) -> _HTTPError:
    return _HTTPError(400, message, "BadRequestError", param)


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


class _HistogramState:
    """Cumulative-bucket histogram state, exposed by :class:`_EngineCollector`."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        running = list(itertools.accumulate(self.counts))
        return [(floatToGoString(b), c) for b, c in zip(self.bounds, running)] + [("+Inf", running[-1])]


@dataclasses.dataclass
class _EngineStats:
    """Counters and histograms of one engine (vLLM's per-``model_name`` series)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found cached
    finished: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_FINISHED_REASONS, 0))
    ttft: _HistogramState = dataclasses.field(default_factory=lambda: _HistogramState(_TTFT_BUCKETS))
    itl: _HistogramState = dataclasses.field(default_factory=lambda: _HistogramState(_TPOT_BUCKETS))
    e2e: _HistogramState = dataclasses.field(default_factory=lambda: _HistogramState(_LATENCY_BUCKETS))
    queue_time: _HistogramState = dataclasses.field(default_factory=lambda: _HistogramState(_LATENCY_BUCKETS))


class _EngineCollector(Collector):
    """Exposes the engines' state with vLLM's metric names, read at scrape time.

    A hand-written collector rather than prometheus_client's Counter/Histogram
    so the exposition carries exactly vLLM's series (no ``*_created``).
    """

    def __init__(self, engines: dict[str, Any], loras: "_LoraRegistry", settings: SimulatorSettings) -> None:
        self._engines = engines
        self._loras = loras
        self._settings = settings

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc + " (simulator)", labels=["model_name"])

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc + " (simulator)", labels=["model_name", *extra])

        def histogram(name: str, doc: str) -> HistogramMetricFamily:
            return HistogramMetricFamily(name, doc + " (simulator)", labels=["model_name"])

        running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        gpu_usage = gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.")
        # CounterMetricFamily("x") is exposed as "x_total", which is vLLM's naming.
        prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = counter("vllm:request_success", "Count of successfully processed requests.",
                          ("finished_reason",))
        queries = counter("vllm:prefix_cache_queries",
                          "Prefix cache queries, in terms of number of queried tokens.")
        hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        gpu_queries = counter("vllm:gpu_prefix_cache_queries",
                              "GPU prefix cache queries, in terms of number of queried tokens.")
        gpu_hits = counter("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached tokens.")
        preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.")
        tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.")
        itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.")
        e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.")
        queue = histogram("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.")
        for model, engine in self._engines.items():
            stats = engine.stats
            running.add_metric([model], engine.num_running)
            waiting.add_metric([model], engine.num_waiting)
            kv_usage.add_metric([model], engine.kv_usage)
            gpu_usage.add_metric([model], engine.kv_usage)
            prompt.add_metric([model], stats.prompt_tokens)
            generation.add_metric([model], stats.generation_tokens)
            for reason, count in stats.finished.items():
                success.add_metric([model, reason], count)
            for family, value in ((queries, stats.prefix_cache_queries), (gpu_queries, stats.prefix_cache_queries),
                                  (hits, stats.prefix_cache_hits), (gpu_hits, stats.prefix_cache_hits),
                                  (preemptions, 0)):
                family.add_metric([model], value)
            for family, state in ((ttft, stats.ttft), (tpot, stats.itl), (itl, stats.itl), (e2e, stats.e2e),
                                  (queue, stats.queue_time)):
                family.add_metric([model], state.cumulative_buckets(), state.total)
        yield from (running, waiting, kv_usage, gpu_usage, prompt, generation, success, queries, hits,
                    gpu_queries, gpu_hits, preemptions, ttft, tpot, itl, e2e, queue)

        settings = self._settings
        if settings.latency_model == "vllm":  # as vLLM: the cache configuration as an info gauge
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig (simulator)",
                                     labels=["block_size", "enable_prefix_caching", "num_gpu_blocks"])
            blocks = settings.kv_cache_tokens // settings.block_size
            info.add_metric([str(settings.block_size), str(settings.enable_prefix_caching), str(blocks)], 1)
            yield info

        if self._loras.exported:  # as vLLM with LoRA enabled: which adapters are busy (value: a timestamp)
            info = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests (simulator)",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            running_names = {n for e in self._engines.values() for n in e.active_loras(running=True)}
            waiting_names = {n for e in self._engines.values() for n in e.active_loras(running=False)}
            info.add_metric([str(self._loras.max_lora), ",".join(sorted(waiting_names)),
                             ",".join(sorted(running_names))], time.time())
            yield info


# --------------------------------------------------------------------------
# Engine: scheduling, KV cache, pacing
# --------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Job:
    served_model: str  # what the client asked for (base model or LoRA)
    prompt_tokens: int
    completion_tokens: int  # planned, over all choices
    priority: int
    arrival: float
    order: int
    admitted: asyncio.Future
    held_tokens: int = 0
    cached_tokens: int = 0  # the simple model has no prefix cache

    @property
    def footprint(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _Run:
    """Handle on an admitted, prefilled request: paces and accounts decode steps."""

    def __init__(self, engine: _Engine, job: _Job) -> None:
        self._engine = engine
        self._job = job
        self._steps = 0
        self._decode_start = 0.0
        self._last_step = 0.0
        self.finish_reason = "stop"

    @property
    def cached_tokens(self) -> int:
        return 0

    def start_decode(self) -> None:
        self._decode_start = asyncio.get_running_loop().time()

    async def step(self, tokens: int) -> None:
        """Produce one decode step of ``tokens`` tokens (one per live choice).

        The first step is the token produced by prefill (no extra delay); each
        later step is due ``1 / decode_tokens_per_s`` after the previous one
        (times ``time_scale / speed``).
        """
        settings = self._engine.settings
        speed = settings.decode_tokens_per_s
        loop = asyncio.get_running_loop()
        if self._steps and speed > 0:
            due = self._steps / speed * settings.time_scale / settings.speed
            await asyncio.sleep(max(self._decode_start + due - loop.time(), 0.0))
        else:
            await asyncio.sleep(0)  # stay fair to other requests at infinite speed
        stats = self._engine.stats
        now = loop.time()
        if self._steps == 0:
            stats.ttft.observe(now - self._job.arrival)
        else:
            stats.itl.observe(now - self._last_step)
        self._last_step = now
        self._steps += 1
        self._job.held_tokens += tokens
        stats.generation_tokens += tokens


class _Engine:
    """One simulated vLLM engine: a base model plus its LoRA adapters."""

    def __init__(self, model: str, settings: SimulatorSettings) -> None:
        self.model = model
        self.settings = settings
        self.stats = _EngineStats()
        self._waiting: list[tuple[int, int, _Job]] = []  # heap on (priority, arrival order)
        self._running: set[_Job] = set()
        self._reserved_tokens = 0
        self._order = itertools.count()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        held = sum(job.held_tokens for job in self._running)
        return min(held / self.settings.kv_cache_tokens, 1.0)

    def active_loras(self, *, running: bool) -> list[str]:
        jobs = self._running if running else (job for _, _, job in self._waiting)
        return [job.served_model for job in jobs if job.served_model != self.model]

    def capacity_ok(self, footprint_tokens: int) -> bool:
        return footprint_tokens <= self.settings.kv_cache_tokens

    def cached_prefix(self, hashes: Any, prompt_tokens: int) -> tuple[int, int]:
        return 0, 0  # no prefix cache in the simple model

    def state(self, *, with_hashes: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {
            "num_running": self.num_running, "num_waiting": self.num_waiting,
            "waiting_prompt_tokens": sum(job.prompt_tokens for _, _, job in self._waiting),
            "kv_cache_usage": self.kv_usage, "kv_cache_tokens": self.settings.kv_cache_tokens,
            "reserved_tokens": self._reserved_tokens, "cached_blocks": 0,
        }
        if with_hashes:
            state["cached_block_hashes"] = []
        return state

    def close(self) -> None:
        pass

    def new_job(self, served_model: str, prompt_tokens: int, completion_tokens: int, priority: int,
                **_unused: Any) -> _Job:
        """A request of ``prompt_tokens`` and ``completion_tokens`` (the batch engine's prefix and
        LoRA keywords mean nothing here)."""
        loop = asyncio.get_running_loop()
        return _Job(served_model, prompt_tokens, completion_tokens, priority, loop.time(),
                    next(self._order), loop.create_future())

    @contextlib.asynccontextmanager
    async def run(self, job: _Job) -> AsyncIterator[_Run]:
        """Queue ``job``, wait for a slot and KV space, prefill, then yield a :class:`_Run`.

        Leaving the block (normally, by error or by cancellation) frees the
        slot and the KV cache; a request that did not finish normally is
        counted with ``finished_reason="abort"``.
        """
        await self._wait_for_admission(job)
        loop = asyncio.get_running_loop()
        stats = self.stats
        run = _Run(self, job)
        try:
            stats.queue_time.observe(loop.time() - job.arrival)
            speed = self.settings.prefill_tokens_per_s
            if speed > 0 and job.prompt_tokens:
                await asyncio.sleep(job.prompt_tokens / speed * self.settings.time_scale / self.settings.speed)
            job.held_tokens = job.prompt_tokens
            stats.prompt_tokens += job.prompt_tokens
            run.start_decode()
            yield run
        except BaseException:
            stats.finished["abort"] += 1
            raise
        else:
            stats.finished[run.finish_reason] += 1
            stats.e2e.observe(loop.time() - job.arrival)
        finally:
            self._release(job)

    async def _wait_for_admission(self, job: _Job) -> None:
        heapq.heappush(self._waiting, (job.priority, job.order, job))
        self._schedule()
        try:
            await job.admitted
        except asyncio.CancelledError:
            if job.admitted.done() and not job.admitted.cancelled():
                self._release(job)  # admitted just as the client went away
            else:
                self._remove_waiting(job)
            raise

    def _remove_waiting(self, job: _Job) -> None:
        kept = [entry for entry in self._waiting if entry[2] is not job]
        if len(kept) != len(self._waiting):
            self._waiting = kept
            heapq.heapify(self._waiting)
            self._schedule()  # the head may have been what blocked the queue

    def _release(self, job: _Job) -> None:
        if job in self._running:
            self._running.discard(job)
            self._reserved_tokens -= job.footprint
            job.held_tokens = 0
            self._schedule()

    def _schedule(self) -> None:
        """Admit waiting jobs in (priority, arrival) order while they fit.

        Strict order: if the head does not fit, nothing behind it is admitted
        (as vLLM's scheduler does), so a large request is not starved.
        """
        while self._waiting:
            _, _, job = self._waiting[0]
            if job.admitted.done():  # cancelled while waiting, not yet removed
                heapq.heappop(self._waiting)
                continue
            if len(self._running) >= self.settings.max_num_seqs:
                return
            if self._reserved_tokens + job.footprint > self.settings.kv_cache_tokens:
                return
            heapq.heappop(self._waiting)
            self._running.add(job)
            self._reserved_tokens += job.footprint
            job.admitted.set_result(None)


# --------------------------------------------------------------------------
# Content generation
# --------------------------------------------------------------------------


def _digest(*parts: Any) -> int:
    blob = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "big")


@dataclasses.dataclass
class _Choice:
    index: int
    pieces: list[str]  # one entry per generated token
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _free_text_pieces(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    pieces = []
    for i in range(count):
        word = _VOCAB[rng.randrange(len(_VOCAB))]
        pieces.append(word.capitalize() if i == 0 else " " + word)
    return pieces


def _structured_kind(response_format: Any) -> str | None:
    """``"json_object"`` / ``"json_schema"``, or None for free text (validates the field)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise _bad_request("`response_format` must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind in ("json_object", "json_schema"):
        return kind
    raise _bad_request(
        f"`response_format.type` must be one of 'text', 'json_object', 'json_schema', not {kind!r}",
        "response_format")


def _structured_text(response_format: Any, seed: int) -> str | None:
    """The JSON text for a structured ``response_format``, or None for free text."""
    kind = _structured_kind(response_format)
    if kind is None:
        return None
    if kind == "json_object":
        value = instance_for(_JSON_OBJECT_SCHEMA, seed)
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad_request("`response_format.json_schema` must be an object", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise _bad_request("`response_format.json_schema.schema` must be a JSON schema", "response_format")
        try:
            value = instance_for(schema, seed)
        except (ValueError, TypeError, RecursionError) as exc:
            raise _bad_request(f"The simulator cannot satisfy the JSON schema: {exc}", "response_format") from exc
    return orjson.dumps(value).decode()


# --------------------------------------------------------------------------
# Request parsing helpers
# --------------------------------------------------------------------------


def _parse_json_object(body: bytes) -> dict:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad_request(
            f"Invalid JSON body: {exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})"
        ) from exc
    if not isinstance(value, dict):
        raise _bad_request(f"The request body must be a JSON object, not {type(value).__name__}")
    return value


def _int_field(body: dict, name: str, *, default: int | None, minimum: int | None = None,
               maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_request(f"`{name}` must be an integer", name)
    if minimum is not None and value < minimum:
        raise _bad_request(f"`{name}` must be at least {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise _bad_request(f"`{name}` must be at most {maximum}, got {value}", name)
    return value


def _message_text(message: Any, index: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _bad_request(f"`messages[{index}]` must be an object with a string `role`", "messages")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") == "text"
                       and isinstance(part.get("text"), str))
    raise _bad_request(f"`messages[{index}].content` must be a string, a list of parts or null", "messages")


@dataclasses.dataclass(frozen=True)
class _Options:
    n: int
    max_tokens: int | None  # explicit client limit, None when not given
    stream: bool
    include_usage: bool
    priority: int
    seed: int | None
    response_format: Any


def _common_options(body: dict, *, chat: bool) -> _Options:
    n = _int_field(body, "n", default=1, minimum=1, maximum=MAX_N)
    max_tokens = _int_field(body, "max_tokens", default=None, minimum=1)
    if chat:
        max_tokens = _int_field(body, "max_completion_tokens", default=None, minimum=1) or max_tokens
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or temperature < 0):
        raise _bad_request("`temperature` must be a non-negative number", "temperature")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad_request("`stream` must be a boolean", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise _bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(stream_options, dict):
            raise _bad_request("`stream_options` must be an object", "stream_options")
    include_usage = bool((stream_options or {}).get("include_usage", False))
    return _Options(
        n=n, max_tokens=max_tokens, stream=stream, include_usage=include_usage,
        priority=_int_field(body, "priority", default=0),
        seed=_int_field(body, "seed", default=None),
        response_format=body.get("response_format"),
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# --------------------------------------------------------------------------
# ASGI plumbing
# --------------------------------------------------------------------------


async def _read_body(receive: Callable, limit: int) -> bytes:
    try:
        return await read_body(receive, limit)
    except BodyTooLarge:
        raise _HTTPError(413, f"Request body larger than {limit} bytes", "RequestEntityTooLarge") from None


async def _wait_for_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_response(send: Callable, status: int, body: bytes, content_type: bytes | None,
                         headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    all_headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        all_headers.append((b"content-type", content_type))
    all_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Callable, payload: Any, status: int = 200,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await _send_response(send, status, orjson.dumps(payload), b"application/json", headers)


_FAULT: contextvars.ContextVar["_Fault | None"] = contextvars.ContextVar("simulator_fault", default=None)
# this request's entry in SimulatorApp.received (GET /simulator/requests)
_RECEIVED: contextvars.ContextVar["dict | None"] = contextvars.ContextVar("simulator_received", default=None)


def _note_job(model: str, job: "_Job") -> None:
    """Record what the engine queued this request with (GET /simulator/requests)."""
    entry = _RECEIVED.get()
    if entry is not None:
        entry.update(model=model, priority=job.priority)


@dataclasses.dataclass(frozen=True)
class _Fault:
    """Per-request fault injection, from the `x-simulator-fault` request header (a simulator-only
    test hook; real vLLM has no such header):
    `status=500` answers that status before generating; `truncate-after=N` ends the stream cleanly
    after N content chunks without `data: [DONE]` (a server that gave up); `reset-after=N` aborts
    the connection after N content chunks (a crash)."""

    status: int | None = None
    truncate_after: int | None = None
    reset_after: int | None = None

    @classmethod
    def parse(cls, value: str) -> "_Fault":
        fields: dict[str, int] = {}
        for part in value.split(","):
            key, _, number = part.strip().partition("=")
            name = {"status": "status", "truncate-after": "truncate_after", "reset-after": "reset_after"}.get(key)
            if name is None or not number.isdigit():
                raise _bad_request(f"x-simulator-fault: cannot parse {part.strip()!r} "
                                   "(status=N, truncate-after=N or reset-after=N)")
            fields[name] = int(number)
        return cls(**fields)


class _SimulatedReset(Exception):
    """Raised to make the server abort the connection mid-response."""


class _EventStream:
    """Server-sent events, each sent to the transport as soon as it is produced."""

    def __init__(self, send: Callable) -> None:
        self._send = send

    async def start(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]})

    async def event(self, payload: dict) -> None:
        await self._send({"type": "http.response.body", "body": b"data: " + orjson.dumps(payload) + b"\n\n",
                          "more_body": True})

    async def done(self) -> None:
        await self._send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


_QUERY: contextvars.ContextVar[str] = contextvars.ContextVar("simulator_query", default="")


class _LoraRegistry:
    """LoRA bookkeeping beside ``SimulatorApp._served``: adapter paths, loads in progress, the
    ``vllm:lora_requests_info`` labels."""

    def __init__(self, settings: SimulatorSettings) -> None:
        self.paths: dict[str, str] = {name: path for name, path, _ in settings.lora_modules}
        self.loading: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._static = len(settings.loras) + len(settings.lora_modules)
        self._enabled = bool(self._static) or settings.enable_lora or settings.max_loras is not None
        self.max_loras = settings.max_loras
        self.ever_loaded = False

    @property
    def exported(self) -> bool:
        return self._enabled or self.ever_loaded

    @property
    def max_lora(self) -> int:
        """The ``max_lora`` label: ``--max-loras``, else the number of adapters given at start."""
        return self.max_loras if self.max_loras is not None else self._static

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())


# --------------------------------------------------------------------------
# The application
# --------------------------------------------------------------------------


class SimulatorApp:
    """The ASGI application of the OpenAI API simulator."""

    def __init__(self, settings: SimulatorSettings) -> None:
        self.settings = settings
        self.created = int(time.time())
        self._served: dict[str, str] = {m: m for m in settings.models}  # served name -> base model
        self._served.update({name: base for name, base in settings.loras})
        self._served.update({name: base for name, _, base in settings.lora_modules})
        self.loras = _LoraRegistry(settings)
        self.engines: dict[str, _Engine | BatchEngine] = {m: self._new_engine(m) for m in settings.models}
        self.registry = CollectorRegistry(auto_describe=False)  # per app: no global state
        self.registry.register(_EngineCollector(self.engines, self.loras, settings))
        self._in_flight: set[asyncio.Task] = set()
        self.received: collections.deque[dict] = collections.deque(maxlen=RECEIVED_KEPT)
        self._routes: dict[str, dict[str, Callable]] = {
            "/v1/chat/completions": {"POST": self._chat_completions},
            "/v1/completions": {"POST": self._completions},
            "/v1/embeddings": {"POST": self._embeddings},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/ping": {"GET": self._health, "POST": self._health},
            "/version": {"GET": self._version},
            "/metrics": {"GET": self._metrics},
            "/simulator/requests": {"GET": self._received},
            "/v1/load_lora_adapter": {"POST": self._load_lora_adapter},
            "/v1/unload_lora_adapter": {"POST": self._unload_lora_adapter},
            "/simulator/state": {"GET": self._state},
            "/simulator/cached_prefix": {"POST": self._cached_prefix},
        }

    def _new_engine(self, model: str) -> _Engine | BatchEngine:
        settings = self.settings
        if settings.latency_model == "simple":
            return _Engine(model, settings)
        return BatchEngine(model, kv_cache_tokens=settings.kv_cache_tokens, block_size=settings.block_size,
                           max_num_seqs=settings.max_num_seqs, max_loras=settings.max_loras,
                           params=settings.latency_params(), prefix_caching=settings.enable_prefix_caching,
                           stats=_EngineStats())

    async def aclose(self) -> None:
        """Stop the engines' step loops (the batch engine runs one task per base model)."""
        for engine in self.engines.values():
            engine.close()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # no websockets: hypercorn closes the connection
        try:
            body = await _read_body(receive, MAX_BODY_BYTES)
        except Disconnected:
            return
        except _HTTPError as exc:
            await _send_json(send, exc.payload(), exc.status, exc.headers)
            return

        # Serve the request while watching for the client going away: a
        # disconnect cancels the handler, which frees its engine slot.
        handler = asyncio.ensure_future(self._dispatch(scope, body, send))
        self._in_flight.add(handler)
        handler.add_done_callback(self._in_flight.discard)
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done():
                log.info("simulator: client disconnected from %s %s; request cancelled",
                         scope["method"], scope["path"])
        finally:
            for task in (handler, watcher):
                task.cancel()
            await asyncio.gather(handler, watcher, return_exceptions=True)

    async def abort_in_flight(self) -> None:
        """Cancel every request being served (their slots are freed, streams cut)."""
        tasks = list(self._in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                log.info("simulator: serving models %s", ", ".join(self._served))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: dict, body: bytes, send: Callable) -> None:
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        probe = any(k == b"x-adapter-probe" for k, _ in scope.get("headers", ()))  # the gateway's own probes
        if not scope["path"].startswith("/simulator/") and not probe:
            entry = {"method": scope["method"], "path": scope["path"], "body_bytes": len(body)}
            self.received.append(entry)
            _RECEIVED.set(entry)
        _QUERY.set(scope.get("query_string", b"").decode("latin-1"))
        try:
            for key, value in scope.get("headers", ()):
                if key == b"x-simulator-fault":
                    _FAULT.set(_Fault.parse(value.decode("latin-1")))
            methods = self._routes.get(scope["path"])
            if methods is None:
                raise _HTTPError(404, f"Not Found: {scope['path']}", "NotFoundError")
            handler = methods.get(scope["method"])
            if handler is None:
                allow = ", ".join(sorted(methods)).encode()
                raise _HTTPError(405, f"Method {scope['method']} not allowed on {scope['path']}",
                                 "MethodNotAllowedError", headers=[(b"allow", allow)])
            await handler(body, tracking_send)
        except _HTTPError as exc:
            if not started:
                await _send_json(send, exc.payload(), exc.status, exc.headers)
        except (asyncio.CancelledError, _SimulatedReset):
            raise
        except Exception as exc:  # a simulator bug: answer 500 rather than drop the connection
            log.exception("simulator: internal error on %s %s", scope["method"], scope["path"])
            if not started:
                error = _HTTPError(500, f"Internal simulator error: {exc!r}", "InternalServerError")
                await _send_json(send, error.payload(), 500)

    # -- model lookup -------------------------------------------------------

    def _engine_for(self, body: dict) -> tuple[str, _Engine | BatchEngine]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _bad_request("`model` is required and must be a string", "model")
        base = self._served.get(model)
        if base is None:
            raise _HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model, self.engines[base]

    def _check_lengths(self, prompts: list[tuple[Any, int]], options: _Options) -> None:
        """Reject, before generating anything, what vLLM would reject as too long."""
        max_len = self.settings.effective_max_model_len
        requested = options.max_tokens or DEFAULT_MAX_TOKENS
        for _, prompt_tokens in prompts:
            if prompt_tokens + requested > max_len:
                raise _bad_request(
                    f"This model's maximum context length is {max_len} tokens. However, you requested "
                    f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested} in "
                    f"the completion). Please reduce the length of the messages or completion.")
        if _structured_kind(options.response_format) is None:  # free text: the length is known now
            self._check_footprint(sum(t for _, t in prompts) + len(prompts) * options.n * requested)

    def _check_footprint(self, footprint: int) -> None:
        settings = self.settings
        blocks = math.ceil(footprint / settings.block_size)
        if footprint > settings.kv_cache_tokens or (
                settings.latency_model == "vllm" and blocks > settings.kv_cache_tokens // settings.block_size):
            raise _bad_request(
                f"The request needs {footprint} KV-cache tokens but the simulated cache holds only "
                f"{self.settings.kv_cache_tokens}.")

    def _plan(self, model: str, prompts: list[tuple[Any, int]], options: _Options) -> list[_Choice]:
        """Decide every choice's tokens up front (deterministically)."""
        choices: list[_Choice] = []
        for prompt, _ in prompts:
            for variant in range(options.n):
                seed = _digest(model, prompt, options.response_format, options.seed, self.settings.seed, variant)
                structured = _structured_text(options.response_format, seed)
                if structured is not None:
                    pieces = [structured[i:i + 4] for i in range(0, len(structured), 4)]
                    finish = "stop"
                else:
                    pieces = _free_text_pieces(seed, options.max_tokens or DEFAULT_MAX_TOKENS)
                    finish = "length" if options.max_tokens is not None else "stop"
                choices.append(_Choice(len(choices), pieces, finish))
        return choices

    # -- generation endpoints ------------------------------------------------

    async def _chat_completions(self, body: bytes, send: Callable) -> None:
        request = _parse_json_object(body)
        model, engine = self._engine_for(request)
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad_request("`messages` must be a non-empty list", "messages")
        prompt_tokens = count_tokens("".join(_message_text(m, i) for i, m in enumerate(messages)))
        options = _common_options(request, chat=True)
        self._check_priority(options.priority)
        await self._generate(engine, model, [(messages, prompt_tokens)], options, chat=True, send=send)

    async def _completions(self, body: bytes, send: Callable) -> None:
        request = _parse_json_object(body)
        model, engine = self._engine_for(request)
        prompts = _parse_prompts(request.get("prompt"))
        options = _common_options(request, chat=False)
        self._check_priority(options.priority)
        await self._generate(engine, model, prompts, options, chat=False, send=send)

    def _check_priority(self, priority: int) -> int:
        """vLLM accepts a non-zero `priority` only when started with --scheduling-policy priority."""
        if priority != 0 and self.settings.scheduling_policy != "priority":
            raise _bad_request(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
        return priority

    def _lora_of(self, model: str) -> str | None:
        return None if model in self.engines else model

    def _prefix_hashes(self, model: str, prompts: list[tuple[Any, int]], chat: bool) -> list[str]:
        """The prompt's chained block hashes (batch engine with prefix caching only)."""
        settings = self.settings
        if settings.latency_model != "vllm" or not settings.enable_prefix_caching:
            return []
        if chat:
            items: list[Any] = ["".join(_message_text(m, i) for i, m in enumerate(prompts[0][0]))]
        else:
            items = [item for item, _ in prompts]
        return block_hashes(items, settings.block_size, self._lora_of(model))

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        usage = _usage(prompt_tokens, completion_tokens)
        if self.settings.latency_model == "vllm":  # as vLLM with --enable-prompt-tokens-details
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    async def _generate(self, engine: _Engine | BatchEngine, model: str, prompts: list[tuple[Any, int]],
                        options: _Options, *, chat: bool, send: Callable) -> None:
        """Queue, pace and answer a chat or text completion (streamed or not)."""
        self._check_lengths(prompts, options)
        fault = _FAULT.get()
        if fault is not None and fault.status:
            raise _HTTPError(fault.status, "simulated engine failure (x-simulator-fault)", "InternalServerError")
        choices = self._plan(model, prompts, options)
        prompt_tokens = sum(tokens for _, tokens in prompts)
        completion_tokens = sum(len(c.pieces) for c in choices)
        self._check_footprint(prompt_tokens + completion_tokens)
        job = engine.new_job(model, prompt_tokens, completion_tokens, options.priority,
                             lora=self._lora_of(model), hashes=self._prefix_hashes(model, prompts, chat),
                             choice_lengths=[len(c.pieces) for c in choices])
        _note_job(model, job)
        steps = max((len(c.pieces) for c in choices), default=0)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())

        if not options.stream:
            async with engine.run(job) as run:
                for step in range(steps):
                    await run.step(sum(1 for c in choices if step < len(c.pieces)))
                run.finish_reason = _request_finish_reason(choices)
            usage = self._usage(prompt_tokens, completion_tokens, run.cached_tokens)
            await _send_json(send, _full_response(response_id, created, model, choices, usage, chat))
            return

        stream = _EventStream(send)
        await stream.start()
        object_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: _Choice, **fields: Any) -> dict:
            entry: dict = {"index": choice.index}
            if chat:
                entry["delta"] = fields.get("delta", {})
            else:
                entry["text"] = fields.get("text", "")
            entry.update(logprobs=None, finish_reason=fields.get("finish_reason"), stop_reason=None)
            payload = {"id": response_id, "object": object_name, "created": created, "model": model,
                       "choices": [entry]}
            if options.include_usage:
                payload["usage"] = None
            return payload

        async with engine.run(job) as run:
            if chat:
                for choice in choices:
                    await stream.event(chunk(choice, delta={"role": "assistant", "content": ""}))
            for step in range(steps):
                if fault is not None and fault.truncate_after == step:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if fault is not None and fault.reset_after == step:
                    raise _SimulatedReset(f"simulated connection reset after {step} chunks")
                live = [c for c in choices if step < len(c.pieces)]
                await run.step(len(live))
                for choice in live:
                    piece = choice.pieces[step]
                    last = step == len(choice.pieces) - 1
                    finish = choice.finish_reason if last else None
                    if chat:
                        await stream.event(chunk(choice, delta={"content": piece}, finish_reason=finish))
                    else:
                        await stream.event(chunk(choice, text=piece, finish_reason=finish))
            run.finish_reason = _request_finish_reason(choices)
        if options.include_usage:
            usage = self._usage(prompt_tokens, completion_tokens, run.cached_tokens)
            await stream.event({"id": response_id, "object": object_name, "created": created, "model": model,
                                "choices": [], "usage": usage})
        await stream.done()

    async def _embeddings(self, body: bytes, send: Callable) -> None:
        request = _parse_json_object(body)
        model, engine = self._engine_for(request)
        inputs = _parse_prompts(request.get("input"), field="input")
        prompt_tokens = sum(tokens for _, tokens in inputs)
        encoding = request.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _bad_request("`encoding_format` must be 'float' or 'base64'", "encoding_format")
        dims = _int_field(request, "dimensions", default=EMBEDDING_DIM, minimum=1, maximum=EMBEDDING_DIM)
        max_len = self.settings.effective_max_model_len
        for _, tokens in inputs:
            if tokens > max_len:
                raise _bad_request(
                    f"This model's maximum context length is {max_len} tokens. However, you requested "
                    f"{tokens} tokens in the input for embedding generation. Please reduce the length of the input.")
        self._check_footprint(prompt_tokens)
        job = engine.new_job(model, prompt_tokens, 0, self._check_priority(_int_field(request, "priority", default=0)),
                             lora=self._lora_of(model))
        _note_job(model, job)
        async with engine.run(job):
            pass
        data = []
        for index, (item, _) in enumerate(inputs):
            vector = _embedding(_digest("embedding", model, item, self.settings.seed), dims)
            encoded: Any = vector
            if encoding == "base64":
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        await _send_json(send, {
            "id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
        })

    # -- informational endpoints ---------------------------------------------

    async def _models(self, body: bytes, send: Callable) -> None:
        max_len = self.settings.effective_max_model_len
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "simulator",
                 "root": self.loras.paths.get(name, name), "parent": None if base == name else base,
                 "max_model_len": max_len}
                for name, base in self._served.items()]
        await _send_json(send, {"object": "list", "data": data})

    async def _health(self, body: bytes, send: Callable) -> None:
        await _send_response(send, 200, b"", None)

    async def _version(self, body: bytes, send: Callable) -> None:
        await _send_json(send, {"version": VERSION})

    async def _received(self, body: bytes, send: Callable) -> None:
        await _send_json(send, {"requests": list(self.received)})

    async def _metrics(self, body: bytes, send: Callable) -> None:
        await _send_response(send, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST.encode())

    # -- LoRA adapters, as vLLM's runtime loading API (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) --------

    async def _load_lora_adapter(self, body: bytes, send: Callable) -> None:
        request = _parse_json_object(body)
        name, path = request.get("lora_name"), request.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise _HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.engines:
            raise _HTTPError(400, f"'{name}' is a base model name, not an adapter.", "InvalidUserInput")
        async with self.loras.lock(name):
            if name in self._served and not request.get("load_inplace"):
                raise _HTTPError(
                    400, f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                    "place, set 'load_inplace' to True.", "InvalidUserInput")
            base = self._served.get(name) or self.settings.models[0]  # vLLM: the first base model
            self.loras.loading.add(name)
            try:
                await asyncio.sleep(self.settings.lora_load_ms / 1e3 * self.settings.time_scale)
            finally:
                self.loras.loading.discard(name)
            self._served[name] = base
            self.loras.paths[name] = path
            self.loras.ever_loaded = True
        log.info("simulator: loaded LoRA adapter %r from %r", name, path)
        await _send_response(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), None)

    async def _unload_lora_adapter(self, body: bytes, send: Callable) -> None:
        request = _parse_json_object(body)
        name = request.get("lora_name")
        if not isinstance(name, str) or not name:
            raise _HTTPError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        async with self.loras.lock(name):
            if name in self.engines or name not in self._served:
                raise _HTTPError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self._served[name]  # requests already queued or running under it finish normally
            self.loras.paths.pop(name, None)
        log.info("simulator: unloaded LoRA adapter %r", name)
        await _send_response(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), None)

    # -- introspection for an oracle router (simulator-only: vLLM has no such endpoints) ----------

    async def _state(self, body: bytes, send: Callable) -> None:
        with_hashes = "hashes=0" not in _QUERY.get().split("&")
        engines = {model: engine.state(with_hashes=with_hashes) for model, engine in self.engines.items()}
        settings = self.settings
        adapters = {name: {"base": base, "path": self.loras.paths.get(name, name)}
                    for name, base in self._served.items() if name not in self.engines}
        await _send_json(send, {
            "latency_model": settings.latency_model,
            "block_size": settings.block_size if settings.latency_model == "vllm" else None,
            "speed": settings.speed, "time_scale": settings.time_scale, "max_num_seqs": settings.max_num_seqs,
            "num_running": sum(e["num_running"] for e in engines.values()),
            "num_waiting": sum(e["num_waiting"] for e in engines.values()),
            "engines": engines,
            "loras": {"loaded": adapters, "loading": sorted(self.loras.loading), "max_loras": settings.max_loras,
                      "running": sorted({n for e in self.engines.values() for n in e.active_loras(running=True)}),
                      "waiting": sorted({n for e in self.engines.values() for n in e.active_loras(running=False)})},
        })

    async def _cached_prefix(self, body: bytes, send: Callable) -> None:
        request = _parse_json_object(body)
        if request.get("model") is None:
            request["model"] = self.settings.models[0]
        model, engine = self._engine_for(request)
        if "messages" in request:
            messages = request["messages"]
            if not isinstance(messages, list) or not messages:
                raise _bad_request("`messages` must be a non-empty list", "messages")
            text = "".join(_message_text(m, i) for i, m in enumerate(messages))
            prompts: list[tuple[Any, int]] = [(messages, count_tokens(text))]
            chat = True
        else:
            prompts, chat = _parse_prompts(request.get("prompt")), False
        prompt_tokens = sum(tokens for _, tokens in prompts)
        hashes = self._prefix_hashes(model, prompts, chat)
        blocks, cached_tokens = engine.cached_prefix(hashes, prompt_tokens)
        await _send_json(send, {"model": model, "prompt_tokens": prompt_tokens, "block_size": self.settings.block_size,
                                "prompt_blocks": len(hashes), "cached_blocks": blocks,
                                "cached_tokens": cached_tokens})


def _parse_prompts(value: Any, field: str = "prompt") -> list[tuple[Any, int]]:
    """Split ``prompt``/``input`` into ``(item, prompt_tokens)`` pairs."""
    def token_ids(item: Any) -> bool:
        return isinstance(item, list) and bool(item) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item)

    if isinstance(value, str):
        return [(value, count_tokens(value))]
    if token_ids(value):
        return [(value, len(value))]  # one pre-tokenized prompt
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v, count_tokens(v)) for v in value]
        if all(token_ids(v) for v in value):
            return [(v, len(v)) for v in value]
    raise _bad_request(
        f"`{field}` must be a string, a non-empty list of strings, or token id list(s)", field)


def _request_finish_reason(choices: list[_Choice]) -> str:
    return "length" if any(c.finish_reason == "length" for c in choices) else "stop"


def _full_response(response_id: str, created: int, model: str, choices: list[_Choice], usage: dict,
                   chat: bool) -> dict:
    if chat:
        entries = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": None}
                   for c in choices]
    else:
        entries = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                    "stop_reason": None} for c in choices]
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": entries, "usage": usage}


def _embedding(seed: int, dims: int) -> list[float]:
    rng = random.Random(seed)
    vector = [rng.gauss(0.0, 1.0) for _ in range(dims)]
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


def build_app(settings: SimulatorSettings) -> SimulatorApp:
    """Build the simulator's ASGI application (fresh engines and metrics registry)."""
    return SimulatorApp(settings)


# --------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(settings: SimulatorSettings, shutdown_event: asyncio.Event, *,
                on_ready: Callable[[str, int], None] | None = None) -> None:
    """Serve the simulator until ``shutdown_event`` is set, then stop gracefully.

    The socket is bound and listening before ``on_ready(host, port)`` is called
    (``port`` is the real one when ``settings.port`` is 0), so connections made
    after the callback are queued and served.  On shutdown, requests still in
    flight after :data:`SHUTDOWN_GRACE_S` are aborted (a stream is cut without
    ``data: [DONE]``) so that the server stops well within two seconds.
    """
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from backends import hypercorn_drain

    hypercorn_drain.install()  # finish the HTTP/2 responses begun when the stop came
    sock = _listening_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the listening socket from here
    config.loglevel = settings.log_level.upper()
    config.accesslog = None
    config.graceful_timeout = SHUTDOWN_GRACE_S + 1.0  # hypercorn's own backstop
    config.h2_max_concurrent_streams = max(100, 4 * settings.max_num_seqs)
    app = build_app(settings)

    async def abort_after_grace() -> None:
        await shutdown_event.wait()
        await asyncio.sleep(SHUTDOWN_GRACE_S)
        await app.abort_in_flight()

    aborter = asyncio.create_task(abort_after_grace())
    reaper = asyncio.create_task(hypercorn_drain.reap_after(  # the hard stop behind hypercorn's
        shutdown_event, config.graceful_timeout + 0.5, protect={asyncio.current_task(), aborter}))
    if on_ready is not None:
        on_ready(host, port)
    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_event.wait)
    finally:
        for task in (aborter, reaper):
            task.cancel()
        await asyncio.gather(aborter, reaper, return_exceptions=True)
        await app.aclose()
    log.info("simulator on %s:%d stopped", host, port)


def _parse_loras(text: str) -> tuple[tuple[str, str], ...]:
    loras = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, base = item.partition(":")
        if not sep or not name or not base:
            raise argparse.ArgumentTypeError(f"--lora expects name:base[,name:base...], got {item!r}")
        loras.append((name, base))
    return tuple(loras)


def _parse_lora_module(text: str) -> tuple[str, str, str]:
    """vLLM's --lora-modules item: ``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            spec = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r}: {exc}") from None
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name") or ""
    else:
        name, _, path = text.partition("=")
        base = ""
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path or not isinstance(base, str):
        raise argparse.ArgumentTypeError(f"--lora-modules expects name=path, got {text!r}")
    return name, path, base


def _parse_args(argv: list[str] | None) -> SimulatorSettings:
    parser = argparse.ArgumentParser(
        prog="python -m backends.simulator_openai",
        description="OpenAI/vLLM API simulator (not a real model) for testing the gateway.")
    defaults = SimulatorSettings()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port, help="0 picks a free port")
    parser.add_argument("--models", default=",".join(defaults.models),
                        help="comma-separated base model names")
    parser.add_argument("--lora", type=_parse_loras, default=(), help="comma-separated name:base adapters")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="0 means instant")
    parser.add_argument("--decode-tokens-per-s", type=float, default=0.0, help="0 means instant")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--kv-cache-tokens", "--kv-capacity", dest="kv_cache_tokens", type=int,
                        default=defaults.kv_cache_tokens, help="KV-cache capacity in tokens")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scheduling-policy", choices=("priority", "fcfs"), default=defaults.scheduling_policy,
                        help="vLLM's flag: priority orders the queue by the requests' `priority`; fcfs refuses "
                        "a non-zero priority with 400 like vLLM (default here: priority)")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error", "critical"])
    fleet = parser.add_argument_group(
        "fleet simulation", "--latency-model vllm: a continuous-batching engine with a prefix cache "
        "(backends/simulator_engine.py; defaults calibrated on an H100 serving Llama-3.1-8B)")
    fleet.add_argument("--latency-model", choices=LATENCY_MODELS, default=defaults.latency_model,
                       help="simple: per-request pacing (--prefill/--decode-tokens-per-s); "
                            "vllm: engine steps, batch-dependent decode, prefix cache")
    fleet.add_argument("--speed", type=float, default=defaults.speed,
                       help="GPU speed relative to the calibration (0.5: an older, half-as-fast node)")
    fleet.add_argument("--time-scale", type=float, default=defaults.time_scale,
                       help="multiply every simulated duration (slows the whole model down for a small host)")
    fleet.add_argument("--block-size", type=int, default=defaults.block_size, help="KV block size in tokens")
    fleet.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens,
                       help="token budget of one engine step (chunked prefill)")
    fleet.add_argument("--step-base-ms", type=float, default=defaults.step_base_ms,
                       help="fixed cost of one engine step")
    fleet.add_argument("--step-per-seq-ms", type=float, default=defaults.step_per_seq_ms,
                       help="extra step cost per sequence in the batch")
    fleet.add_argument("--prefill-us-per-token", type=float, default=defaults.prefill_us_per_token,
                       help="step cost per uncached prompt token")
    fleet.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="disable the prefix cache (vLLM's flag)")
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--lora-modules", nargs="+", type=_parse_lora_module, default=[], metavar="name=path",
                      help="adapters loaded at start: name=path or JSON {\"name\", \"path\", \"base_model_name\"}")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="most distinct adapters in one batch (vllm model); the max_lora label")
    lora.add_argument("--lora-load-ms", type=float, default=defaults.lora_load_ms,
                      help="how long POST /v1/load_lora_adapter takes (times --time-scale)")
    lora.add_argument("--enable-lora", action="store_true", help="export vllm:lora_requests_info from the start")
    args = parser.parse_args(argv)
    try:
        return SimulatorSettings(
            host=args.host, port=args.port,
            models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
            loras=args.lora, prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_tokens_per_s=args.decode_tokens_per_s, max_num_seqs=args.max_num_seqs,
            kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
            seed=args.seed, log_level=args.log_level,
            latency_model=args.latency_model, speed=args.speed, time_scale=args.time_scale,
            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            step_base_ms=args.step_base_ms, step_per_seq_ms=args.step_per_seq_ms,
            prefill_us_per_token=args.prefill_us_per_token, enable_prefix_caching=args.enable_prefix_caching,
            lora_modules=tuple(args.lora_modules), max_loras=args.max_loras, lora_load_ms=args.lora_load_ms,
            enable_lora=args.enable_lora, scheduling_policy=args.scheduling_policy)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _dump_tasks() -> None:
    """SIGUSR1: print every asyncio task's stack to stderr (what a process that will not stop waits on)."""
    tasks = asyncio.all_tasks()
    print(f"simulator: {len(tasks)} asyncio tasks", file=sys.stderr, flush=True)
    for task in tasks:
        print(f"task {task.get_name()}{' (cancelling)' if task.cancelling() else ''}:", file=sys.stderr)
        awaitable = task.get_coro()
        while awaitable is not None:  # the whole await chain, not only the task's top frame
            frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
            if frame is not None:
                print(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", file=sys.stderr)
            awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
        waiting = getattr(task, "_fut_waiter", None)
        if waiting is not None:
            print(f"  waiting on {waiting!r}", file=sys.stderr)
    sys.stderr.flush()


async def _run_until_signalled(settings: SimulatorSettings) -> None:
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)  # debugging a stop that does not end

    def announce(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"simulator listening on http://{shown}:{port} (OpenAI API simulator, not a real model)",
              flush=True)

    await serve(settings, shutdown, on_ready=announce)


def main(argv: list[str] | None = None) -> int:
    settings = _parse_args(argv)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run_until_signalled(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
