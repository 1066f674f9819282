"""Benchmark: routing policies side by side on a simulated heterogeneous fleet (a benchmark, never a test).

Every number this prints is a SIMULATOR result (backends/simulator_openai.py `--latency-model vllm`),
never a measurement of vLLM.

Fleet: 8 simulator processes on free ports, all endpoints of ONE backend `pool` (kind vllm, labels per
endpoint: gpu, speed, kv), heterogeneous (FLEET below): speed 1.0 (H100-class, the calibration), 0.75,
and one older node at 0.5 (A100-40GB-class); KV capacity 49152 / 24576 / 16384 tokens; 8 running
sequences each; two LoRA adapters (`sql-lora`, `chat-lora`) loaded everywhere with `--max-loras 1`
(one adapter per running batch, so adapter affinity matters). The latency model and its calibration
are backends/simulator_engine.py's: a step lasts (6.2 ms + 0.3 ms per sequence + 33 us per uncached
prefill token) * time_scale / speed, from vLLM 0.21's TPOT on one H100-80GB with Llama-3.1-8B
(6.48 ms at concurrency 1, 10.94 ms at 16, InferenceBench concurrency sweep), the A100-40GB at about
half that speed (vLLM 0.23 sweep, Lambda's "H100 ~2x A100"), prefill 33 us/token an estimate (2 FLOPs x
8e9 parameters at ~50% of 989 TFLOP/s), block size 16 and 8192 batched tokens (vLLM's defaults), a KV
cache with LRU prefix reuse and FCFS queueing when slots or blocks are full. `--time-scale` (default 5)
multiplies every simulated duration: this 2-core machine cannot keep asyncio timers exact at real
millisecond steps, so the model runs 5x slower with request rates 5x lower; reported latencies are in
simulated-and-scaled milliseconds (divide by the time scale for the calibrated GPU's figures).

Workloads (shaped like inference-perf's `shared_prefix` data: num_groups x num_prompts_per_group,
system_prompt_len, question_len, output_len, enable_multi_turn_chat; the llm-d profile is 32x32,
2048 / 256 / 256), scaled to this machine:
  - `shared-prefix`: 16 groups x 8 conversations (`--quick`: 4 x 4, as its cells are ten times
    shorter), a 2048-token system prompt per group, 256-token questions, 32 output tokens (256 scaled
    down to keep runs short), 2 turns per conversation (turn 2 carries turn 1's question and a
    synthetic answer; the simulator caches prompt blocks only); groups 0 and 1 ask the `sql-lora` and
    `chat-lora` adapters, the others the base model;
  - `low-sharing`: a 128-token preamble common to all, then a unique 1024-token question, 32 out.
A token is the simulator's: 4 UTF-8 bytes. Arrivals are Poisson at 50%, 80% and 95% of the fleet's
capacity, measured first in the same run: a closed loop of 1.25 x (sum of running slots) clients
through Envoy's least-request balancing, completed requests per second (its `capacity_rps`).

Policies, every one through the real Envoy and processor (`extproc.stack.Stack`, 1 processor worker,
its own config, one at a time; the simulators are shared and every cell uses fresh prompt text, so no
cell finds another's cache):
  - `round-robin`, `least-request`: Envoy's own balancing (backend `lbPolicy`, no picker);
  - `random`: profile with `random-picker` only;
  - `epp-default`: the Gateway API Inference Extension's default profile (its inferencepool chart's
    EndpointPickerConfig: queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3 with
    GIE's parameters 64 / 256 / 31250, max-score-picker with one endpoint);
  - `adapter-gateway`: ours (ADAPTER_GATEWAY_PROFILE below);
  - `oracle`: `simulator-oracle-scorer` (benchmark only: each decision asks every simulator its true
    cached prefix and queue, and sends the request where the predicted TTFT is least) + max-score-picker.
    Those 16 HTTP calls take about 15 ms per decision on this machine, during which the worker is
    blocked: the oracle's TTFT includes that, so it is a greedy, slowed oracle, not a bound.
Per policy and load: TTFT p50/p90/p99 (to the first content chunk), inter-token latency p50, output
tokens/s, success rate, the busiest endpoint's share of requests (each simulator's own
`vllm:request_success_total`), that share over its capacity-weighted share (weight = speed), the
prefix-cache hit rate (simulators' counters), and the scheduling decision p50 from the processor's
`adapter_processor_scheduler_decision_duration_seconds{profile}` (histogram buckets 10/25/50/100 us,
interpolated). Each cell: a warm-up of `--warmup` s (sent, not measured), then `--duration` s measured,
then the measured requests run to completion.
Run: `.venv/bin/python perf/bench_routing.py [--quick] [--duration 30] [--warmup 10] [--time-scale 5]
[--policies a,b] [--workloads a,b] [--loads 0.5,0.8] [--seed N | --seeds 1,2,3] [--capacity W=R,...]
[--dump FILE] [--out FILE] [--no-write]`. `--seeds` runs each cell once per seed (other Poisson
arrival times and prompts, on the same stack) and reports each row over all its seeds' requests,
with each seed's own p99 under `seeds`: one 30 s cell's p99 is its 4th-5th worst request and moves
by tens of percent between seeds, so goals are judged on pooled seeds. Writes
perf/results/routing.json (and `--out FILE`), appends a dated section to perf/RESULTS.md unless
--no-write. `--quick`: 1 s warm-up + 3 s measured per cell, 4 groups x 4: 298 s here. Everything it starts
is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKLOADS = ("shared-prefix", "low-sharing")
LOADS = (0.5, 0.8, 0.95)
POLICIES = ("round-robin", "least-request", "random", "epp-default", "adapter-gateway", "oracle")
ROW_KEYS = ("workload", "load", "policy", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms",
            "output_tokens_per_s", "success_rate", "max_endpoint_share")
MODEL = "llama-3.1-8b"
LORAS = ("sql-lora", "chat-lora")
TOKEN_BYTES = 4  # the simulator's token
RESULTS_MD = REPO / "perf" / "RESULTS.md"
RESULTS_JSON = REPO / "perf" / "results" / "routing.json"


@dataclass(frozen=True)
class Node:
    name: str
    gpu: str
    speed: float
    kv_tokens: int
    max_num_seqs: int = 8


FLEET = (
    Node("h100-0", "h100", 1.0, 49152), Node("h100-1", "h100", 1.0, 49152),
    Node("h100-2", "h100", 1.0, 24576), Node("h100-3", "h100", 1.0, 24576),
    Node("l40s-0", "l40s", 0.75, 24576), Node("l40s-1", "l40s", 0.75, 16384),
    Node("l40s-2", "l40s", 0.75, 16384), Node("a100-old", "a100-40gb", 0.5, 16384),
)

# ours. Drop saturated endpoints (the EPP rule); then predicted TTFT decides (weight 10): per candidate
# (base + prefill * uncached KB + slot wait * requests waiting for a slot) / speed, from the gateway's
# own exact view (its prefix index's match, its in-flight counts against each node's slots, limited by
# the node's KV tokens; the `speed`, `max-num-seqs` and `kv-tokens` labels), refit online from the
# observed TTFTs. Its starting costs are the simulator's latency model at time scale 5, as an operator
# would set them from their engine's benchmark: prefill 33 us/token x 250 tokens/KB x 5 = 41.25 ms/KB;
# a first step (6.2 + 0.3 x 8 seqs) x 5 = 43 ms; a slot frees every 32 steps x 43 ms / 8 slots = 172 ms.
# Prefix affinity, capacity-relative in-flight counts and LoRA affinity at weight 1 break its ties.
# History (RESULTS.md): the first profile (prefix 3, in-flight relative to the busiest candidate 2,
# queue 1, LoRA 1) sent a request off its group's warm node to a cold one whenever the warm node was
# the busiest, even at 2 of 8 slots: cold 2304-token prefills were the shared-prefix p99 (650 vs the EPP
# default profile's 484 ms at 80%). Weighted-score variants (in-flight against capacity, weights 2-3)
# came to the EPP profile's level but not below it. share-cap-filter (1.35 x the speed-weighted share of
# each worker's last 256 picks) holds the busiest node under the 1.5x goal: at 50% load predicted TTFT
# alone sent 1.75x its share to one warm H100 (RESULTS.md, 14:23 UTC run).
ADAPTER_GATEWAY_PLUGINS = [
    {"type": "saturation-filter", "parameters": {"queueDepthThreshold": 4, "kvCacheUtilThreshold": 0.95}},
    {"type": "share-cap-filter", "parameters": {"maxShareRatio": 1.35}},
    {"type": "prefix-cache-scorer", "parameters": {"blockSize": 256, "capacityLabel": "kv-tokens"}},
    {"type": "predicted-ttft-scorer", "parameters": {"ttftSloMs": 2000, "baseMs": 43, "prefillMsPerKb": 41.25,
                                                     "slotWaitMs": 172}},
    {"type": "in-flight-scorer", "parameters": {"capacityLabel": "max-num-seqs"}},
    {"type": "lora-affinity-scorer"},
    {"type": "max-score-picker", "parameters": {"fallbacks": 1}},
]
ADAPTER_GATEWAY_PROFILE = [
    {"pluginRef": "saturation-filter"}, {"pluginRef": "share-cap-filter"}, {"pluginRef": "prefix-cache-scorer", "weight": 1},
    {"pluginRef": "predicted-ttft-scorer", "weight": 10}, {"pluginRef": "in-flight-scorer", "weight": 1},
    {"pluginRef": "lora-affinity-scorer", "weight": 1}, {"pluginRef": "max-score-picker"},
]


# --------------------------------------------------------------------------------------------------
# Workloads (pure)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadShape:
    name: str
    groups: int
    prompts_per_group: int
    system_prompt_len: int  # tokens
    question_len: int
    output_len: int
    turns: int = 1
    lora_groups: int = 0  # the first N groups ask a LoRA adapter (alternating LORAS)
    shared_system: bool = True  # False: one preamble for everyone, unique questions (low sharing)


SHAPES = {
    "shared-prefix": WorkloadShape("shared-prefix", 16, 8, 2048, 256, 32, turns=2, lora_groups=2),
    "low-sharing": WorkloadShape("low-sharing", 1, 1, 128, 1024, 32, shared_system=False),
}
# --quick: cells of ~30 requests, so 4 groups x 4 conversations (each group recurs ~8 times in a cell,
# turn 2 arrives within it), as the full run's ~300 requests per cell see 16 x 8
QUICK_SHAPES = {**SHAPES, "shared-prefix": WorkloadShape("shared-prefix", 4, 4, 2048, 256, 32, turns=2,
                                                         lora_groups=2)}

_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta", "zeta", "rho",
          "tau", "phi", "chi", "psi", "eta", "iota", "mu", "nu", "xi", "pi", "upsilon", "epsilon")


def text_of(tokens: int, rng: random.Random) -> str:
    """Text of exactly `tokens` simulator tokens (4 ASCII bytes each)."""
    out: list[str] = []
    n = 0
    while n < tokens * TOKEN_BYTES:
        w = rng.choice(_WORDS) + " "
        out.append(w)
        n += len(w)
    return "".join(out)[: tokens * TOKEN_BYTES]


@dataclass(frozen=True)
class Req:
    group: int
    conversation: int
    turn: int
    model: str
    messages: tuple[dict, ...]
    max_tokens: int
    headers: tuple[tuple[str, str], ...] = ()  # extra request headers (perf/bench_qos.py: tenant, objective)

    def prompt_tokens(self) -> int:
        return sum(math.ceil(len(m["content"].encode()) / TOKEN_BYTES) for m in self.messages)


def make_requests(shape: WorkloadShape, n: int, salt: str, seed: int = 0) -> list[Req]:
    """`n` requests of the shape, in arrival order. Text is derived from `salt` (a fresh salt: no cache
    hit from another cell). shared-prefix: all conversations' turn 1 in a shuffled order, then turn 2,
    ... cycling over new conversations while more are needed; low-sharing: every request unique."""
    rng = random.Random(f"{salt}/{seed}")
    reqs: list[Req] = []
    if not shape.shared_system:
        pre = text_of(shape.system_prompt_len, random.Random(f"{salt}/preamble"))
        for i in range(n):
            q = text_of(shape.question_len, random.Random(f"{salt}/{seed}/q{i}"))
            reqs.append(Req(0, i, 1, MODEL, ({"role": "system", "content": pre}, {"role": "user", "content": q}),
                            shape.output_len))
        return reqs
    systems = [text_of(shape.system_prompt_len, random.Random(f"{salt}/sys{g}")) for g in range(shape.groups)]
    epoch = 0
    while len(reqs) < n:
        convs = [(g, p) for g in range(shape.groups) for p in range(shape.prompts_per_group)]
        history: dict[tuple[int, int], list[dict]] = {}
        for turn in range(1, shape.turns + 1):
            order = convs[:]
            rng.shuffle(order)
            for g, p in order:
                key = (g, p)
                msgs = history.setdefault(key, [{"role": "system", "content": systems[g]}])
                cr = random.Random(f"{salt}/{seed}/{epoch}/{g}/{p}/{turn}")
                msgs.append({"role": "user", "content": text_of(shape.question_len, cr)})
                model = LORAS[g % len(LORAS)] if g < shape.lora_groups else MODEL
                reqs.append(Req(g, epoch * shape.prompts_per_group + p, turn, model, tuple(dict(m) for m in msgs),
                                shape.output_len))
                # the next turn carries a synthetic answer (the simulator caches prompt blocks only)
                msgs.append({"role": "assistant", "content": text_of(shape.output_len, cr)})
        epoch += 1
    return reqs[:n]


def prefix_sharing_ratio(reqs: Sequence[Req], block_tokens: int = 16) -> float:
    """Share of all prompt blocks (of `block_tokens` tokens, text of the concatenated contents) that an
    ideal single cache would have seen before: the best hit rate any router could reach."""
    seen: set[int] = set()
    total = hit = 0
    step = block_tokens * TOKEN_BYTES
    for r in reqs:
        text = "".join(m["content"] for m in r.messages).encode()
        parent = hash(r.model)
        for i in range(len(text) // step):
            parent = hash((parent, text[i * step:(i + 1) * step]))
            total += 1
            if parent in seen:
                hit += 1
            else:
                seen.add(parent)
    return hit / total if total else 0.0


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


# --------------------------------------------------------------------------------------------------
# Statistics (pure)
# --------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def shares(counts: dict[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: (c / total if total else 0.0) for k, c in counts.items()}


def max_share_over_capacity(counts: dict[str, float], weights: dict[str, float]) -> float:
    """max over endpoints of (its share of requests) / (its capacity-weighted share)."""
    s = shares(counts)
    wt = sum(weights.values())
    return max((s[k] / (weights[k] / wt) for k in s if weights.get(k)), default=0.0)


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets (last may be +Inf)."""
    b = sorted(buckets)
    if not b or b[-1][1] <= 0:
        return None
    rank = q * b[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in b:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return b[-1][0]


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    status: int = 0
    start: float = 0.0
    prompt_tokens: int | None = None  # from the usage chunk
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (the simulator reports it)
    req: Any = None


def row(workload: str, load: float, policy: str, results: Sequence[Result], window_start: float,
        counts: dict[str, float], **extra: Any) -> dict:
    """One cell's row from its measured requests (`window_start`: when its measured window began)."""
    return pooled_row(workload, load, policy, [(results, window_start)], counts, **extra)


def pooled_row(workload: str, load: float, policy: str, segments: Sequence[tuple[Sequence[Result], float]],
               counts: dict[str, float], **extra: Any) -> dict:
    """A row over one or more measured windows of the same cell (`--seeds`: one per seed): percentiles
    over all their requests together, output tokens/s as all tokens over the windows' summed length."""
    results = [r for seg, _ in segments for r in seg]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itls = [x * 1e3 for r in ok for x in r.itls]
    tokens = sum(r.tokens for r in ok)
    span = 0.0
    for seg, start in segments:
        last = max((r.end for r in seg if r.ok), default=start)
        span += max(0.0, last - start)
    s = shares(counts)

    def rnd(v, d=1):
        return None if v is None else round(v, d)

    out = {"workload": workload, "load": load, "policy": policy,
           "ttft_p50_ms": rnd(percentile(ttfts, 50)), "ttft_p90_ms": rnd(percentile(ttfts, 90)),
           "ttft_p99_ms": rnd(percentile(ttfts, 99)), "itl_p50_ms": rnd(percentile(itls, 50)),
           "output_tokens_per_s": rnd(tokens / span if span > 0 else 0.0),
           "success_rate": round(len(ok) / len(results), 4) if results else None,
           "max_endpoint_share": round(max(s.values()), 4) if s else None,
           "requests": len(results)}
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------------
# The fleet and the gateway
# --------------------------------------------------------------------------------------------------


def start_fleet(time_scale: float) -> list[tuple[Node, subprocess.Popen, int]]:
    from extproc.stack import free_port, wait_http

    fleet = []
    for node in FLEET:
        port = free_port()
        cmd = [sys.executable, "-m", "backends.simulator_openai", "--host", "127.0.0.1", "--port", str(port),
               "--models", MODEL, "--latency-model", "vllm", "--speed", str(node.speed),
               "--time-scale", str(time_scale), "--kv-capacity", str(node.kv_tokens),
               "--max-num-seqs", str(node.max_num_seqs), "--max-model-len", "8192", "--max-loras", "1",
               "--lora-modules", *(f"{a}=/adapters/{a}" for a in LORAS), "--seed", str(len(fleet))]
        fleet.append((node, subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, start_new_session=True),
                      port))
    for node, p, port in fleet:
        wait_http(f"http://127.0.0.1:{port}/health", 60, p, f"simulator {node.name}")
    return fleet


def stop_fleet(sync, fleet: Sequence[tuple[Node, subprocess.Popen, int]]) -> None:
    """The end of a run over `start_fleet`'s simulators: the HTTP client `sync` closed, every simulator stopped."""
    from extproc.stack import stop_process

    sync.close()
    for _, p, _ in fleet:
        stop_process(p)


def gateway_config(policy: str, fleet: Sequence[tuple[Node, Any, int]]) -> dict:
    endpoints = [{"address": f"127.0.0.1:{port}",
                  "labels": {"gpu": n.gpu, "speed": str(n.speed), "kv-tokens": str(n.kv_tokens), "node": n.name,
                             "max-num-seqs": str(n.max_num_seqs)}}
                 for n, _, port in fleet]
    backend: dict[str, Any] = {"name": "pool", "kind": "vllm", "endpoints": endpoints}
    plugins: list = []
    profile: list = []
    if policy == "round-robin":
        backend["lbPolicy"] = "roundRobin"
    elif policy == "least-request":
        backend["lbPolicy"] = "leastRequest"
    elif policy == "random":
        plugins = [{"type": "random-picker", "parameters": {"fallbacks": 1}}]
        profile = [{"pluginRef": "random-picker"}]
    elif policy == "epp-default":
        plugins = [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                   {"type": "prefix-cache-scorer", "parameters": {"blockSize": 64, "maxPrefixBlocksToMatch": 256,
                                                                  "lruCapacityPerServer": 31250}},
                   {"type": "max-score-picker", "parameters": {"fallbacks": 0}}]
        profile = [{"pluginRef": "queue-scorer", "weight": 2}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                   {"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "max-score-picker"}]
    elif policy == "adapter-gateway":
        plugins, profile = ADAPTER_GATEWAY_PLUGINS, ADAPTER_GATEWAY_PROFILE
        override = os.environ.get("BENCH_ROUTING_PROFILE")  # tuning: {"plugins": [...], "profile": [...]}
        if override:
            doc = json.loads(Path(override).read_text())
            plugins, profile = doc["plugins"], doc["profile"]
    elif policy == "oracle":
        plugins = [{"type": "simulator-oracle-scorer"}, {"type": "max-score-picker", "parameters": {"fallbacks": 1}}]
        profile = [{"pluginRef": "simulator-oracle-scorer"}, {"pluginRef": "max-score-picker"}]
    else:
        raise ValueError(policy)
    route: dict[str, Any] = {"path": "/v1/", "match": "prefix", "kind": "openai", "targets": ["pool"],
                             "policy": {"timeout": "120s"}}
    spec: dict[str, Any] = {"backends": [backend], "routes": [route]}
    if profile:
        spec["plugins"] = plugins
        spec["schedulingProfiles"] = [{"name": policy, "plugins": profile}]
        route["plugins"] = [policy]
    return {"apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": f"bench-{policy}"},
            "spec": spec}


def start_stack(policy: str, fleet, run_dir: Path):
    return start_stack_config(policy, gateway_config(policy, fleet), run_dir)


def start_stack_config(name: str, config: dict, run_dir: Path):
    """A started Stack (1 processor worker, free ports) of `config` (perf/bench_qos.py passes its own)."""
    from extproc.stack import Stack, free_port, free_port_block

    cfg = run_dir / f"gw-{name}.yaml"
    cfg.write_text(json.dumps(config, indent=1))  # JSON is YAML
    st = Stack(str(cfg), listen_port=free_port(), admin_port=free_port(), processor_base_port=free_port_block(1),
               processor_admin_port=free_port(), workers=1, run_dir=str(run_dir / name))
    return st.start()


def _families(text: str) -> dict[str, list[tuple[dict, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def sim_counters(client, fleet) -> dict[str, dict[str, float]]:
    out = {}
    for n, _, port in fleet:
        f = _families(client.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
        out[n.name] = {k: sum(v for _, v in f.get(name, ())) for k, name in (
            ("requests", "vllm:request_success_total"), ("hits", "vllm:prefix_cache_hits_total"),
            ("queries", "vllm:prefix_cache_queries_total"))}
    return out


def sim_busy(client, fleet) -> int:
    busy = 0
    for _, _, port in fleet:
        st = client.get(f"http://127.0.0.1:{port}/simulator/state?hashes=0", timeout=5).json()
        busy += st["num_running"] + st["num_waiting"]
    return busy


def decision_buckets(client, stack, profile: str) -> dict[str, list[tuple[float, float]]]:
    """{"": the decision's buckets, plugin: that plugin's} for `profile`, summed over workers."""
    try:
        f = _families(client.get(f"{stack.processor_admin_url}/metrics", timeout=5).text)
    except Exception:
        return {}
    acc: dict[str, dict[float, float]] = {}
    for name, key in (("adapter_processor_scheduler_decision_duration_seconds_bucket", None),
                      ("adapter_processor_scheduler_plugin_duration_seconds_bucket", "plugin")):
        for labels, v in f.get(name, ()):
            if labels.get("profile") == profile:
                le = float(labels["le"])
                d = acc.setdefault(labels[key] if key else "", {})
                d[le] = d.get(le, 0.0) + v
    return {k: sorted(d.items()) for k, d in acc.items()}


def bucket_p50(before: dict, after: dict, key: str) -> float | None:
    b = dict(before.get(key, ()))
    return histogram_quantile([(le, c - b.get(le, 0.0)) for le, c in after.get(key, ())], 0.5)


# --------------------------------------------------------------------------------------------------
# The load generator
# --------------------------------------------------------------------------------------------------


async def one_request(client, url: str, r: Req, timeout: float) -> Result:
    body = {"model": r.model, "messages": list(r.messages), "max_tokens": r.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    res = Result(ok=False, start=t0, req=r)
    last = None
    chunks = 0
    usage_tokens = None
    done = False
    try:
        async with client.stream("POST", url, json=body, headers=dict(r.headers), timeout=timeout) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                res.end = time.monotonic()
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                doc = json.loads(data)
                if doc.get("usage"):
                    usage = doc["usage"]
                    usage_tokens = usage.get("completion_tokens")
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                content = any((c.get("delta") or {}).get("content") for c in doc.get("choices") or ())
                if content:
                    now = time.monotonic()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
    except Exception:
        res.end = time.monotonic()
        return res
    res.end = time.monotonic()
    res.tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = done and res.ttft is not None
    return res


async def open_loop(url: str, reqs: Sequence[Req], arrivals: Sequence[float], measured_from: float,
                    measured_to: float, timeout: float) -> tuple[list[Result], float]:
    """Send reqs[i] at arrivals[i]; the measured ones' results and the measured window's start (monotonic)."""
    import httpx

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.monotonic()
        tasks = []
        for r, at in zip(reqs, arrivals):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one_request(client, url, r, timeout))
            if measured_from <= at < measured_to:
                tasks.append(task)
        results = list(await asyncio.gather(*tasks))
        return results, t0 + measured_from


async def closed_loop(url: str, reqs: Sequence[Req], clients: int, warmup: float, duration: float,
                      timeout: float) -> float:
    """Completed requests per second over `duration` after `warmup`, with `clients` always in flight."""
    import httpx

    it = iter(reqs)
    done_in_window = 0
    start = time.monotonic()
    w0, w1 = start + warmup, start + warmup + duration

    async def worker(client):
        nonlocal done_in_window
        while time.monotonic() < w1:
            try:
                r = next(it)
            except StopIteration:
                return
            res = await one_request(client, url, r, timeout)
            if res.ok and w0 <= res.end < w1:
                done_in_window += 1

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return done_in_window / duration


def dump_requests(path: str, policy: str, workload: str, load: float, results: Sequence[Result],
                  window_start: float) -> None:
    with open(path, "a") as f:
        for res in results:
            r = res.req
            f.write(json.dumps({
                "policy": policy, "workload": workload, "load": load, "at_s": round(res.start - window_start, 3),
                "group": r.group if r else None, "turn": r.turn if r else None, "model": r.model if r else None,
                "ok": res.ok, "status": res.status, "ttft_ms": round(res.ttft * 1e3, 1) if res.ttft is not None else None,
                "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                # the node's speed shows in its inter-token latency (step time / speed)
                "itl_p50_ms": round(percentile([x * 1e3 for x in res.itls], 50), 1) if res.itls else None}) + "\n")


def wait_idle(client, fleet, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while sim_busy(client, fleet) and time.monotonic() < end:
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def goals(rows: Sequence[dict]) -> list[str]:
    def get(w, load, p):
        return next((r for r in rows if r["workload"] == w and r["load"] == load and r["policy"] == p), None)

    out = []
    ag, rr, epp, orc = (get("shared-prefix", 0.8, p) for p in ("adapter-gateway", "round-robin", "epp-default",
                                                                 "oracle"))

    def mark(ok):
        return "MET" if ok else "NOT MET"

    if ag and rr and epp and orc and None not in (ag["ttft_p99_ms"], rr["ttft_p99_ms"], epp["ttft_p99_ms"],
                                                   orc["ttft_p99_ms"]):
        a = ag["ttft_p99_ms"]
        out.append(f"shared-prefix 80%: p99 TTFT {a:g} ms vs round-robin {rr['ttft_p99_ms']:g} ms "
                   f"({100 * (1 - a / rr['ttft_p99_ms']):.0f}% lower; goal >= 50%): {mark(a <= 0.5 * rr['ttft_p99_ms'])}")
        out.append(f"shared-prefix 80%: vs epp-default {epp['ttft_p99_ms']:g} ms "
                   f"({100 * (1 - a / epp['ttft_p99_ms']):.0f}% lower; goal >= 20%): {mark(a <= 0.8 * epp['ttft_p99_ms'])}")
        t = ag["output_tokens_per_s"]
        out.append(f"shared-prefix 80%: output tokens/s {t:g} vs round-robin {rr['output_tokens_per_s']:g}, "
                   f"epp-default {epp['output_tokens_per_s']:g} (goal: not lower than either): "
                   f"{mark(t >= rr['output_tokens_per_s'] and t >= epp['output_tokens_per_s'])}")
        out.append(f"shared-prefix 80%: within 15% of the oracle's p99 TTFT {orc['ttft_p99_ms']:g} ms "
                   f"({100 * (a / orc['ttft_p99_ms'] - 1):+.0f}%): {mark(a <= 1.15 * orc['ttft_p99_ms'])}"
                   + (" (below the oracle: the greedy, slowed oracle is no bound here)"
                      if a < orc["ttft_p99_ms"] else ""))
    for load in LOADS:
        ag, lr = get("low-sharing", load, "adapter-gateway"), get("low-sharing", load, "least-request")
        if ag and lr and ag["ttft_p99_ms"] and lr["ttft_p99_ms"]:
            d = ag["ttft_p99_ms"] / lr["ttft_p99_ms"] - 1
            d50 = ag["ttft_p50_ms"] / lr["ttft_p50_ms"] - 1
            out.append(f"low-sharing {int(load * 100)}%: TTFT vs least-request p99 {ag['ttft_p99_ms']:g} vs "
                       f"{lr['ttft_p99_ms']:g} ms ({100 * d:+.0f}%), p50 {ag['ttft_p50_ms']:g} vs {lr['ttft_p50_ms']:g} "
                       f"ms ({100 * d50:+.0f}%), goal within 3% (no worse than +3%): p99 {mark(d <= 0.03)}, "
                       f"p50 {mark(d50 <= 0.03)}")
    worst = [r for r in rows if r["policy"] == "adapter-gateway" and r.get("max_share_over_capacity_share")]
    if worst:
        w = max(worst, key=lambda r: r["max_share_over_capacity_share"])
        out.append(f"adapter-gateway, busiest endpoint over its capacity-weighted share: at most "
                   f"{w['max_share_over_capacity_share']:.2f}x ({w['workload']} {int(w['load'] * 100)}%), goal <= 1.5x: "
                   f"{mark(w['max_share_over_capacity_share'] <= 1.5)}")
    dec = [r["decision_p50_us"] for r in rows if r["policy"] == "adapter-gateway" and r.get("decision_p50_us")]
    if dec:
        out.append(f"decision cost (adapter-gateway, 8 endpoints, the processor's own timer): p50 "
                   f"{min(dec):.0f}-{max(dec):.0f} us across cells, goal <= 50 us: {mark(max(dec) <= 50)}")
    return out


def table(rows: Sequence[dict]) -> str:
    head = ("| workload | load | policy | req | TTFT p50 | p90 | p99 ms | ITL p50 ms | out tok/s | success | "
            "busiest share (/cap. share) | prefix hit | decision p50 µs |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt="g"):
        return "–" if v is None else format(v, fmt)

    for r in rows:
        lines.append(f"| {r['workload']} | {int(r['load'] * 100)}% | {r['policy']} | {r['requests']} | "
                     f"{f(r['ttft_p50_ms'])} | {f(r['ttft_p90_ms'])} | {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'])} | "
                     f"{f(r['output_tokens_per_s'])} | {f(r['success_rate'])} | {f(r['max_endpoint_share'])} "
                     f"({f(r.get('max_share_over_capacity_share'))}) | {f(r.get('prefix_hit_rate'))} | "
                     f"{f(r.get('decision_p50_us'))} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 s warm-up + 3 s measured per cell (about 5 min)")
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds per cell")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of arrivals sent before measuring")
    ap.add_argument("--capacity-duration", type=float, default=20.0)
    ap.add_argument("--capacity", help="skip the capacity measurement: WORKLOAD=REQ_PER_S,... from an earlier run "
                                       "(on the same machine and fleet; for iterating on one policy)")
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--loads", default=",".join(map(str, LOADS)))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", help="run every cell once per seed (comma list, e.g. 1,2,3: other arrival times and "
                                    "prompts) and report each row over all of their requests together; a p99 of one "
                                    "30 s cell is its 4th-5th worst request, so single cells move by tens of percent")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--no-write", action="store_true", help="print only: RESULTS.md and results/routing.json untouched")
    ap.add_argument("--dump", help="append one JSON line per measured request (policy, workload, load, group, turn, "
                                   "model, ttft_ms, prompt_tokens, cached_tokens, status) to this file, to diagnose")
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [args.seed]
    if args.quick:
        args.duration, args.warmup, args.capacity_duration = 3.0, 1.0, 4.0
    shapes = QUICK_SHAPES if args.quick else SHAPES
    policies = [p for p in args.policies.split(",") if p]
    workloads = [w for w in args.workloads.split(",") if w]
    loads = [float(x) for x in args.loads.split(",") if x]
    for p in policies:
        assert p in POLICIES, p
    for w in workloads:
        assert w in WORKLOADS, w

    import httpx

    import benchenv

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    fleet = start_fleet(args.time_scale)
    weights = {n.name: n.speed for n, _, _ in fleet}
    sync = httpx.Client()
    rows: list[dict] = []
    capacity: dict[str, float] = {}
    timeout = 120.0
    try:
        # 1. capacity: closed loop through Envoy's least request (or as given)
        if args.capacity:
            for item in args.capacity.split(","):
                w, _, v = item.partition("=")
                capacity[w.strip()] = float(v)
            missing = [w for w in workloads if w not in capacity]
            if missing:
                ap.error(f"--capacity has no value for {', '.join(missing)}")
        st = start_stack("least-request", fleet, run_dir) if not args.capacity else None
        try:
            clients = int(1.25 * sum(n.max_num_seqs for n in FLEET))
            for w in workloads if st is not None else ():
                reqs = make_requests(shapes[w], 4000, salt=f"capacity/{w}", seed=args.seed)
                cap = asyncio.run(closed_loop(st.url + "/v1/chat/completions", reqs, clients,
                                              2.0 if args.quick else max(3.0, args.warmup),
                                              args.capacity_duration, timeout))
                capacity[w] = cap
                print(f"capacity {w}: {cap:.2f} req/s ({clients} closed-loop clients, least-request)", flush=True)
                wait_idle(sync, fleet)
        finally:
            if st is not None:
                st.stop()
        # 2. the cells, one policy's stack at a time
        for policy in policies:
            st = start_stack(policy, fleet, run_dir)
            try:
                for w in workloads:
                    for load in loads:
                        rate = load * capacity[w]
                        total = args.warmup + args.duration
                        segments, counts, hits, queries, per_seed = [], {}, 0.0, 0.0, {}
                        d0 = decision_buckets(sync, st, policy)
                        for seed in seeds:
                            arrivals = poisson_arrivals(rate, total, seed=zlib.crc32(f"{seed}/{w}/{load}".encode()))
                            reqs = make_requests(shapes[w], len(arrivals), salt=f"{policy}/{w}/{load}/{seed}"
                                                 if len(seeds) > 1 else f"{policy}/{w}/{load}", seed=seed)
                            wait_idle(sync, fleet)
                            c0 = sim_counters(sync, fleet)
                            results, w_start = asyncio.run(open_loop(st.url + "/v1/chat/completions", reqs,
                                                                     arrivals, args.warmup, total, timeout))
                            c1 = sim_counters(sync, fleet)
                            if args.dump:
                                dump_requests(args.dump, policy, w, load, results, w_start)
                            segments.append((results, w_start))
                            for k in c1:
                                counts[k] = counts.get(k, 0) + c1[k]["requests"] - c0[k]["requests"]
                            hits += sum(c1[k]["hits"] - c0[k]["hits"] for k in c1)
                            queries += sum(c1[k]["queries"] - c0[k]["queries"] for k in c1)
                            one = pooled_row(w, load, policy, [(results, w_start)], {})
                            per_seed[str(seed)] = {"ttft_p99_ms": one["ttft_p99_ms"], "requests": one["requests"]}
                        d1 = decision_buckets(sync, st, policy)
                        dec = bucket_p50(d0, d1, "")
                        plugin_p50 = {k: round(v * 1e6, 1) for k in d1 if k
                                      for v in [bucket_p50(d0, d1, k)] if v is not None}
                        r = pooled_row(w, load, policy, segments, counts, rate_rps=round(rate, 3),
                                       max_share_over_capacity_share=round(max_share_over_capacity(counts, weights), 3),
                                       prefix_hit_rate=round(hits / queries, 3) if queries else None,
                                       decision_p50_us=round(dec * 1e6, 1) if dec is not None else None,
                                       plugin_p50_us=plugin_p50,
                                       endpoint_requests={k: int(v) for k, v in counts.items()},
                                       **({"seeds": per_seed} if len(seeds) > 1 else {}))
                        rows.append(r)
                        print(f"{w:13s} {int(load * 100):3d}% {policy:15s} n={r['requests']:4d} "
                              f"TTFT p50/p90/p99 {r['ttft_p50_ms']}/{r['ttft_p90_ms']}/{r['ttft_p99_ms']} ms "
                              f"ITL {r['itl_p50_ms']} ms {r['output_tokens_per_s']} tok/s ok {r['success_rate']} "
                              f"busiest {r['max_endpoint_share']} hit {r['prefix_hit_rate']} "
                              f"decision {r['decision_p50_us']} us", flush=True)
            finally:
                st.stop()
    finally:
        stop_fleet(sync, fleet)
    elapsed = time.monotonic() - started
    doc = {"rows": rows, "capacity_rps": capacity, "time_scale": args.time_scale, "quick": args.quick,
           "duration_s": args.duration, "warmup_s": args.warmup, "seeds": seeds, "elapsed_s": round(elapsed),
           "fleet": [vars(n) for n in FLEET], "workloads": {w: vars(shapes[w]) for w in workloads},
           "note": "simulator results (backends/simulator_openai.py --latency-model vllm), not measurements of vLLM"}
    tbl = table(rows)
    checked = goals(rows)
    benchenv.report(tbl, checked, elapsed, json.dumps(doc, indent=1), args.out, args.no_write, RESULTS_JSON)
    if not args.no_write:
        cmd = "perf/bench_routing.py " + " ".join(argv if argv is not None else sys.argv[1:])
        fleet_txt = ", ".join(f"{n.name} (speed {n.speed:g}, KV {n.kv_tokens}, {n.max_num_seqs} seqs)" for n in FLEET)
        with RESULTS_MD.open("a") as f:
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: routing policies on a simulated "
                    f"fleet (perf/bench_routing.py)\n\n"
                    f"- machine: {benchenv.cpu()}; code {benchenv.git_revision()}; `.venv/bin/python {cmd.strip()}` "
                    f"({elapsed:.0f} s)\n"
                    f"- SIMULATOR results (backends/simulator_openai.py `--latency-model vllm`, time scale "
                    f"{args.time_scale:g}: latencies are simulated ms x {args.time_scale:g}), not measurements of vLLM.\n"
                    f"- fleet: {fleet_txt}; LoRA sql-lora, chat-lora on every node, --max-loras 1.\n"
                    + (f"- capacity (given with --capacity, not measured in this run): " if args.capacity else
                     f"- capacity (closed loop, least-request): ")
                    + ", ".join(f"{w} {c:.2f} req/s" for w, c in capacity.items())
                    + f"; per cell {args.warmup:g} s warm-up + {args.duration:g} s measured, Poisson"
                    + (f", once per seed {', '.join(map(str, seeds))}: each row is over all of its seeds' requests"
                       if len(seeds) > 1 else "") + ".\n"
                    f"- machine load average (1 min) at the start: {load_before:.1f} on {os.cpu_count()} cores"
                    + (": `--quick`, tens of requests per cell (p99 is about the maximum), on cores shared with other "
                       "work: NOT final numbers" if args.quick else "") + ".\n"
                    f"- decision and plugin p50s come from histogram buckets "
                    f"(…, 10, 15, 20, 30, 40, 50, 60, 80, 100, 150, 250 µs, …), "
                    f"interpolated: a value means 'in that bucket'.\n\n"
                    f"{tbl}\n\nGoals of issue 10 item 7/8 (this run):\n\n"
                    + "\n".join("- " + g for g in checked) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
